"""0210-pinned-pool: exact-size anonymous mmap pool, RAM / memlock checks, the
host-wide flock that serialises PP ranks, and (GPU only) a real cudaHostRegister
plus a UVA read."""

import multiprocessing as mp
import os
import resource
import time

import pytest
import torch

from vllm.v1.worker import pinned_host_pool as php

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


class _StubPin:
    """Stands in for cudaHostRegister where no GPU exists: records the range."""

    def __init__(self):
        self.calls = []

    def pin(self, t):
        self.calls.append(("pin", t.data_ptr(), t.nbytes))

    def unpin(self, t):
        self.calls.append(("unpin", t.data_ptr(), t.nbytes))


def _pin_kwargs():
    if HAS_CUDA:
        return {}
    stub = _StubPin()
    return {"pin": stub.pin, "unpin": stub.unpin}


@pytest.fixture
def unlimited_memlock(monkeypatch):
    """The memlock policy has its own tests; elsewhere the host's limit (8 MiB
    on the dev box) must not decide the outcome."""
    monkeypatch.setattr(php.resource, "getrlimit",
                        lambda r: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _meminfo(tmp_path, kib):
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal:       131072000 kB\nMemFree:        1000 kB\n"
                 f"MemAvailable:   {kib} kB\nBuffers:  0 kB\n")
    return str(p)


@pytest.mark.parametrize("nbytes", [2, 4097, 3 * 2**20 + 12_345, 99_483_648 + 7])
def test_exact_size_not_rounded(tmp_path, nbytes, unlimited_memlock):
    stub = _StubPin()
    pool = php.allocate_pinned_host_pool(
        nbytes, what="test", pin=stub.pin, unpin=stub.unpin,
        lock_path=str(tmp_path / "lock"))
    try:
        t = pool.tensor
        assert t.dtype == torch.uint8 and t.numel() == nbytes == t.nbytes
        # registered range = exactly the bytes asked for, page-aligned start
        assert stub.calls == [("pin", t.data_ptr(), nbytes)]
        assert t.data_ptr() % mmap_page() == 0
        t[-1] = 7
        t[0] = 3
        assert int(t[-1]) == 7 and int(t[0]) == 3
        assert php.pinned_bytes_in_use() >= nbytes
        del t
    finally:
        pool.release()
    assert stub.calls[-1][0] == "unpin"


def mmap_page():
    import mmap
    return mmap.PAGESIZE


def test_power_of_two_would_round():
    # what the pool avoids: 4.24 GiB through the caching host allocator -> 8 GiB
    n = int(4.24 * 2**30)
    assert 1 << (n - 1).bit_length() == 8 * 2**30


def test_ram_check_message(tmp_path, unlimited_memlock):
    info = _meminfo(tmp_path, 10 * 2**20)  # 10 GiB available
    with pytest.raises(php.HostMemoryError) as e:
        php.allocate_pinned_host_pool(
            11 * 2**30, what="QSA host K/V rank 1", pin=lambda t: pytest.fail("pinned"),
            lower_hint="--kv-cache-memory-bytes (~93 B host per byte)",
            lock_path=str(tmp_path / "lock"), meminfo=info)
    msg = str(e.value)
    assert "11.00 GiB" in msg and "10.00 GiB" in msg
    assert "--kv-cache-memory-bytes" in msg and "QSA host K/V rank 1" in msg
    # enough RAM: passes and returns what was read
    assert php.check_host_ram(2**30, what="x", lower_hint="y", meminfo=info) == 10 * 2**30
    assert php.read_mem_available() > 0  # the real /proc/meminfo parses


def test_memlock_check():
    with pytest.raises(php.HostMemoryError, match="ulimits: memlock -1"):
        php.check_memlock(2**30, what="pool", limit=64 * 1024)
    php.check_memlock(2**40, what="pool", limit=resource.RLIM_INFINITY)
    php.check_memlock(2**20, what="pool", limit=2**21)


