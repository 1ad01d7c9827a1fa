"""0900's two worker hooks: the gate turns them off; the late hook runs the
0650 aligned-indices launch through the model state's own context, with the
runner's persistent seq_lens buffer (the pointer every step passes)."""

import types

import torch

from vllm.models.qwen4_exp.nvidia import kernel_warmup as kw


def _worker(calls):
    ctx = types.SimpleNamespace(
        is_initialized=True, aligned_state_indices=torch.zeros(2, 4, 1, dtype=torch.int32),
        compute_aligned_state_indices=lambda seq_lens, n: calls.append((seq_lens, n)))
    runner = types.SimpleNamespace(model_state=types.SimpleNamespace(_mamba_ctx=ctx),
                                   input_buffers=types.SimpleNamespace(seq_lens=torch.zeros(4, dtype=torch.int32)))
    return types.SimpleNamespace(model_runner=runner), runner


def test_late_hook_runs_mamba_align_once(monkeypatch):
    import vllm.envs as envs

    monkeypatch.setattr(envs, "VLLM_KERNEL_WARMUP", True, raising=False)
    calls = []
    worker, runner = _worker(calls)
    kw.warmup_after_kv_cache(worker)
    assert len(calls) == 1 and calls[0][0] is runner.input_buffers.seq_lens and calls[0][1] == 1


def test_gate_off_runs_nothing(monkeypatch):
    import vllm.envs as envs

    monkeypatch.setattr(envs, "VLLM_KERNEL_WARMUP", False, raising=False)
    calls = []
    worker, _ = _worker(calls)
    kw.warmup_after_kv_cache(worker)
    kw.warmup_model_kernels_for_worker(worker)  # returns before touching the worker
    assert calls == []


def test_no_mamba_state_is_fine():
    runner = types.SimpleNamespace(model_state=None, input_buffers=None)
    assert kw.warmup_mamba_align(runner) == 0
