"""3-stage pipeline-parallel harness for the deferred PP receive (decode-03).

Three CPU processes, real torch.distributed gloo, and the real vLLM classes:
``Worker.execute_model`` (vllm/v1/worker/gpu_worker.py, unbound on a bare
Worker object), ``GroupCoordinator.irecv_tensor_dict`` /
``isend_tensor_dict`` (the PP group is a real GroupCoordinator on gloo,
installed as ``parallel_state._PP``), and, with VLLM_PP_DEFERRED_RECV=1,
``DeferredRecvIntermediateTensors``. Only the model runner is a stand-in
(``HarnessRunner``): like the V2 runner it prepares inputs first (a sleep of
``prep_ms``) and reads ``intermediate_tensors.tensors`` just before forward
(mr2:1876); forward is a sleep of ``gpu_ms``. The runner is synchronous, so
``gpu_ms`` stands for launch + device time until the output can be sent.
The last rank returns the step's "sampled token" to rank 0 over a separate
gloo group, and rank 0 waits for it before preparing the next step (one
request decoding: step t+1 needs step t's token).

Used by tests/pp/test_pp_deferred_recv.py and
scripts/bench/bench_deferred_recv.py. Children are forked from the caller
(who has already paid for ``import vllm``), bounded by a wall-clock timeout,
and killed (by pid) when it passes, so a deadlock fails instead of hanging.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

WORLD = 3
NUMEL = 8  # tiny hidden_states: the harness measures host order, not bandwidth


@dataclasses.dataclass
class HarnessConfig:
    deferred: bool = True  # VLLM_PP_DEFERRED_RECV for every rank
    steps: int = 20
    prep_ms: float = 0.0  # input/attention-metadata prep per rank
    gpu_ms: float = 0.0  # forward (launch + device) per rank
    rank0_prep_ms: float | None = None  # slow stage 0 (None: prep_ms)
    # Per-rank prep (index = rank), e.g. measured by
    # scripts/bench/measure_runner_prep.py; overrides prep_ms/rank0_prep_ms.
    rank_prep_ms: tuple[float, ...] | None = None
    # Steps whose .tensors a rank does not read: "none", "mixed" (per rank and
    # step, pseudo-random, about 1 in 3), "all".
    unread: str = "none"
    # The last rank's runner raises before reading .tensors on these steps
    # (every Nth step, 0 = never); the harness catches it and goes on.
    raise_every: int = 0
    # Every Nth step schedules 0 tokens on all ranks (no forward, no recv).
    empty_every: int = 0
    feedback: bool = True
    warmup: int = 0  # steps left out of step-time statistics
    trace_steps: int = 50  # per-step event timestamps kept for the first N
    timeout_s: float = 60.0  # wall clock for the whole run
    comm_timeout_s: float = 30.0  # gloo timeout inside the ranks


def expected_hidden(step: int, src_rank: int):
    """hidden_states that rank ``src_rank`` sends for ``step``."""
    import torch

    return torch.arange(NUMEL, dtype=torch.float32) + 1000.0 * step + src_rank


def rank_prep_ms(cfg: HarnessConfig, rank: int) -> float:
    """Input-preparation time of ``rank`` per step."""
    if cfg.rank_prep_ms is not None:
        return float(cfg.rank_prep_ms[rank])
    if rank == 0 and cfg.rank0_prep_ms is not None:
        return cfg.rank0_prep_ms
    return cfg.prep_ms


def is_unread(cfg: HarnessConfig, rank: int, step: int) -> bool:
    if rank == 0 or cfg.unread == "none":
        return False
    if cfg.unread == "all":
        return True
    # Fixed LCG hash: the same pattern in every run and process.
    return ((step * 2654435761 + rank * 40503) >> 7) % 3 == 0


def is_empty(cfg: HarnessConfig, step: int) -> bool:
    return cfg.empty_every > 0 and step % cfg.empty_every == cfg.empty_every - 1


def raises(cfg: HarnessConfig, rank: int, step: int) -> bool:
    return (
        cfg.raise_every > 0
        and rank == WORLD - 1
        and step % cfg.raise_every == cfg.raise_every // 2
    )


class RunnerError(RuntimeError):
    pass


class HarnessRunner:
    """Stand-in for the V2 GPUModelRunner's execute_model."""

    is_pooling_model = False

    def __init__(self, cfg, rank, log, feedback_group):
        self.cfg = cfg
        self.rank = rank
        self.log = log
        self.feedback_group = feedback_group
        self.received: dict[int, list[float]] = {}
        self.errors: list[str] = []

    def execute_model(self, scheduler_output, intermediate_tensors):
        import torch
        import torch.distributed as dist

        from vllm.sequence import IntermediateTensors

        cfg, rank, step = self.cfg, self.rank, scheduler_output.step
        if scheduler_output.total_num_scheduled_tokens == 0:
            return None
        self.log("step_start", step)
        if rank == 0 and cfg.feedback and step > 0:
            prev = self._prev_forward_step(step)
            if prev is not None:
                self.expect_token(prev)
        prep_ms = rank_prep_ms(cfg, rank)
        self.log("prep_start", step)
        if prep_ms:
            time.sleep(prep_ms / 1e3)
        self.log("prep_end", step)
        if raises(cfg, rank, step):
            raise RunnerError(f"harness: rank {rank} raises at step {step}")
        if rank == 0:
            x = expected_hidden(step, 0) - 1.0
        elif is_unread(cfg, rank, step):
            # As if it had read: the output stays checkable downstream.
            x = expected_hidden(step, rank - 1)
        else:
            assert intermediate_tensors is not None
            self.log("read_start", step)
            t = intermediate_tensors.tensors  # the deferred receive, if any
            self.log("read_end", step)
            if t.get("step") != step:
                self.errors.append(f"rank{rank} step {step}: got {t.get('step')}")
            x = t["hidden_states"].clone()
            self.received[step] = x.tolist()
            if not torch.equal(x, expected_hidden(step, rank - 1)):
                self.errors.append(f"rank{rank} step {step}: bad hidden_states")
        self.log("fwd_start", step)
        if cfg.gpu_ms:
            time.sleep(cfg.gpu_ms / 1e3)
        out = x + 1.0
        self.log("fwd_end", step)
        if rank == WORLD - 1:
            if cfg.feedback:
                send_token(step, self.feedback_group)
            return None
        return IntermediateTensors({"hidden_states": out, "step": step})

    def expect_token(self, step):
        import torch
        import torch.distributed as dist

        tok = torch.empty(1, dtype=torch.long)
        dist.recv(tok, src=WORLD - 1, group=self.feedback_group)
        if int(tok) != step:
            self.errors.append(f"rank0: token {int(tok)}, expected {step}")

    def _prev_forward_step(self, step):
        for s in range(step - 1, -1, -1):
            if not is_empty(self.cfg, s):
                return s
        return None


