"""Patch 0400-hc-fused: the fused INT8 GatedResidual kernels.

CPU (TRITON_INTERPRET=1, small shapes): both decode GEMV kernels (1..8
tokens; default configs and configs that split K over several programs, FMA
and tl.dot forms), and the routed prefill path (> 8 tokens),
against an fp32 reference of the unfused math (down+inject GEMM -> hc_silu ->
up GEMM -> hc_gate_mix, weights dequantized in fp32). The interpreter rounds
fp32 -> bf16 by truncation and computes bf16 tl.dot wrongly (the kernels use
an fp32 dot there), so the reference rounds by truncation at the same points:
equality is then exact (the old routed prefill, kept as the benchmark's
baseline, runs a CPU bf16 matmul: close).

CPU too: the prefill W8A16 GEMMs (> 8 tokens; one tile per program and
split K; with and without inject rows) against the same reference, exact as
the decode kernels; the prefill configs fit the split-K scratch for every
size; hc_prefill_variants lists every launch a prefill can hit.

sm_86: every launch config at the real shapes (hidden 2560, 4 streams, low
rank 320), decode and prefill, compiles within 101,376 B of shared memory.
"""

import pytest
import torch

from vllm.models.qwen4_exp.nvidia.ops import hc_int8 as H

HID, HC, RANK, INJ, PAD = 64, 4, 40, 4, 4  # real: 2560, 4, 320, 4, 12
K = HID * HC

# Small-shape configs that split K (K = 256: 4 programs per row block) in
# both the FMA and the tl.dot form, and up tiles of both forms.
SPLIT_CONFIGS = [
    (dict(BLOCK_N=4, K_SPLIT=64, USE_DOT=False, num_warps=4),
     dict(BLOCK_D=2, USE_DOT=False, num_warps=4)),
    (dict(BLOCK_N=16, K_SPLIT=64, USE_DOT=True, num_warps=4),
     dict(BLOCK_D=8, USE_DOT=True, num_warps=4)),
]


def _weights(gen, n_rows, k, scale):
    u = torch.randint(0, 256, (n_rows, k), dtype=torch.uint8, generator=gen)
    s = (torch.rand(n_rows, 1, generator=gen) * scale + scale / 4).bfloat16()
    return u, s


def _case(m, seed=0, with_inject=True):
    g = torch.Generator().manual_seed(seed)
    xn = (torch.randn(m, K, generator=g) * 1.5).bfloat16()
    n_rows = RANK + (INJ + PAD if with_inject else 0)
    wd, sd = _weights(g, n_rows, K, 0.01)
    if with_inject:
        # Padding rows are never loaded from the checkpoint: garbage must not
        # reach any output of the kernels.
        wd[RANK + INJ:] = 255
        sd[RANK + INJ:] = float("nan")
    wu, su = _weights(g, K, RANK, 0.05)
    return xn, wd, sd, wu, su


def _ulp(t):
    return 2.0 ** (torch.floor(torch.log2(t.abs().clamp_min(2 ** -20))) - 7)


def assert_bf16_match(actual, ref, ulps=2, frac=0.01):
    """Equal but for rare bf16 rounding flips: the interpreter's fp32 sums
    run in another order than torch's (seen: 1 of 320 values, 1 ulp)."""
    err = (actual.detach().float() - ref).abs()
    assert bool((err <= ulps * _ulp(ref)).all()), float(err.max())
    assert float((err > 0).float().mean()) <= frac


def assert_routed_close(actual, ref):
    """Routed prefill (bf16 weight copies; CPU matmul rounds to nearest, the
    interpreter's glue kernels truncate, so many values are 1 ulp off, and a
    flipped gate logit near 0 moves small outputs further): bound the error
    by the output's scale. (On a GPU it equals the unfused bf16 path
    exactly: results/hc_fused.json, block_input_max_abs_err_vs_unfused_bf16.)"""
    err = (actual.detach().float() - ref).abs()
    assert float(err.max()) <= 0.02 * float(ref.abs().max()), float(err.max())


def _counters_clear():
    return int(H.split_k_scratch(torch.device("cpu"))[1].abs().sum()) == 0


