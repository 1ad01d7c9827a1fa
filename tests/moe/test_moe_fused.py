"""decode-05 moe-fused kernels in the Triton CPU interpreter (small shapes).

Routing is checked against upstream topk_softmax + renormalize semantics
(`_moe_C.topk_softmax` has no CPU kernel; the reference is its documented
behaviour: fp32 softmax over all experts, top-k by value, ties to the lower
id), alignment against moe_align_block_size semantics, the INT6 re-layout
round trip bit-exact, the shared-expert kernels against an fp32 reference
with upstream's bf16 rounding points.
"""

import pytest
import torch

from vllm.models.qwen4_exp.nvidia.ops import moe_fused as mf

E, TOPK, K = 64, 4, 256


def _route(x, gw, sgw, renorm=True):
    counter = torch.zeros(1, dtype=torch.int32)
    out = mf.moe_route(x, gw, sgw, TOPK, counter, renormalize=renorm)
    assert counter.item() == 0, "last CTA must reset the counter"
    return out


def _check_route(x, gw, sgw, renorm=True):
    tw, ti, sorted_ids, expert_ids, ntpp, logits, bs = _route(x, gw, sgw, renorm)
    M = x.shape[0]
    # the GEMV: bf16 logits of x @ [gate; shared_gate]^T (fp32 accumulation,
    # order differs from a BLAS: at most 1 bf16 ulp)
    ref_logits = torch.nn.functional.linear(x.float(), torch.cat([gw, sgw]).float())
    assert torch.equal(logits, logits.bfloat16().float())
    torch.testing.assert_close(logits, ref_logits.bfloat16().float(), rtol=8e-3, atol=1e-5)
    # routing from those logits == upstream topk_softmax + renormalize
    rw, rid = mf.ref_topk_softmax(logits[:, :E].bfloat16(), TOPK, renorm)
    assert torch.equal(ti, rid), (ti, rid)
    torch.testing.assert_close(tw, rw, rtol=2e-6, atol=1e-7)
    assert bs == mf.marlin_block_size_m(M, TOPK, E)
    rs, re_, rn = mf.ref_align(ti, bs, E)
    assert torch.equal(ntpp, rn)
    assert torch.equal(sorted_ids, rs)
    assert torch.equal(expert_ids, re_)
    return ti


@pytest.mark.parametrize("M", [1, 2, 3, 5, 8])
def test_route_matches_topk_softmax_and_align(M):
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g).bfloat16()
    gw = (torch.randn(E, K, generator=g) * 0.1).bfloat16()
    sgw = (torch.randn(1, K, generator=g) * 0.1).bfloat16()
    _check_route(x, gw, sgw)


def test_route_ties_pick_lower_id():
    # Duplicate router rows give bit-equal logits: 3 pairs of ties; plus -0/+0.
    g = torch.Generator().manual_seed(7)
    M = 4
    x = torch.randn(M, K, generator=g).bfloat16()
    gw = (torch.randn(E, K, generator=g) * 0.1).bfloat16()
    gw[40] = gw[3]
    gw[41] = gw[3]
    gw[50] = gw[12]
    # make the tied rows win: scale them up
    for r in (3, 40, 41, 12, 50):
        gw[r] = gw[r] * 4
    sgw = (torch.randn(1, K, generator=g) * 0.1).bfloat16()
    ti = _check_route(x, gw, sgw)
    for row in ti.tolist():
        if 40 in row:
            assert 3 in row and row.index(3) < row.index(40)
    # all-zero input: every logit is 0 -> ids 0..k-1, weights 1/k
    tw, ti, *_ = _route(torch.zeros(2, K).bfloat16(), gw, sgw)
    assert ti.tolist() == [list(range(TOPK))] * 2
    torch.testing.assert_close(tw, torch.full((2, TOPK), 1.0 / TOPK))


def test_route_ties_signed_zero():
    # rows 5 (-0 logits) and 2 (+0 logits) tie; everything else negative.
    M = 2
    x = torch.ones(M, K).bfloat16()
    gw = torch.full((E, K), -0.01).bfloat16()
    gw[2] = 0.0
    gw[5] = -0.0
    gw[9] = 0.02
    sgw = torch.zeros(1, K).bfloat16()
    ti = _check_route(x, gw, sgw)
    assert ti[0].tolist()[:3] == [9, 2, 5]


def test_route_no_renorm():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, K, generator=g).bfloat16()
    gw = (torch.randn(E, K, generator=g) * 0.1).bfloat16()
    sgw = (torch.randn(1, K, generator=g) * 0.1).bfloat16()
    _check_route(x, gw, sgw, renorm=False)


def test_route_repeated_launches_reuse_counter():
    g = torch.Generator().manual_seed(11)
    gw = (torch.randn(E, K, generator=g) * 0.1).bfloat16()
    sgw = (torch.randn(1, K, generator=g) * 0.1).bfloat16()
    counter = torch.zeros(1, dtype=torch.int32)
    for i in range(3):
        x = torch.randn(2, K, generator=g).bfloat16()
        out = mf.moe_route(x, gw, sgw, TOPK, counter)
        tw, ti = out[0], out[1]
        lg = out[5][:, :E].bfloat16()
        assert torch.equal(ti, mf.ref_topk_softmax(lg, TOPK)[1])
        assert counter.item() == 0


