"""sm_86 compile of every decode-05 kernel variant the startup warmup
(0900) builds, at the real shapes (512 experts, top-10, hidden 2560, shared
intermediate 640) with group-128 INT6 scales (tests/warmup/test_warmup_sm86.py
does the per-channel ones): M = 1..8 and the INT6 GEMM's M classes, each
specialised exactly like its launch (recorded with Triton's own binder: M = 1
a constant, num_sorted / num_blocks divisibility, strides, the padding mask
pointer). Shared memory must fit a 3090 (<= 101,376 B)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "warmup"))

from sm86 import check_fits, compile_many  # noqa: E402
from spec_keys import recording  # noqa: E402
from test_warmup_keys import COMPOSE, MOE_KERNELS, _moe_fused  # noqa: E402

from vllm.models.qwen4_exp.nvidia import kernel_warmup as kw  # noqa: E402


def test_all_kernels_fit_sm86(monkeypatch):
    f = _moe_fused(monkeypatch, group=128)
    with recording() as recs:
        kw.warmup_moe_fused(f, COMPOSE.fused_decode_tokens(), COMPOSE.prefill_token_classes())
    cfgs = [c for n in MOE_KERNELS for c in recs[n].sm86_configs()]
    for c in cfgs:  # recorded on CPU: the GPU launch takes the tensor-core dot
        if "DOT_F32" in c["constexprs"]:
            c["constexprs"]["DOT_F32"] = False
    assert len(cfgs) == 7 + 4 + 4 + 6
    assert all(c["constexprs"].get("GROUP") in (128, None) for c in cfgs)
    res = compile_many(cfgs)
    assert len(res) == len(cfgs)
    for c, cfg in zip(res, cfgs):
        check_fits(c, f"{cfg['constexprs']} aligned={cfg['aligned']}")
