"""Patch 0400-hc-fused on a GPU at the real shapes (hidden 2560, 4 streams,
low rank 320): the fused decode kernels (1..8 tokens, PDL off and on) against
the fp32 reference of the unfused math, the prefill W8A16 GEMMs (9..512 tokens, every
config bucket, and their warmup variants), and the old routed prefill (512 tokens).
Skipped without CUDA.

On the GPU machine (no vLLM there) the kernel file is loaded from
$HC_INT8_PATH: `HC_INT8_PATH=hc_int8.py python3 -m pytest test_hc_fused_gpu.py`.
"""

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available() or torch.version.cuda is None:
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

if os.environ.get("HC_INT8_PATH"):
    _spec = importlib.util.spec_from_file_location("hc_int8", os.environ["HC_INT8_PATH"])
    H = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(H)
else:
    from vllm.models.qwen4_exp.nvidia.ops import hc_int8 as H

HID, HC, RANK, INJ, PAD = 2560, 4, 320, 4, 12
K = HID * HC


def _case(m, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    xn = torch.randn(m, K, device="cuda", generator=g).bfloat16()
    wd = torch.randint(0, 256, (RANK + INJ + PAD, K), dtype=torch.uint8, device="cuda",
                       generator=g)
    sd = (torch.rand(RANK + INJ + PAD, 1, device="cuda", generator=g) * 0.004 + 1e-3).bfloat16()
    wd[RANK + INJ:] = 255
    sd[RANK + INJ:] = float("nan")  # padding rows are never read by the kernels
    wu = torch.randint(0, 256, (K, RANK), dtype=torch.uint8, device="cuda", generator=g)
    su = (torch.rand(K, 1, device="cuda", generator=g) * 0.02 + 5e-3).bfloat16()
    return xn, H.as_uint8(wd.view(torch.int32)), sd, H.as_uint8(wu.view(torch.int32)), su


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _ulp(t):
    return 2.0 ** (torch.floor(torch.log2(t.abs().clamp_min(2 ** -20))) - 7)


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8])
def test_decode_vs_fp32_reference(m, pdl):
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90")
    xn, wd, sd, wu, su = _case(m, seed=m)
    bi, inj = H.hc_int8_mix(xn, wd, sd, wu, su, RANK, INJ, HC, pdl)
    ref_bi, ref_inj = H.reference_mix(xn, wd, sd, wu, su, RANK, INJ, HC)
    assert torch.isfinite(bi.float()).all()
    assert int(H.split_k_scratch(xn.device)[1].abs().sum()) == 0
    err = (bi.float() - ref_bi).abs()
    # Inject logits: the GEMM output, at most one bf16 rounding flip (fp32
    # sums in another order than torch's).
    assert bool(((inj.float() - ref_inj).abs() <= _ulp(ref_inj)).all())
    if m == 1:
        assert bool((err <= _ulp(ref_bi)).all())
        assert int((err > 0).sum()) <= 3
    else:
        # A flipped rounding of a GEMM output propagates through silu and the
        # gate, so a few elements differ by more than 1 ulp.
        assert float(err.max()) <= 0.02 * float(ref_bi.abs().max())
        assert float((err > 0).float().mean()) < 0.02


def _prefill_check(bi, inj, ref_bi, ref_inj):
    err = (bi.float() - ref_bi).abs()
    # As the decode sizes: a flipped rounding of a GEMM output propagates
    # through silu and the gate (seen on the H200: <= 1.1 % of the values).
    assert float(err.max()) <= 0.02 * float(ref_bi.abs().max())
    assert float((err > 0).float().mean()) < 0.02
    assert bool(((inj.float() - ref_inj).abs() <= _ulp(ref_inj)).all())


# One size in each config bucket of prefill_down_config / prefill_up_config.
PREFILL_SIZES = [9, 16, 17, 33, 64, 65, 129, 200, 257, 512]


@pytest.mark.parametrize("m", PREFILL_SIZES)
def test_prefill_gemm_vs_fp32_reference(m):
    """> 8 tokens: the W8A16 GEMMs on the INT8 bytes, rounding where the
    unfused path stores bf16 (no bf16 weight copy: the reference's weights
    are the exact fp32 dequant); padding rows (NaN scale) never read."""
    xn, wd, sd, wu, su = _case(m, seed=1000 + m)
    bi, inj = H.hc_int8_mix(xn, wd, sd, wu, su, RANK, INJ, HC)
    ref_bi, ref_inj = H.reference_mix(xn, wd, sd, wu, su, RANK, INJ, HC)
    assert torch.isfinite(bi.float()).all()
    assert int(H.split_k_scratch(xn.device)[1].abs().sum()) == 0
    _prefill_check(bi, inj, ref_bi, ref_inj)
    # The final mixer (no inject rows): 320 GEMM rows.
    bi0, inj0 = H.hc_int8_mix(xn, wd[:RANK], sd[:RANK], wu, su, RANK, 0, HC)
    assert inj0 is None and torch.equal(bi0, bi)


def test_prefill_warmup_variants():
    """Every variant warmup_hc_prefill compiles is the one a real call of
    its size launches (same configs), and runs on the dummy tensors."""
    variants = H.hc_prefill_variants(512)
    for v in variants:
        H.warmup_hc_prefill(v, "cuda")
        assert v["down"] == H.prefill_down_config(v["num_tokens"])
        assert v["up"] == H.prefill_up_config(v["num_tokens"])
    torch.cuda.synchronize()
    assert int(H.split_k_scratch(torch.device("cuda"))[1].abs().sum()) == 0


def test_prefill_routed_vs_bf16_weight_reference():
    """The previous prefill path (kept as the benchmark's baseline): upstream's
    sequence on bf16 copies of the weights, so the reference is the unfused
    math in fp32 on the bf16-rounded weights."""
    m = 512
    xn, wd, sd, wu, su = _case(m, seed=m)
    wd[RANK + INJ:], sd[RANK + INJ:] = 128, 0  # padding rows as loaded: q = 0, scale 0
    bi, lin = H.hc_int8_prefill_mix(xn, wd, sd, wu, su, RANK, INJ, HC)
    inj = lin[:, RANK:RANK + INJ]
    rnd = H.round_bf16_rne
    w_d = rnd((wd[:RANK + INJ].float() - 128) * sd[:RANK + INJ].float())
    w_u = rnd((wu.float() - 128) * su.float())
    lin = rnd(xn.float() @ w_d.T)
    z = lin[:, :RANK] / HC
    gate = rnd(rnd(z * torch.sigmoid(z)) @ w_u.T)
    acc = torch.zeros(m, HID, device="cuda")
    for s in range(HC):
        acc += torch.sigmoid(gate[:, s * HID:(s + 1) * HID]) * xn[:, s * HID:(s + 1) * HID].float()
    ref_bi = rnd(acc / HC)
    err = (bi.float() - ref_bi).abs()
    assert float(err.max()) <= 0.02 * float(ref_bi.abs().max())
    assert float((err > 0).float().mean()) < 0.02
    assert bool(((inj.float() - lin[:, RANK:]).abs() <= _ulp(lin[:, RANK:])).all())
