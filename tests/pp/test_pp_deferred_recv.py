"""decode-03 deferred PP receive (patch 0300-deferred-recv, VLLM_PP_DEFERRED_RECV).

The pipeline tests run 3 forked CPU processes over real torch.distributed gloo
with the real Worker.execute_model and GroupCoordinator send/receive (see
scripts/bench/pp_pipeline_harness.py); each run is bounded by a wall-clock
timeout and its ranks are killed when it passes, so a deadlock fails the test.
The in-process tests drive Worker.execute_model with a recording PP group.
"""

import pytest
import torch

import vllm.distributed.parallel_state as ps
from bench.pp_pipeline_harness import (
    WORLD,
    HarnessConfig,
    event_order,
    events_by_step,
    expected_hidden,
    is_empty,
    is_unread,
    raises,
    run_pipeline,
)
from vllm.sequence import IntermediateTensors
from vllm.v1.worker import gpu_worker
from vllm.v1.worker.gpu_worker import (
    AsyncIntermediateTensors,
    DeferredRecvIntermediateTensors,
    Worker,
)

UPSTREAM_ORDER = [
    "recv_start", "recv_meta", "recv_end",
    "step_start", "prep_start", "prep_end", "read_start", "read_end",
    "fwd_start", "fwd_end",
]  # fmt: skip
DEFERRED_ORDER = [
    "step_start", "prep_start", "prep_end", "read_start",
    "recv_start", "recv_meta", "recv_end", "read_end",
    "fwd_start", "fwd_end",
]  # fmt: skip


def _order(result, step, rank):
    names = [n for n in event_order(result, step) if n != "step_end"]
    if rank < WORLD - 1:
        assert names[-1] == "send", names
        names = names[:-1]
    return names


# Slow stage 0: rank 0 prepares 150 ms, ranks 1 and 2 prepare 30 ms.
SLOW0 = dict(steps=6, prep_ms=30.0, rank0_prep_ms=150.0, gpu_ms=5.0, trace_steps=6)


@pytest.fixture(scope="module")
def slow0_runs():
    return {
        d: run_pipeline(HarnessConfig(deferred=d, timeout_s=60, **SLOW0))
        for d in (True, False)
    }


def test_slow_stage0_prep_overlaps_wait(slow0_runs):
    res = slow0_runs[True]
    for rank in (1, 2):
        ev, prev = events_by_step(res[rank]), events_by_step(res[rank - 1])
        for step in range(SLOW0["steps"]):
            assert _order(res[rank], step, rank) == DEFERRED_ORDER
            # The whole preparation ran before the previous rank even sent
            # this step (it was still in its 150 ms prep + forward) ...
            assert ev[step]["prep_start"] < ev[step]["prep_end"] < prev[step]["send"]
            # ... and the metadata arrived only after that send.
            assert ev[step]["recv_meta"] > prev[step]["send"]


def test_gate_off_is_upstream_order(slow0_runs):
    res = slow0_runs[False]
    for rank in (1, 2):
        ev, prev = events_by_step(res[rank]), events_by_step(res[rank - 1])
        for step in range(SLOW0["steps"]):
            assert _order(res[rank], step, rank) == UPSTREAM_ORDER
            # Upstream: preparation waits for the previous rank's send.
            assert ev[step]["prep_start"] > ev[step]["recv_end"] > prev[step]["send"]


def test_received_tensors_identical_to_upstream(slow0_runs):
    on, off = slow0_runs[True], slow0_runs[False]
    for rank in (1, 2):
        assert sorted(on[rank]["received"], key=int) == [
            str(s) for s in range(SLOW0["steps"])
        ]
        assert on[rank]["received"] == off[rank]["received"]
        for step, values in on[rank]["received"].items():
            want = expected_hidden(int(step), rank - 1)
            assert torch.equal(torch.tensor(values), want)