# Every decode size with its default configs; the split-K configs (and the
# final mixer) on a few sizes, to keep the interpreter run short.
DECODE_CASES = [(m, True, None) for m in range(1, 9)] + [
    (m, inject, i) for m in (1, 3, 8) for inject in (True, False)
    for i in range(len(SPLIT_CONFIGS))] + [(5, False, None)]


@pytest.mark.parametrize("m,with_inject,split", DECODE_CASES)
def test_decode_mix_matches_unfused_reference(m, with_inject, split):
    xn, wd, sd, wu, su = _case(m, seed=m, with_inject=with_inject)
    inj = INJ if with_inject else 0
    ref_bi, ref_inj = H.reference_mix(xn, wd, sd, wu, su, RANK, inj, HC,
                                      rnd=H.round_bf16_trunc)
    down_cfg, up_cfg = SPLIT_CONFIGS[split] if split is not None else (None, None)
    block_input, injection = H.hc_int8_mix(xn, wd, sd, wu, su, RANK, inj, HC,
                                           down_cfg=down_cfg, up_cfg=up_cfg)
    assert block_input.shape == (m, HID) and block_input.dtype == torch.bfloat16
    assert_bf16_match(block_input, ref_bi)
    if with_inject:
        assert injection.shape == (m, INJ)
        assert_bf16_match(injection, ref_inj, ulps=1)
    else:
        assert injection is None
    assert _counters_clear()  # the last program re-armed every counter


@pytest.mark.parametrize("m", [1, 8])
def test_down_kernel_silu_and_inject_columns(m):
    """The silu applies to the down columns only, inject stays raw; split K."""
    xn, wd, sd, wu, su = _case(m, seed=100 + m)
    w = (wd[:RANK + INJ].float() - 128) * sd[:RANK + INJ].float()
    raw = H.round_bf16_trunc(xn.float() @ w.T)
    z = raw[:, :RANK] / HC
    for cfg, _ in SPLIT_CONFIGS:
        lin = H.hc_down_inject_silu(xn, wd, sd, RANK, RANK + INJ, HC, config=cfg)
        assert_bf16_match(lin[:, :RANK], H.round_bf16_trunc(z * torch.sigmoid(z)))
        assert_bf16_match(lin[:, RANK:], raw[:, RANK:], ulps=1)
        # Rows of the silu output stay 16-byte aligned (stride 48 = round_up(44, 16)).
        assert lin.stride(0) % 8 == 0
        assert _counters_clear()


def test_prefill_routed_matches_unfused_reference():
    """The previous prefill path (the benchmark's baseline): bf16 weight
    copies (the interpreter's dequant truncates), upstream's op sequence
    (here its torch stand-ins, RNE stores), against the reference on the
    same bf16 weights."""
    xn, wd, sd, wu, su = _case(20, seed=21)
    wd[RANK + INJ:], sd[RANK + INJ:] = 128, 0  # padding rows as loaded (this path reads them)
    ref_bi, ref_inj = H.reference_mix(xn, wd, sd, wu, su, RANK, INJ, HC,
                                      w_rnd=H.round_bf16_trunc)
    bi, lin = H.hc_int8_prefill_mix(xn, wd, sd, wu, su, RANK, INJ, HC)
    assert bi.shape == (20, HID) and lin.shape == (20, H.padded_width(RANK + INJ))
    assert_routed_close(bi, ref_bi)
    assert_routed_close(lin[:, RANK:RANK + INJ], ref_inj)
    assert bool((lin[:, RANK + INJ:] == 0).all())  # padding columns


# Small-shape prefill configs (K = 256, R = 40): one tile per program and
# split K (4 programs per tile, the deterministic last-arrival reduction);
# up tiles with R a multiple of BLOCK_K or not (masked tail).
PREFILL_CONFIGS = [
    (dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=2),
     dict(BLOCK_M=16, BLOCK_D=16, BLOCK_K=16, num_warps=4, num_stages=2)),
    (dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=4, num_warps=4, num_stages=2),
     dict(BLOCK_M=32, BLOCK_D=16, BLOCK_K=32, num_warps=4, num_stages=2)),
]