def send_token(step, group):
    import torch
    import torch.distributed as dist

    dist.send(torch.tensor([step], dtype=torch.long), dst=0, group=group)


def _rank_main(rank: int, init_file: str, cfg: HarnessConfig, out_dir: str):
    result_path = Path(out_dir) / f"rank{rank}.json"
    # A stuck rank prints every thread's stack and exits instead of hanging.
    faulthandler.dump_traceback_later(cfg.timeout_s, exit=True)
    os.environ["VLLM_PP_DEFERRED_RECV"] = "1" if cfg.deferred else "0"
    events: list[tuple[str, int, float]] = []
    step_times: list[float] = []
    runner = None
    try:
        import torch.distributed as dist

        import vllm.distributed.parallel_state as ps
        import vllm.distributed.utils as dist_utils
        from vllm.v1.worker.gpu_worker import Worker

        # Bounded gloo waits inside GroupCoordinator's groups (upstream reads
        # them from the current VllmConfig, which this harness has none of).
        tmo = timedelta(seconds=cfg.comm_timeout_s)
        dist_utils.get_cpu_distributed_timeout_or_none = lambda: tmo
        dist_utils.get_distributed_timeout_or_none = lambda: tmo
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=WORLD,
            timeout=tmo,
        )
        pp = ps.GroupCoordinator(
            [list(range(WORLD))], rank, "gloo", False, group_name="pp"
        )
        tp = ps.GroupCoordinator(
            [[r] for r in range(WORLD)], rank, "gloo", False, group_name="tp"
        )
        feedback_group = dist.new_group([0, WORLD - 1], backend="gloo", timeout=tmo)
        ps._PP, ps._TP = pp, tp

        def log(name, step):
            if step < cfg.trace_steps:
                events.append((name, step, time.monotonic()))

        # Log around the real methods (instance attributes shadow the class).
        real_irecv, real_recv_obj = pp.irecv_tensor_dict, pp.recv_object
        real_isend = pp.isend_tensor_dict
        cur = {"step": -1}

        def irecv_tensor_dict(*a, **k):
            log("recv_start", cur["step"])
            out = real_irecv(*a, **k)
            log("recv_end", cur["step"])
            return out

        def recv_object(*a, **k):
            out = real_recv_obj(*a, **k)
            log("recv_meta", cur["step"])
            return out

        def isend_tensor_dict(*a, **k):
            log("send", cur["step"])
            return real_isend(*a, **k)

        pp.irecv_tensor_dict = irecv_tensor_dict
        pp.recv_object = recv_object
        pp.isend_tensor_dict = isend_tensor_dict

        runner = HarnessRunner(cfg, rank, log, feedback_group)
        worker = object.__new__(Worker)
        worker._pp_send_work = []
        worker.profiler = None
        worker.use_v2_model_runner = True
        worker.model_runner = runner
        worker.vllm_config = SimpleNamespace(
            compilation_config=SimpleNamespace(
                pass_config=SimpleNamespace(enable_sp=False)
            ),
            parallel_config=SimpleNamespace(
                pipeline_parallel_size=WORLD, distributed_executor_backend="mp"
            ),
        )
        dist.barrier()
        raised = 0
        for step in range(cfg.steps):
            cur["step"] = step
            so = SimpleNamespace(
                step=step,
                total_num_scheduled_tokens=0 if is_empty(cfg, step) else 1,
            )
            t0 = time.monotonic()
            try:
                out = Worker.execute_model(worker, so)
            except RunnerError:
                raised += 1
                if cfg.feedback:
                    send_token(step, feedback_group)
                out = None
            if out is not None:
                raise AssertionError(f"rank {rank}: execute_model returned {out!r}")
            step_times.append(time.monotonic() - t0)
            log("step_end", step)
        if rank == 0 and cfg.feedback:
            # The token of the last forward step, which no later step takes.
            last = runner._prev_forward_step(cfg.steps)
            if last is not None:
                runner.expect_token(last)
        for h in worker._pp_send_work:
            h.wait()
        dist.barrier()
        result = {
            "ok": not runner.errors,
            "errors": runner.errors[:20],
            "raised": raised,
            "events": events,
            "step_times": step_times,
            "received": {str(k): v for k, v in runner.received.items()},
        }
        dist.destroy_process_group()
    except BaseException:
        result = {
            "ok": False,
            "errors": [traceback.format_exc()] + (runner.errors[:20] if runner else []),
            "events": events,
            "step_times": step_times,
            "received": {},
        }
    result_path.write_text(json.dumps(result))
    faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    os._exit(0)


