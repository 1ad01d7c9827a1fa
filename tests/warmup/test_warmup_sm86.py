"""sm_86 compile of every variant the startup warmup builds, specialised
exactly like its launch (the recorded key: constexprs incl. ints equal to 1,
16-byte alignment / divisibility of every pointer and int such as
num_sorted and num_blocks, int widths, warps/stages): shared memory must fit
a 3090 (<= 101,376 B). M = 3, 5, 6, 7 included (eager steps); the per-M
configs of tests/moe/test_moe_fused_sm86.py covered only 1, 2, 4, 8.

Prints the compile time per variant (the cost the warmup adds per variant on
this CPU; `pytest -s`)."""

from __future__ import annotations

import time

import pytest
import torch

from sm86 import check_fits, compile_many
from spec_keys import recording
from test_warmup_keys import COMPOSE, HC_WIDTH, _hc_mix, _moe_fused

from vllm.models.qwen4_exp.nvidia import kernel_warmup as kw


def _compile_all(recs, names):
    cfgs = [c for n in names for c in recs[n].sm86_configs()]
    for c in cfgs:  # recorded on CPU: the GPU launch takes the tensor-core dot
        if "DOT_F32" in c["constexprs"]:
            c["constexprs"]["DOT_F32"] = False
    t0 = time.perf_counter()
    res = compile_many(cfgs)
    dt = time.perf_counter() - t0
    assert len(res) == len(cfgs)
    for c, cfg in zip(res, cfgs):
        check_fits(c, f"{cfg['constexprs']} aligned={cfg['aligned']}")
    print(f"\nsm_86: {len(cfgs)} variants of {list(names)} compiled in {dt:.1f} s "
          f"({dt / max(1, len(cfgs)):.2f} s per variant, one subprocess)")
    return cfgs, res


def test_moe_warm_variants_fit_sm86(monkeypatch):
    f = _moe_fused(monkeypatch)
    with recording() as recs:
        kw.warmup_moe_fused(f, COMPOSE.fused_decode_tokens(), COMPOSE.prefill_token_classes())
    names = ("_moe_route_kernel", "_shared_gate_up_silu_kernel", "_shared_down_final_kernel",
             "_int6_planes_gemm_kernel")
    cfgs, _ = _compile_all(recs, names)
    route = [c for c in cfgs if c["fn"] is recs["_moe_route_kernel"].kernel]
    # M = 1 specialises as a constant; the others carry M as an i32
    assert sum("M" in c["constexprs"] for c in route) == 1
    assert len(route) == 7


def test_hc_warm_variants_fit_sm86():
    mix = _hc_mix()
    with recording() as recs:
        kw.warmup_hc_mix(mix, HC_WIDTH, COMPOSE.fused_decode_tokens(), kw.hc_prefill_tokens(COMPOSE),
                         torch.device("cpu"))
    names = [n for n in ("_hc_down_inject_silu_kernel", "_hc_up_gate_mix_kernel", "_hc_dequant_kernel")
             if recs[n].keys]
    cfgs, _ = _compile_all(recs, names)
    if not cfgs:
        pytest.skip("every HC variant uses PDL (sm_90 only)")