@pytest.mark.parametrize("m,with_inject,cfg", [
    (9, True, 0), (9, False, 1), (20, True, 1), (33, True, 0), (33, False, 0)])
def test_prefill_gemm_matches_unfused_reference(m, with_inject, cfg):
    """More than 8 tokens: the W8A16 GEMMs read the INT8 bytes (no bf16 weight
    copy) and round where the unfused path stores bf16, so they match the
    fp32 reference of the unfused math (weights dequantized in fp32) as the
    decode kernels do; padding rows (NaN scale) never reach an output."""
    xn, wd, sd, wu, su = _case(m, seed=200 + m, with_inject=with_inject)
    assert len(torch.unique(wd[:RANK])) == 256  # every q + 128 goes through _q_bf16
    inj = INJ if with_inject else 0
    ref_bi, ref_inj = H.reference_mix(xn, wd, sd, wu, su, RANK, inj, HC,
                                      rnd=H.round_bf16_trunc)
    down_cfg, up_cfg = PREFILL_CONFIGS[cfg]
    block_input, injection = H.hc_int8_mix(xn, wd, sd, wu, su, RANK, inj, HC,
                                           down_cfg=down_cfg, up_cfg=up_cfg)
    assert block_input.shape == (m, HID) and block_input.dtype == torch.bfloat16
    assert_bf16_match(block_input, ref_bi)
    if with_inject:
        assert injection.shape == (m, INJ)
        assert_bf16_match(injection, ref_inj, ulps=1)
    else:
        assert injection is None
    assert _counters_clear()


def test_prefill_down_silu_and_inject_columns():
    """The prefill GEMM's store: silu on the down columns only, inject raw,
    rows past M untouched (3 M blocks of 16 for 40 tokens)."""
    m = 40
    xn, wd, sd, _, _ = _case(m, seed=300)
    w = (wd[:RANK + INJ].float() - 128) * sd[:RANK + INJ].float()
    raw = H.round_bf16_trunc(xn.float() @ w.T)
    z = raw[:, :RANK] / HC
    for cfg, _ in PREFILL_CONFIGS:
        lin = H.hc_prefill_down_silu(xn, wd, sd, RANK, RANK + INJ, HC, config=cfg)
        assert lin.shape == (m, RANK + INJ) and lin.stride(0) % 8 == 0
        assert_bf16_match(lin[:, :RANK], H.round_bf16_trunc(z * torch.sigmoid(z)))
        assert_bf16_match(lin[:, RANK:], raw[:, RANK:], ulps=1)
        assert _counters_clear()


