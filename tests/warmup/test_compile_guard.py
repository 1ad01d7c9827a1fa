"""0900 compile guard: after startup every Triton compile logs one WARNING
naming the kernel and its specialisation key, and is counted.

The hook is vLLM's JIT monitor on Triton 3.7.1's
``knobs.runtime.jit_post_compile_hook``; it is called here through Triton's
own ``JITFunction._call_hook`` with the arguments ``JITFunction.run`` builds
for a real launch (binder + ``_pack_args``; only the compile itself, which
needs a GPU, is left out).
"""

from __future__ import annotations

import logging

import pytest
import torch
from triton import knobs

from spec_keys import _BACKEND, _as_jit

import vllm.utils.jit_monitor as jm
from vllm.models.qwen4_exp.nvidia.ops import moe_fused as mf


@pytest.fixture
def monitor(monkeypatch):
    monkeypatch.setattr(jm, "_active", False)
    monkeypatch.setattr(jm, "_triton_compiles_after_warmup", 0)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    jm.activate(mode="warn")
    yield knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = None


def _fire(hook, m: int):
    """What JITFunction.run hands the hook for _moe_route_kernel at M = m."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import compute_cache_key, create_function_from_signature

    jf = _as_jit(mf._moe_route_kernel)
    binder = create_function_from_signature(jf.signature, jf.params, _BACKEND)
    E, K, k = 512, 2560, 10
    c = mf.route_constexprs(m, E, k)
    ns, nb = mf.align_sizes(m, k, E, c["BS"])
    args = (torch.zeros(m, K, dtype=torch.bfloat16), torch.zeros(E, K, dtype=torch.bfloat16),
            torch.zeros(1, K, dtype=torch.bfloat16), torch.zeros(m, E + 1),
            torch.zeros(1, dtype=torch.int32), torch.zeros(m, k), torch.zeros(m, k, dtype=torch.int32),
            torch.zeros(ns, dtype=torch.int32), torch.zeros(nb, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32), torch.zeros(8, dtype=torch.bool),
            m, E, K, K, K, E + 1, ns, nb)
    bound, spec, opts = binder(*args, **c, num_warps=4)
    key = compute_cache_key({}, spec, opts)
    options, signature, constexprs, attrs = jf._pack_args(_BACKEND, dict(c, num_warps=4), bound, spec, opts)
    jf._call_hook(hook, key, signature, GPUTarget("cuda", 86, 32), 0, constexprs, options, [attrs], False)
    return key


def test_every_compile_after_startup_warns_with_its_key(monitor, caplog, monkeypatch):
    import vllm.envs as envs

    monkeypatch.setattr(envs, "VLLM_KERNEL_WARMUP", True, raising=False)
    caplog.set_level(logging.WARNING)
    logger = logging.getLogger("vllm.utils.jit_monitor")
    attach = not logger.propagate  # vLLM's logging config may stop propagation
    if attach:
        logger.addHandler(caplog.handler)
    try:
        _fire(monitor, 1)
        _fire(monitor, 3)
        _fire(monitor, 3)  # another compile of the same kernel: logged again
    finally:
        if attach:
            logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "compiled during inference" in r.getMessage()]
    assert len(lines) == 3 and jm.triton_compiles_after_warmup() == 3
    assert all("_moe_route_kernel" in s and "moe_fused" in s for s in lines)
    # M = 1 is a constant of the key; M = 3 is not; num_sorted (80 = 16 x 5
    # at M = 1) is divisible by 16, the others are named when they are
    assert "M=1" in lines[0] and "M=1" not in lines[1]
    assert "num_sorted" in lines[0].split("divisible_by_16=")[1]
    assert "BLOCK_M=4" in lines[1] and "num_warps=4" in lines[1]


def test_gate_off_keeps_upstream_monitor(monitor, monkeypatch):
    import vllm.envs as envs

    monkeypatch.setattr(envs, "VLLM_KERNEL_WARMUP", False, raising=False)
    seen = []
    monkeypatch.setattr(jm, "_log_triton_jit_compile", lambda name, kw: seen.append(name))
    _fire(monitor, 2)
    assert seen == ["_moe_route_kernel"] and jm.triton_compiles_after_warmup() == 0