def run_pipeline(cfg: HarnessConfig) -> list[dict]:
    """Run the 3 ranks; return their result dicts (index = rank).

    Raises TimeoutError if a rank is still running after ``cfg.timeout_s``
    (the ranks are killed first) and RuntimeError if a rank failed.
    """
    # Import here, once, so the forked ranks share it (about 20 s of CPU).
    import vllm.v1.worker.gpu_worker  # noqa: F401

    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="pp_harness_") as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_rank_main, args=(r, init_file, cfg, tmp), daemon=True)
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + cfg.timeout_s + 10.0
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        stuck = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in stuck:
            procs[r].kill()
            procs[r].join(5)
        results = []
        for r in range(WORLD):
            path = Path(tmp) / f"rank{r}.json"
            results.append(json.loads(path.read_text()) if path.exists() else None)
    if stuck or any(res is None for res in results):
        raise TimeoutError(
            f"pipeline harness: ranks {stuck} still running after "
            f"{cfg.timeout_s:.0f} s (killed), results missing for ranks "
            f"{[r for r, res in enumerate(results) if res is None]}; a deferred "
            "receive out of step with its send would look like this"
        )
    bad = [(r, res["errors"]) for r, res in enumerate(results) if not res["ok"]]
    if bad:
        raise RuntimeError(f"pipeline harness: ranks failed: {bad}")
    return results


def events_by_step(result: dict) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for name, step, t in result["events"]:
        out.setdefault(step, {}).setdefault(name, t)
    return out


def event_order(result: dict, step: int) -> list[str]:
    return [name for name, s, _ in result["events"] if s == step]