@pytest.mark.parametrize("M,k,e", [(1, 10, 512), (8, 10, 512), (8, 10, 64), (3, 4, 64), (100, 10, 64)])
def test_align_sizes_match_upstream(monkeypatch, M, k, e):
    # upstream's own wrapper computes the sizes before calling the CUDA op;
    # stub the op so it runs on the CPU.
    from vllm.model_executor.layers.fused_moe import moe_align_block_size as mab

    monkeypatch.setattr(mab.ops, "moe_align_block_size", lambda *a, **kw: None)
    bs = mf.marlin_block_size_m(M, k, e)
    s, eids, n = mab.moe_align_block_size(torch.zeros(M, k, dtype=torch.int32), bs, e, None,
                                          ignore_invalid_experts=True)
    assert mf.align_sizes(M, k, e, bs) == (s.numel(), eids.numel())
    assert mf.marlin_block_size_m(8, 10, 512) == 8 and mf.marlin_block_size_m(64, 10, 64) == 16


@pytest.mark.parametrize("n,k", [(5, 32), (64, 2560), (3, 640)])
def test_int6_planes_round_trip_exact(n, k):
    g = torch.Generator().manual_seed(n)
    u = torch.randint(0, 64, (n, k), generator=g, dtype=torch.int32)
    dense = mf.int6_pack_dense(u)
    assert dense.shape == (n, k * 6 // 32)
    assert torch.equal(mf.int6_unpack_dense(dense, k), u)
    buf = dense.clone()
    planes = mf.int6_to_planes(buf, k, rows_per_chunk=2)
    # one new buffer of the original size (write-up §3.5); the input is untouched
    assert planes.data_ptr() != buf.data_ptr() and planes.shape == dense.shape
    assert planes.dtype == dense.dtype and torch.equal(buf, dense)
    assert torch.equal(mf.planes_to_u(planes, k), u)
    assert torch.equal(mf.int6_to_planes(dense, k), planes)  # default chunking: same bits


def test_int6_planes_chunk_temporaries_stay_in_small_pool():
    # the largest temporary is int64 [rows, K/8, 8]: <= 1 MiB (small pool)
    for k in (640, 2560):
        rows = max(1, mf._CHUNK_TEMP_BYTES // (k * 8))
        assert rows * k * 8 <= 1 << 20 and rows >= 1


def test_int6_dense_layout_is_humming_bitstream():
    # value i at stream bit 6i, LSB-first, straddling words at i = 5, 10, 21, 26
    u = torch.zeros(1, 32, dtype=torch.int32)
    u[0, 5] = 63  # bits 30..35: word 0 bits 30-31, word 1 bits 0-3
    w = mf.int6_pack_dense(u)
    assert (w[0, 0].item() & 0xFFFFFFFF) == 0xC0000000 and w[0, 1].item() == 0xF
    with pytest.raises(AssertionError, match="dense"):
        mf.int6_unpack_dense(torch.zeros(1, 7, dtype=torch.int32), 32)


def _shared_case(M, H, I, group, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g).bfloat16()
    u_gu = torch.randint(0, 64, (2 * I, H), generator=g, dtype=torch.int32)
    u_dn = torch.randint(0, 64, (H, I), generator=g, dtype=torch.int32)
    ng_gu = 1 if group == 0 else H // group
    ng_dn = 1 if group == 0 else I // group
    s_gu = (torch.rand(2 * I, ng_gu, generator=g) * 0.004 + 0.001).bfloat16()
    s_dn = (torch.rand(H, ng_dn, generator=g) * 0.004 + 0.001).bfloat16()
    routed = (torch.randn(M, TOPK, H, generator=g) * 0.1).bfloat16()
    sg = torch.randn(M, generator=g).bfloat16().float()
    return x, u_gu, s_gu, u_dn, s_dn, routed, sg


@pytest.mark.parametrize("M", [1, 4, 8])
@pytest.mark.parametrize("group", [0, 128])
def test_shared_expert_kernels_vs_fp32_reference(M, group):
    H, I = 256, 128
    x, u_gu, s_gu, u_dn, s_dn, routed, sg = _shared_case(M, H, I, group, seed=M + group)
    p_gu = mf.int6_to_planes(mf.int6_pack_dense(u_gu), H)
    p_dn = mf.int6_to_planes(mf.int6_pack_dense(u_dn), I)
    act = mf.shared_gate_up_silu(x, p_gu, s_gu, H, block_k=128)
    out = mf.shared_down_final(act, p_dn, s_dn, routed, sg, block_k=64)
    ref_out, ref_act = mf.ref_shared_block(x, u_gu, s_gu, u_dn, s_dn, sg, routed)
    # bf16 outputs; accumulation order differs -> at most ~1 bf16 ulp
    torch.testing.assert_close(act.float(), ref_act, rtol=1.6e-2, atol=1e-3)
    # the final kernel, given the same act, is at bf16 level
    ref_out2, _ = mf.ref_shared_block(x, u_gu, s_gu, u_dn, s_dn, sg, routed)
    torch.testing.assert_close(out.float(), ref_out2, rtol=1.6e-2, atol=2e-3)
    assert out.shape == (M, H) and act.shape == (M, I)


def test_shared_down_uses_routed_and_gate():
    # zero shared weights' effect: u = 32 -> q = 0, so out = bf16(sum routed)
    M, H, I = 2, 64, 64
    _, _, _, _, s_dn, routed, sg = _shared_case(M, H, I, 0, seed=5)
    p_dn = mf.int6_to_planes(mf.int6_pack_dense(torch.full((H, I), 32, dtype=torch.int32)), I)
    act = torch.randn(M, I).bfloat16()
    out = mf.shared_down_final(act, p_dn, s_dn, routed, sg, block_k=64)
    assert torch.equal(out.float(), routed.float().sum(1).bfloat16().float())


@pytest.mark.parametrize("group", [0, 64])
def test_int6_planes_gemm_prefill_vs_fp32(group):
    # M > 8 (prefill) path of the shared expert linears on the bit planes
    M, N, Kd = 37, 96, 256
    g = torch.Generator().manual_seed(group + 1)
    x = torch.randn(M, Kd, generator=g).bfloat16()
    u = torch.randint(0, 64, (N, Kd), generator=g, dtype=torch.int32)
    ng = 1 if group == 0 else Kd // group
    s = (torch.rand(N, ng, generator=g) * 0.004 + 0.001).bfloat16()
    planes = mf.int6_to_planes(mf.int6_pack_dense(u), Kd)
    out = mf.int6_planes_linear(x, planes, s, Kd)
    ref = x.float() @ ((u.float() - 32) * s.float().repeat_interleave(Kd // ng, 1)).T
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.bfloat16().float(), rtol=1.6e-2, atol=1e-3)


def _route_padded(M, pad_rows, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).bfloat16()
    x[pad_rows] = 0  # padded rows are zero rows, as the runner's padding
    gw = (torch.randn(E, K, generator=g) * 0.1).bfloat16()
    sgw = (torch.randn(1, K, generator=g) * 0.1).bfloat16()
    is_padding = torch.zeros(mf.MAX_FUSED_TOKENS, dtype=torch.bool)
    is_padding[pad_rows] = True
    counter = torch.zeros(1, dtype=torch.int32)
    out = mf.moe_route(x, gw, sgw, TOPK, counter, is_padding=is_padding[:M])
    return x, gw, sgw, is_padding, out


@pytest.mark.parametrize("M,pad_rows", [(4, [3]), (8, [5, 6, 7]), (2, [1])])
def test_route_skips_padding_rows(M, pad_rows):
    """VLLM_MOE_SKIP_PADDING semantics: a padded row gets id -1, weight 0 and
    no alignment slot (it reads no expert); real rows route as without the
    mask, and the alignment is that of the real rows alone."""
    x, gw, sgw, is_padding, (tw, ti, sorted_ids, expert_ids, ntpp, logits, bs) = _route_padded(
        M, pad_rows, seed=M)
    real = [m for m in range(M) if m not in pad_rows]
    assert (ti[pad_rows] == -1).all() and (tw[pad_rows] == 0).all()
    counter = torch.zeros(1, dtype=torch.int32)
    ref = mf.moe_route(x, gw, sgw, TOPK, counter)  # no mask: the zero rows route to some experts
    assert torch.equal(ti[real], ref[1][real]) and torch.equal(tw[real], ref[0][real])
    assert (ref[1][pad_rows] >= 0).all()
    rs, re_, rn = mf.ref_align(ti, bs, E)  # ref_align skips ids < 0
    assert torch.equal(ntpp, rn) and torch.equal(sorted_ids, rs) and torch.equal(expert_ids, re_)
    # every slot names a real row's (token, k) pair or the pad id M*TOPK
    slots = sorted_ids[sorted_ids < M * TOPK]
    assert sorted(slots.tolist()) == [m * TOPK + j for m in real for j in range(TOPK)]
    # fewer experts read than with the padded rows routed
    assert len(set(ti[real].flatten().tolist())) <= len(set(ref[1].flatten().tolist()))


def test_shared_down_skips_padding_rows():
    """The routed rows of padded tokens are never written by Marlin: the
    final sum must not read them (garbage / NaN stays out)."""
    M, H, I = 4, 64, 64
    _, _, _, _, s_dn, routed, sg = _shared_case(M, H, I, 0, seed=9)
    routed[3] = float("nan")
    p_dn = mf.int6_to_planes(mf.int6_pack_dense(torch.full((H, I), 32, dtype=torch.int32)), I)
    act = torch.randn(M, I).bfloat16()
    pad = torch.tensor([False, False, False, True])
    out = mf.shared_down_final(act, p_dn, s_dn, routed, sg, block_k=64, is_padding=pad)
    assert torch.equal(out[:3].float(), routed[:3].float().sum(1).bfloat16().float())
    assert torch.equal(out[3].float(), torch.zeros(H))