def test_1000_steps_mixed_read_unread_no_deadlock():
    cfg = HarnessConfig(
        deferred=True,
        steps=1000,
        unread="mixed",
        raise_every=50,
        empty_every=97,
        trace_steps=200,
        timeout_s=90,
    )
    # run_pipeline raises on a timeout (killed ranks) and on any rank error;
    # the ranks check every received step index and hidden_states.
    res = run_pipeline(cfg)
    for rank in (1, 2):
        read = [
            s
            for s in range(cfg.steps)
            if not is_empty(cfg, s)
            and not is_unread(cfg, rank, s)
            and not raises(cfg, rank, s)
        ]
        unread = [
            s
            for s in range(cfg.steps)
            if not is_empty(cfg, s)
            and is_unread(cfg, rank, s)
            and not raises(cfg, rank, s)
        ]
        assert len(read) > 500 and len(unread) > 200
        assert sorted(map(int, res[rank]["received"])) == read
        for s in read:
            got = torch.tensor(res[rank]["received"][str(s)])
            assert torch.equal(got, expected_hidden(s, rank - 1))
        ev = events_by_step(res[rank])
        for s in unread:
            if s >= cfg.trace_steps:
                break
            names = event_order(res[rank], s)
            # Never read: received after execute_model's runner returned and
            # before this rank's own send.
            assert "read_start" not in names
            assert ev[s]["fwd_end"] < ev[s]["recv_start"] < ev[s]["step_end"]
            if rank < WORLD - 1:
                assert ev[s]["recv_end"] < ev[s]["send"]
        for s in range(0, cfg.trace_steps):
            names = event_order(res[rank], s)
            if is_empty(cfg, s):
                assert "recv_start" not in names
            elif raises(cfg, rank, s):
                # The runner raised before reading: received on the way out.
                assert names[-4:] == [
                    "recv_start", "recv_meta", "recv_end", "step_end"
                ]  # fmt: skip
                assert ev[s]["prep_end"] < ev[s]["recv_start"]
            else:
                assert names.count("recv_start") == 1
    n_raise = sum(
        1
        for s in range(cfg.steps)
        if raises(cfg, WORLD - 1, s) and not is_empty(cfg, s)
    )
    assert res[WORLD - 1]["raised"] == n_raise > 10


# ---- in-process: Worker.execute_model with a recording PP group ----------


class _Group:
    is_first_rank = False
    is_last_rank = True

    def __init__(self, log, fail=None):
        self.log, self.fail = log, fail
        self.dict = {"hidden_states": torch.ones(4)}

    def irecv_tensor_dict(self, all_gather_group=None, all_gather_tensors=None):
        self.log.append("recv")
        if self.fail is not None:
            raise self.fail
        return self.dict, [_Handle(self.log)], [lambda: self.log.append("post")]


class _Handle:
    def __init__(self, log):
        self.log = log

    def wait(self):
        self.log.append("wait")


class _Runner:
    is_pooling_model = False

    def __init__(self, log, read=True, exc=None):
        self.log, self.read, self.exc = log, read, exc
        self.seen = None

    def execute_model(self, scheduler_output, intermediate_tensors):
        self.log.append("prep")
        if self.exc is not None:
            raise self.exc
        if self.read:
            self.seen = intermediate_tensors.tensors
            self.log.append("read")
        self.log.append("forward")
        return None


def _worker(runner):
    from types import SimpleNamespace as NS

    w = object.__new__(Worker)
    w._pp_send_work, w.profiler = [], None
    w.use_v2_model_runner, w.model_runner = True, runner
    w.vllm_config = NS(
        compilation_config=NS(pass_config=NS(enable_sp=False)),
        parallel_config=NS(pipeline_parallel_size=3),
    )
    return w


@pytest.fixture
def pp(monkeypatch):
    def install(log, fail=None):
        group = _Group(log, fail)
        monkeypatch.setattr(ps, "_PP", group)
        monkeypatch.setattr(ps, "_TP", object())
        return group

    return install


def _run(worker, tokens=1):
    from types import SimpleNamespace as NS

    return Worker.execute_model(worker, NS(total_num_scheduled_tokens=tokens))


