"""One process per PP rank over gloo, for the mem-01 and MTP PP tests: the
port, the per-rank result report and the parent side that starts, collects
and reaps the ranks (shared by mem_pp_worker.py and mtp_pp_worker.py)."""

import datetime
import socket
import traceback


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def leave_together():
    """Rank 0 hosts the TCPStore: a rank that is done early (the first ranks
    build no draft) must not exit while the others still create their gloo
    groups through it (CI: 'Connection reset by peer' in new_group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=120), wait_all_ranks=True)
        except Exception:  # a rank that failed already reported its traceback
            pass


def report(rank, q, build, *args):
    """In a rank: put (rank, build(*args)) or (rank, traceback), then wait for
    the other ranks before exiting."""
    try:
        q.put((rank, build(*args)))
    except Exception:
        q.put((rank, traceback.format_exc()))
    finally:
        leave_together()


def run_ranks(ctx, target, world, *extra):
    """Start target(rank, world, port, *extra, q) for every rank, return
    {rank: result}; a rank that raised fails the test with its traceback."""
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *extra, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        res = dict(q.get(timeout=240) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():  # never leave a rank behind
                p.kill()
    for r, v in res.items():
        assert isinstance(v, dict), f"rank {r} failed:\n{v}"
    return res
