"""The sm_86 compile helper itself: it must see pipelining (and so catch
configs too big for a 3090) when the launch is specialised like a real one."""

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from sm86 import SM86_MAX_SHARED, assert_fits_sm86, compile_sm86  # noqa: E402


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_bk, stride_cm,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * stride_am + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None] * stride_bk + rn[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], acc.to(tl.float16))


SIG = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp16", "M": "i32", "N": "i32", "K": "i32",
       "stride_am": "i32", "stride_bk": "i32", "stride_cm": "i32"}
ALIGNED = ("a_ptr", "b_ptr", "c_ptr", "M", "N", "K", "stride_am", "stride_bk", "stride_cm")


def test_big_tile_is_caught_when_specialised():
    big = {"BM": 128, "BN": 256, "BK": 64}
    unspecialised = compile_sm86(_dot_kernel, SIG, big, aligned=(), num_stages=4)
    real = compile_sm86(_dot_kernel, SIG, big, aligned=ALIGNED, num_stages=4)
    # Without the divisibility attrs Triton does not pipeline the loads.
    assert real.shared > unspecialised.shared
    assert real.shared > SM86_MAX_SHARED
    with pytest.raises(AssertionError, match="sm_86 limit"):
        assert_fits_sm86(_dot_kernel, SIG, big, aligned=ALIGNED, num_stages=4)


def test_small_tile_fits():
    c = assert_fits_sm86(_dot_kernel, SIG, {"BM": 32, "BN": 64, "BK": 64}, aligned=ALIGNED, num_stages=3)
    assert 0 < c.shared <= SM86_MAX_SHARED