def test_memlock_checked_on_allocate(tmp_path, monkeypatch):
    monkeypatch.setattr(php.resource, "getrlimit", lambda r: (8 * 2**20, 8 * 2**20))
    with pytest.raises(php.HostMemoryError, match="RLIMIT_MEMLOCK"):
        php.allocate_pinned_host_pool(
            16 * 2**20, what="pool", pin=lambda t: pytest.fail("pinned"),
            lock_path=str(tmp_path / "lock"), strict_memlock=True)
    # default: named in a warning, start-up goes on (the driver was measured
    # to register 64 MiB under a 1 MiB limit)
    warned = []
    monkeypatch.setattr(php.logger, "warning", lambda fmt, e: warned.append(str(e)))
    stub = _StubPin()
    pool = php.allocate_pinned_host_pool(16 * 2**20, what="pool", pin=stub.pin,
                                         unpin=stub.unpin, lock_path=str(tmp_path / "lock"))
    assert pool.tensor.nbytes == 16 * 2**20 and len(stub.calls) == 1
    assert warned and "ulimits: memlock -1" in warned[0]
    pool.release()


# ---- the lock serialises several processes ----

def _rank_worker(lock_path, inside, max_inside, use_lock, nbytes):
    """One 'PP rank': the real allocate path with the RAM check instrumented
    to count how many processes are between check and pin at once."""
    real_check = php.check_host_ram

    def slow_check(*a, **kw):
        with inside.get_lock():
            inside.value += 1
            max_inside.value = max(max_inside.value, inside.value)
        # The window in which another rank could pass the check: held until a
        # second rank is inside too (at most 1.5 s), so a slow fork on a busy
        # host does not hide the overlap the control test looks for.
        deadline = time.monotonic() + 1.5
        while inside.value < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        out = real_check(*a, **kw)
        return out

    def pin(t):
        with inside.get_lock():
            inside.value -= 1

    php.check_host_ram = slow_check
    if not use_lock:
        php.pool_lock = _no_lock
    pool = php.allocate_pinned_host_pool(nbytes, what="rank", pin=pin, unpin=None,
                                         lock_path=lock_path)
    pool.release()


class _no_lock:
    """pool_lock without the flock: a private registry file per process."""

    def __init__(self, path):
        self.fd = os.open(f"{path}.{os.getpid()}", os.O_RDWR | os.O_CREAT, 0o600)

    def __enter__(self):
        return self.fd

    def __exit__(self, *a):
        os.close(self.fd)
        return False