@pytest.mark.parametrize("gate", ["0", "1"])
def test_call_order_in_process(pp, monkeypatch, gate):
    monkeypatch.setenv("VLLM_PP_DEFERRED_RECV", gate)
    log = []
    group = pp(log)
    runner = _Runner(log)
    assert _run(_worker(runner)) is None
    if gate == "0":
        assert log == ["recv", "prep", "wait", "post", "read", "forward"]
    else:
        assert log == ["prep", "recv", "wait", "post", "read", "forward"]
    assert runner.seen is group.dict  # the dict the postprocess writes into


@pytest.mark.parametrize("gate", ["0", "1"])
def test_unread_step_still_receives(pp, monkeypatch, gate):
    monkeypatch.setenv("VLLM_PP_DEFERRED_RECV", gate)
    log = []
    pp(log)
    _run(_worker(_Runner(log, read=False)))
    if gate == "0":
        assert log == ["recv", "prep", "forward"]
    else:  # after the runner; handles waited, postprocess left unread
        assert log == ["prep", "forward", "recv", "wait"]


def test_no_forward_step_never_receives(pp, monkeypatch):
    monkeypatch.setenv("VLLM_PP_DEFERRED_RECV", "1")
    log = []
    pp(log)
    _run(_worker(_Runner(log, read=False)), tokens=0)
    assert "recv" not in log


@pytest.mark.parametrize("gate", ["0", "1"])
def test_receive_error_surfaces_unchanged(pp, monkeypatch, gate):
    monkeypatch.setenv("VLLM_PP_DEFERRED_RECV", gate)
    err = RuntimeError("gloo: Timed out waiting for recv")
    log = []
    pp(log, fail=err)
    with pytest.raises(RuntimeError) as info:
        _run(_worker(_Runner(log)))
    assert info.value is err
    assert log.count("recv") == 1  # never retried (it would eat the next step)
    assert "forward" not in log


def test_runner_error_still_receives_then_propagates(pp, monkeypatch):
    monkeypatch.setenv("VLLM_PP_DEFERRED_RECV", "1")
    log = []
    pp(log)
    exc = ValueError("runner failed before reading")
    with pytest.raises(ValueError) as info:
        _run(_worker(_Runner(log, exc=exc)))
    assert info.value is exc
    assert log == ["prep", "recv", "wait"]


def test_failed_receive_read_again_raises_chained():
    err = OSError("connection reset")

    def recv():
        raise err

    it = DeferredRecvIntermediateTensors(recv_fn=recv)
    with pytest.raises(OSError):
        it.tensors
    with pytest.raises(RuntimeError, match="VLLM_PP_DEFERRED_RECV=0") as info:
        it.tensors
    assert info.value.__cause__ is err
    it.ensure_received(wait=True)  # no second receive, no raise


def test_deferred_wrapper_semantics():
    calls = []
    d = {"hidden_states": torch.arange(6.0), "residual": torch.zeros(6)}

    def recv():
        calls.append(1)

        def post():
            d["residual"] = torch.full((6,), 2.0)  # like the TP all-gather

        return d, [], [post]

    it = DeferredRecvIntermediateTensors(recv_fn=recv)
    assert isinstance(it, AsyncIntermediateTensors)
    assert isinstance(it, IntermediateTensors)
    assert it.recv_pending and calls == []
    assert len(it) == 2 and calls == [1] and not it.recv_pending
    assert it.tensors is d and torch.equal(it["residual"], torch.full((6,), 2.0))
    part = it[1:3]  # IntermediateTensors slicing goes through self.__class__
    assert type(part) is DeferredRecvIntermediateTensors
    assert torch.equal(part["hidden_states"], torch.tensor([1.0, 2.0]))
    it.ensure_received(wait=True)
    assert calls == [1]


def test_gate_declared_default_on(monkeypatch):
    import vllm.envs as envs

    monkeypatch.delenv("VLLM_PP_DEFERRED_RECV", raising=False)
    assert "VLLM_PP_DEFERRED_RECV" in envs.environment_variables
    assert envs.VLLM_PP_DEFERRED_RECV is True
    monkeypatch.setenv("VLLM_PP_DEFERRED_RECV", "0")
    assert envs.VLLM_PP_DEFERRED_RECV is False
    assert gpu_worker.envs is envs