def test_prefill_configs_fit_the_scratch():
    """Every prefill size up to the compose chunk (512) and beyond takes a
    config whose split-K partials fit the fixed 512 KiB scratch (the wrapper
    asserts it at run time; the 3090 would fail the first such prefill)."""
    n_out = R_RANK + R_INJ
    for m in range(H.GEMV_MAX_TOKENS + 1, 4097):
        c = H.prefill_down_config(m)
        assert R_K % (c["SPLIT_K"] * c["BLOCK_K"]) == 0
        if c["SPLIT_K"] > 1:
            tiles = -(-n_out // c["BLOCK_N"]) * -(-m // c["BLOCK_M"])
            assert c["SPLIT_K"] * tiles * c["BLOCK_M"] * c["BLOCK_N"] <= H._DECODE_PARTIALS, m
            assert tiles <= H._COUNTERS
        assert R_RANK % H.prefill_up_config(m)["BLOCK_K"] == 0  # unmasked K loop at 320


def test_prefill_variants_cover_every_size():
    """hc_prefill_variants(N) lists each (down, up, num_inject) launch that a
    prefill of 9..N tokens can hit once, with a token count that selects it;
    M is not specialized, so those are all the binaries (the warmup patch
    compiles them with warmup_hc_prefill)."""
    variants = H.hc_prefill_variants(512)
    keys = {(str(v["down"]), str(v["up"]), v["num_inject"]) for v in variants}
    assert len(keys) == len(variants)
    for m in range(H.GEMV_MAX_TOKENS + 1, 513):
        for inj in (4, 0):
            assert (str(H.prefill_down_config(m)), str(H.prefill_up_config(m)), inj) in keys
    for v in variants:
        assert H.GEMV_MAX_TOKENS < v["num_tokens"] <= 512
        assert v["down"] == H.prefill_down_config(v["num_tokens"])
        assert v["up"] == H.prefill_up_config(v["num_tokens"])
    assert {str(c) for _, c in H.PREFILL_DOWN_CONFIGS} == {str(v["down"]) for v in variants}
    assert H.hc_prefill_variants(8) == []


def test_dequant_bf16():
    _, wd, sd, _, _ = _case(1, seed=3)
    w = H.dequant_bf16(wd, sd, RANK + INJ)
    ref = H.round_bf16_trunc((wd[:RANK + INJ].float() - 128) * sd[:RANK + INJ].float())
    torch.testing.assert_close(w.float(), ref, rtol=0, atol=0)


def test_reference_is_the_unfused_math():
    """The reference itself against a literal re-statement of upstream's
    op sequence (merged GEMM, split, hc_silu, up GEMM, hc_gate_mix) in fp32."""
    xn, wd, sd, wu, su = _case(3, seed=7)
    w_d = (wd.float() - 128) * sd.float()
    w_u = (wu.float() - 128) * su.float()
    merged = (xn.float() @ w_d.T).bfloat16()
    lora, inj, _ = merged.split([RANK, INJ, PAD], dim=-1)
    x = lora.float() / HC
    silu = (x * torch.sigmoid(x)).bfloat16()
    gate = (silu.float() @ w_u.T).bfloat16()
    mix = (torch.sigmoid(gate.float()).view(3, HC, HID) * xn.float().view(3, HC, HID)).sum(1) / HC
    bi, ri = H.reference_mix(xn, wd, sd, wu, su, RANK, INJ, HC, rnd=H.round_bf16_rne)
    torch.testing.assert_close(bi, mix.bfloat16().float(), rtol=0, atol=0)
    torch.testing.assert_close(ri, inj.float(), rtol=0, atol=0)


def test_as_uint8_is_compressed_tensors_packing():
    """weight_packed.view(uint8) == q + 128 for compressed-tensors' packer."""
    pack = pytest.importorskip(
        "compressed_tensors.compressors.pack_quantized.helpers").pack_to_int32
    q = torch.randint(-128, 128, (48, K), dtype=torch.int8)
    packed = pack(q, 8)
    assert packed.shape == (48, K // 4) and packed.dtype == torch.int32
    assert torch.equal(H.as_uint8(packed).short(), q.short() + 128)


def test_up_k_split():
    assert H.up_k_split(320, False) == (256, 64)
    assert H.up_k_split(320, True) == (256, 64)
    assert H.up_k_split(40, True) == (32, 16)  # tl.dot needs K >= 16
    assert H.up_k_split(32, False) == (32, 0)


# --------------------------------------------------------------------------
# sm_86 compile check at real shapes
# --------------------------------------------------------------------------
R_HID, R_RANK, R_INJ = 2560, 320, 4
R_K = R_HID * HC

DOWN_SIG = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*bf16", "out_ptr": "*bf16",
            "part_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "stride_x": "i32",
            "stride_w": "i32", "stride_out": "i32"}
DOWN_ALIGNED = ("x_ptr", "w_ptr", "s_ptr", "out_ptr", "part_ptr", "cnt_ptr", "stride_x",
                "stride_w", "stride_out")
UP_SIG = {"a_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*bf16", "xn_ptr": "*bf16",
          "out_ptr": "*bf16", "M": "i32", "stride_a": "i32", "stride_w": "i32",
          "stride_xn": "i32", "stride_out": "i32"}
UP_ALIGNED = ("a_ptr", "w_ptr", "s_ptr", "xn_ptr", "out_ptr", "stride_a", "stride_w",
              "stride_xn", "stride_out")
DEQ_SIG = {"w_ptr": "*u8", "s_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "K": "i32",
           "stride_w": "i32", "stride_out": "i32"}


def _launch_configs():
    """Every (kernel, config) the wrappers launch at the real shapes."""
    seen, jobs = set(), []

    def add(key, **job):
        if key not in seen:
            seen.add(key)
            jobs.append(job)

    for m in range(1, H.GEMV_MAX_TOKENS + 1):
        for n_out in (R_RANK + R_INJ, R_RANK):  # gated / final mixer
            c = H.down_gemv_config(m)
            bm = H._gemv_block_m(m, c["USE_DOT"])
            ks = c["K_SPLIT"]
            cx = dict(N_SILU=R_RANK, N_OUT=n_out, HC=HC, BLOCK_M=bm, BLOCK_N=c["BLOCK_N"],
                      N_PAD=-(-n_out // c["BLOCK_N"]) * c["BLOCK_N"], K_SPLIT=ks,
                      SPLIT_K=R_K // ks, USE_DOT=c["USE_DOT"], DOT_F32=False, launch_pdl=False)
            assert cx["SPLIT_K"] * bm * cx["N_PAD"] <= H._DECODE_PARTIALS
            add(("down", tuple(sorted(cx.items())), c["num_warps"]),
                fn=H._hc_down_inject_silu_kernel, signature=DOWN_SIG, aligned=DOWN_ALIGNED,
                num_warps=c["num_warps"], num_stages=1, constexprs=cx)
        c = H.up_gemv_config(m)
        k0, k1 = H.up_k_split(R_RANK, c["USE_DOT"])
        cx = dict(R=R_RANK, D=R_HID, HC=HC, BLOCK_M=H._gemv_block_m(m, c["USE_DOT"]),
                  BLOCK_D=c["BLOCK_D"], K0=k0, K1=k1, USE_DOT=c["USE_DOT"], DOT_F32=False,
                  launch_pdl=False)
        add(("up", tuple(sorted(cx.items())), c["num_warps"]),
            fn=H._hc_up_gate_mix_kernel, signature=UP_SIG, aligned=UP_ALIGNED,
            num_warps=c["num_warps"], num_stages=1, constexprs=cx)
    # Prefill: every variant up to the compose chunk (512 tokens); M is not
    # specialized (do_not_specialize), strides and pointers 16-byte aligned.
    for v in H.hc_prefill_variants(512):
        c, n_out = v["down"], R_RANK + v["num_inject"]
        cx = dict(K=R_K, N_SILU=R_RANK, N_OUT=n_out, HC=HC, BLOCK_M=c["BLOCK_M"],
                  BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], SPLIT_K=c["SPLIT_K"],
                  DOT_F32=False)
        add(("prefill_down", tuple(sorted(cx.items())), c["num_warps"], c["num_stages"]),
            fn=H._hc_prefill_down_kernel, signature=DOWN_SIG, aligned=DOWN_ALIGNED,
            num_warps=c["num_warps"], num_stages=c["num_stages"], constexprs=cx)
        c = v["up"]
        cx = dict(R=R_RANK, D=R_HID, HC=HC, BLOCK_M=c["BLOCK_M"], BLOCK_D=c["BLOCK_D"],
                  BLOCK_K=c["BLOCK_K"], DOT_F32=False)
        add(("prefill_up", tuple(sorted(cx.items())), c["num_warps"], c["num_stages"]),
            fn=H._hc_prefill_up_kernel, signature=UP_SIG, aligned=UP_ALIGNED,
            num_warps=c["num_warps"], num_stages=c["num_stages"], constexprs=cx)
    add(("dequant",), fn=H._hc_dequant_kernel, signature=DEQ_SIG,
        aligned=("w_ptr", "s_ptr", "out_ptr", "stride_w", "stride_out"), num_warps=4,
        num_stages=1, constexprs=dict(BLOCK_N=H.DEQUANT_BLOCK_N, BLOCK_K=H.DEQUANT_BLOCK_K))
    return jobs


def test_every_launch_config_fits_sm86():
    from sm86 import check_fits, compile_many

    jobs = _launch_configs()
    assert len(jobs) >= 4
    for job, c in zip(jobs, compile_many(jobs)):
        check_fits(c, str(job["constexprs"]))
        print(c)