def _run_ranks(tmp_path, use_lock, n=3):
    ctx = mp.get_context("fork")
    inside, max_inside = ctx.Value("i", 0), ctx.Value("i", 0)
    procs = [ctx.Process(target=_rank_worker,
                         args=(str(tmp_path / "pool.lock"), inside, max_inside, use_lock, 8192))
             for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return max_inside.value


def test_flock_serialises_ranks(tmp_path):
    assert _run_ranks(tmp_path, use_lock=True) == 1


def test_race_detector_sees_overlap_without_lock(tmp_path):
    # control: the same detector does catch two ranks inside at once
    assert _run_ranks(tmp_path, use_lock=False) > 1


# ---- GPU machine: real cudaHostRegister + a UVA read ----

@requires_cuda
def test_real_cuda_host_register_and_uva(tmp_path, unlimited_memlock):
    from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

    nbytes = 64 * 2**20 + 4096 + 5
    pool = php.allocate_pinned_host_pool(nbytes, what="gpu test",
                                         lock_path=str(tmp_path / "lock"))
    try:
        assert pool.tensor.is_pinned() and pool.tensor.nbytes == nbytes
        pool.tensor[:] = torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
        view = get_accelerator_view_from_cpu_tensor(pool.tensor)
        assert view.is_cuda and view.data_ptr() != 0
        assert torch.equal(view.sum(dtype=torch.int64).cpu(),
                           pool.tensor.sum(dtype=torch.int64))
        view[-1] = 9  # GPU write through UVA lands in the host mapping
        torch.cuda.synchronize()
        assert int(pool.tensor[-1]) == 9
    finally:
        pool.release()


def test_gate_selects_pool(monkeypatch):
    seen = []

    class _P:
        tensor = torch.zeros(3, dtype=torch.uint8)

    def fake_pool(nbytes, **kw):
        seen.append((nbytes, kw["what"]))
        return _P()

    monkeypatch.setattr(php, "allocate_pinned_host_pool", fake_pool)
    monkeypatch.setenv("VLLM_PINNED_POOL", "1")
    assert php.allocate_pinned_host_buffer(3, what="qsa") is _P.tensor
    assert seen == [(3, "qsa")]
    monkeypatch.setenv("VLLM_PINNED_POOL", "0")
    called = []
    monkeypatch.setattr(php.torch, "empty", lambda *a, **kw: called.append(kw) or "upstream")
    assert php.allocate_pinned_host_buffer(5, what="qsa") == "upstream"
    assert called[0]["pin_memory"] is True and len(seen) == 1


@requires_cuda
def test_gate_off_uses_torch_pin_memory(monkeypatch):
    monkeypatch.setenv("VLLM_PINNED_POOL", "0")
    t = php.allocate_pinned_host_buffer(4096 + 3, what="gpu gate off")
    assert t.is_pinned() and t.nbytes == 4096 + 3


# ---- the free-RAM check: reserve, the other ranks' total, the rank label ----

def test_ram_check_keeps_a_reserve(tmp_path):
    info = _meminfo(tmp_path, 10 * 2**20)  # 10 GiB available
    fits = 10 * 2**30 - php.HOST_RESERVE_BYTES
    assert php.check_host_ram(fits, what="x", lower_hint="y", meminfo=info) == 10 * 2**30
    with pytest.raises(php.HostMemoryError, match="left free"):
        php.check_host_ram(fits + 1, what="x", lower_hint="y", meminfo=info)


def test_ram_check_names_the_other_ranks_and_the_total(tmp_path, unlimited_memlock):
    """A pool pinned by another live process of the host (the registry in the
    lock file) appears in the next rank's error with the sum of both."""
    lock = str(tmp_path / "lock")
    ctx = mp.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()

    def other_rank():
        stub = _StubPin()
        php.allocate_pinned_host_pool(3 * 2**20, what="QSA host K/V (4 layers)",
                                      rank_label="PP rank 0/3", pin=stub.pin,
                                      unpin=None, lock_path=lock)
        ready.set()
        done.wait(30)

    p = ctx.Process(target=other_rank)
    p.start()
    try:
        assert ready.wait(30)
        info = _meminfo(tmp_path, 10 * 2**20)
        with pytest.raises(php.HostMemoryError) as e:
            php.allocate_pinned_host_pool(9 * 2**30, what="QSA host K/V (5 layers)",
                                          rank_label="PP rank 2/3",
                                          pin=lambda t: pytest.fail("pinned"),
                                          lock_path=lock, meminfo=info)
        msg = str(e.value)
        assert "[PP rank 2/3]" in msg and "PP rank 0/3: QSA host K/V (4 layers)" in msg
        assert f"{9 * 2**30 + 3 * 2**20:,} B) with this pool" in msg
    finally:
        done.set()
        p.join(30)
    # the other process has exited: its line no longer counts
    with php.pool_lock(lock) as fd:
        assert php.read_registry(fd) == []


def test_rank_label_and_kv_hint(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "vllm.distributed.parallel_state", raising=False)
    assert php.rank_label_default() == f"pid {os.getpid()}"
    from types import SimpleNamespace

    import vllm.config

    cfg = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_memory_bytes=783_000_000))
    monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: cfg)
    hint = php.kv_cache_flag_hint(22 * 2**30)
    # computed from the sizes, not a fixed 93x
    assert f"{22 * 2**30 / 783_000_000:.1f} B of host RAM per byte" in hint
    assert "93" not in hint and "kv_capacity.py" in hint
