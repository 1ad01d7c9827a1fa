"""0900-kernel-warmup: every specialisation key a realistic serving sequence
hits is in the set the startup warmup builds (no compile while serving).

The warmup set is what kernel_warmup.py launches for the compose limits
(max-num-seqs 4 / 2 with MTP, max-num-batched-tokens 512, capture sizes
[1, 2, 4], 1 draft token). The replay drives the layers' own serving entry
points with CPU tensors at the production shapes: decode of 1..max-num-seqs
padded to a capture size (is_padding in the forward context), eager steps of
every 1..8 tokens (short prompts, last prefill chunks, mixed steps), MTP
verify rows, prefill chunks of every size class up to 512, and QSA prefill
batches at odd row counts that overflow the staging arena and split. Keys
come from Triton's own binder (tests/warmup/spec_keys.py); nothing compiles.
"""

from __future__ import annotations

import types

import pytest
import torch

from spec_keys import keys_of, missing, recording

from vllm.models.qwen4_exp.nvidia import kernel_warmup as kw
from vllm.models.qwen4_exp.nvidia.ops import moe_fused as mf

COMPOSE = kw.BatchLimits(max_num_batched_tokens=512, max_num_seqs=4, capture_sizes=(1, 2, 4))
COMPOSE_MTP = kw.BatchLimits(max_num_batched_tokens=512, max_num_seqs=2, capture_sizes=(1, 2, 4),
                             num_speculative_tokens=1)
# Production MoE geometry (Qwen3.8-Flash-Next): 512 experts, top-10, hidden
# 2560, shared expert 640, INT6 per-channel.
E, TOPK, H, I = 512, 10, 2560, 640
# Prefill chunk sizes: every size class up to 512 (all of 9..40, then a
# spread incl. odd sizes, the largest chunk and multiples of 16).
PREFILL_SIZES = sorted({*range(9, 41), 47, 63, 64, 100, 127, 128, 255, 256, 257, 300, 383, 384,
                        500, 511, 512})


def _padded(n: int, limits: kw.BatchLimits) -> int:
    return next((s for s in sorted(limits.capture_sizes) if s >= n), n)


def decode_batches(limits: kw.BatchLimits) -> list[tuple[int, int]]:
    """(rows launched, real rows): graph decode padded to a capture size,
    eager steps of any 1..8 tokens, MTP verify rows (seqs x (1 + k))."""
    out = []
    per_req = 1 + limits.num_speculative_tokens
    for seqs in range(1, limits.max_num_seqs + 1):
        real = seqs * per_req
        out.append((_padded(real, limits), real))
    for m in range(1, kw.FUSED_MAX_TOKENS + 1):  # eager steps
        out.append((m, m))
    return out


# ----------------------------------------------------------------------------
# 0500 MoE


def _moe_fused(monkeypatch, group: int = 0):
    """A MoeFusedDecode at the production shapes (CPU tensors); ``group``:
    0 = per-channel INT6 scales, else the scale group size."""
    import vllm.model_executor.layers.fused_moe.experts.marlin_moe as mm
    from vllm.models.qwen4_exp.nvidia.moe_fused_layer import MoeFusedDecode

    g = torch.Generator().manual_seed(0)

    def planes(n, k):
        t = torch.randint(0, 2**31 - 1, (n, k * 3 // 16), generator=g, dtype=torch.int32)
        return t

    lin = lambda wp, sc, k: types.SimpleNamespace(weight_packed=wp, weight_scale=sc,  # noqa: E731
                                                 _int6_planes_k=k)
    block = types.SimpleNamespace(
        gate=types.SimpleNamespace(weight=torch.zeros(E, H, dtype=torch.bfloat16)),
        shared_expert_gate=types.SimpleNamespace(weight=torch.zeros(1, H, dtype=torch.bfloat16)),
        shared_expert=types.SimpleNamespace(
            gate_up_proj=lin(planes(2 * I, H), torch.ones(2 * I, H // (group or H), dtype=torch.bfloat16), H),
            down_proj=lin(planes(H, I), torch.ones(H, I // (group or I), dtype=torch.bfloat16), I)),
        _moe_fused_counter=torch.zeros(1, dtype=torch.int32))
    f = object.__new__(MoeFusedDecode)
    f.block, f.top_k, f.renormalize, f.hidden, f.num_experts = block, TOPK, True, H, E
    fe = types.SimpleNamespace(w1_bias=None, w2_bias=None, w1_scale=None, w2_scale=None, quant_type_id=0,
                               activation=None, a1_gscale=None, a2_gscale=None, g1_alphas=None,
                               g2_alphas=None, w1_zp=None, w2_zp=None, input_dtype=None, activation_config=None)
    re_ = types.SimpleNamespace(w13_weight=None, w2_weight=None, workspace=None, activation="silu")
    f.disabled, f._marlin = None, (re_, fe)
    # Marlin (a compiled op, not Triton) returns [M * k, H]
    monkeypatch.setattr(mm, "_fused_marlin_moe", lambda **kw_: torch.zeros(
        kw_["hidden_states"].shape[0] * kw_["num_topk"], H, dtype=torch.bfloat16))
    monkeypatch.setattr("vllm.scalar_type.ScalarType.from_id", staticmethod(lambda i: "uint4b8"))
    return f


def _moe_warm(f, limits):
    with recording() as recs:
        kw.warmup_moe_fused(f, limits.fused_decode_tokens(), limits.prefill_token_classes())
    return keys_of(recs), recs


def _moe_replay(f, limits):
    import vllm.envs as envs
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.forward_context import create_forward_context, override_forward_context

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    is_padding = torch.zeros(limits.max_num_batched_tokens, dtype=torch.bool)  # runner's buffer
    b = f.block
    with recording() as recs:
        for rows, real in decode_batches(limits):
            is_padding[:real] = False
            is_padding[real:rows] = True
            x = torch.zeros(rows, H, dtype=torch.bfloat16)
            with override_forward_context(create_forward_context(None, cfg, is_padding=is_padding[:rows])):
                assert envs.VLLM_MOE_SKIP_PADDING
                f.forward(x)
            f.forward(x)  # no forward context: the no-padding mask
        # prefill chunks: the shared expert's linears on the bit planes
        # (Int6PlanesLinearKernel.apply_weights), hidden_states[:M] of the
        # runner's max-token buffer and the SiluAndMul output
        hidden = torch.zeros(limits.max_num_batched_tokens, H, dtype=torch.bfloat16)
        gu, dn = b.shared_expert.gate_up_proj, b.shared_expert.down_proj
        for m in PREFILL_SIZES:
            if m > limits.max_num_batched_tokens:
                continue
            mf.int6_planes_linear(hidden[:m], gu.weight_packed, gu.weight_scale, H)
            mf.int6_planes_linear(torch.zeros(m, I, dtype=torch.bfloat16), dn.weight_packed,
                                  dn.weight_scale, I)
    return keys_of(recs), recs


MOE_KERNELS = ("_moe_route_kernel", "_shared_gate_up_silu_kernel", "_shared_down_final_kernel",
               "_int6_planes_gemm_kernel")


@pytest.mark.parametrize("limits", [COMPOSE, COMPOSE_MTP], ids=["compose", "mtp"])
def test_moe_replay_keys_are_warm(monkeypatch, limits):
    f = _moe_fused(monkeypatch)
    warm, wrecs = _moe_warm(f, limits)
    replay, rrecs = _moe_replay(f, limits)
    for name in MOE_KERNELS:
        assert rrecs[name].launches > 0, name
    assert not missing(warm, replay), missing(warm, replay)
    # what is warm: 7 route keys over M = 1..8 ({1},{2},{3},{4},{5,6},{7},{8}),
    # 4 per shared GEMV (BLOCK_M), the GEMM's M classes
    assert len(warm["_moe_route_kernel"]) == 7
    assert len(warm["_shared_gate_up_silu_kernel"]) == 4
    assert len(warm["_shared_down_final_kernel"]) == 4
    assert len(warm["_int6_planes_gemm_kernel"]) == 2 * 3  # 2 linears x {1, %16, other}


def test_moe_capture_sizes_alone_would_compile_in_service(monkeypatch):
    """The check can fail: warming only the capture sizes (what graph
    capture builds) leaves eager 3 / 5..8-token steps uncovered."""
    f = _moe_fused(monkeypatch)
    with recording() as recs:
        kw.warmup_moe_fused(f, COMPOSE.capture_sizes, [])
    replay, _ = _moe_replay(f, COMPOSE)
    miss = missing(keys_of(recs), replay)
    assert miss.get("_moe_route_kernel", 0) >= 3  # M = 3, {5, 6}, 7, 8
    assert miss.get("_shared_gate_up_silu_kernel", 0) == 1  # BLOCK_M 8


# ----------------------------------------------------------------------------
# 0400 HC: the layer's fused entry point (the custom op's implementation)

HC_WIDTH, HC_LORA, HC_INJECT, HC_COUNT = 10240, 320, 4, 4


def _hc_mix():
    from vllm.models.qwen4_exp.nvidia import hyperconnection as hcm
    from vllm.models.qwen4_exp.nvidia.ops import hc_int8

    n_down = hc_int8.padded_width(HC_LORA + HC_INJECT)
    down = torch.full((n_down, HC_WIDTH), 128, dtype=torch.uint8)
    up = torch.full((HC_WIDTH, HC_LORA), 128, dtype=torch.uint8)
    ds = torch.zeros(n_down, dtype=torch.bfloat16)
    us = torch.zeros(HC_WIDTH, dtype=torch.bfloat16)
    return lambda xn: hcm._hc_int8_mix(xn, down, ds, up, us, HC_LORA, HC_INJECT, HC_COUNT)


def test_hc_replay_keys_are_warm():
    limits = COMPOSE  # the MTP limits' decode rows (2, 4) are a subset
    mix = _hc_mix()
    with recording() as recs:
        kw.warmup_hc_mix(mix, HC_WIDTH, limits.fused_decode_tokens(), kw.hc_prefill_tokens(limits),
                         torch.device("cpu"))
    warm = keys_of(recs)
    with recording() as recs:
        for rows, _ in decode_batches(limits):
            mix(torch.zeros(rows, HC_WIDTH, dtype=torch.bfloat16))
        # prefill: every chunk size; the INT8 GEMMs' tile config follows the
        # token bucket, M itself is not specialised
        for m in range(9, limits.max_num_batched_tokens + 1):
            mix(torch.zeros(m, HC_WIDTH, dtype=torch.bfloat16))
    replay = keys_of(recs)
    assert recs["_hc_down_inject_silu_kernel"].launches and recs["_hc_up_gate_mix_kernel"].launches
    assert recs["_hc_prefill_down_kernel"].launches and recs["_hc_prefill_up_kernel"].launches
    assert not missing(warm, replay), missing(warm, replay)
    # the negative control: the Triton classes alone (9, 16) miss buckets
    with recording() as recs:
        kw.warmup_hc_mix(mix, HC_WIDTH, limits.fused_decode_tokens(),
                         limits.prefill_token_classes(), torch.device("cpu"))
    assert missing(keys_of(recs), replay)


# ----------------------------------------------------------------------------
# QSA prefill over host K/V: staged parts after arena overflow splits


def _qsa_case(rows: int, width: int = 32, page: int = 64, blocks: int = 8, kv_heads: int = 2,
              q_heads: int = 8, head_dim: int = 64, kv_dtype=torch.bfloat16):
    kv_cache = torch.zeros(blocks, page, kv_heads, 2 * head_dim, dtype=kv_dtype).transpose(1, 2)
    block_table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    # row i selects tokens [4i, 4i + width): neighbours share rows (reuse >= 2)
    idx = torch.arange(width, dtype=torch.int32)[None, :] + 4 * torch.arange(rows, dtype=torch.int32)[:, None]
    logical = torch.cat([idx, torch.full((rows, 1), width, dtype=torch.int32)], dim=1)
    token_to_req = torch.zeros(rows, dtype=torch.int32)
    q = torch.zeros(rows, q_heads, head_dim, dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    gate = torch.zeros(rows, q_heads * head_dim, dtype=torch.bfloat16)
    return kv_cache, block_table, logical, token_to_req, q, out, gate, head_dim, q_heads, width


def _qsa_split_points(rows: int) -> list[int]:
    """Row offsets at which staged_sparse_attention launches its parts."""
    from vllm.models.qwen4_exp.nvidia import qsa_host_kv as hk
    from vllm.models.qwen4_exp.nvidia.ops.qsa import qsa_sparse_paged_attention

    kv_cache, bt, logical, t2r, q, out, gate, hd, _, _ = _qsa_case(rows)
    arena = hk.QSAStagingArena(1, 64, 2, hd, "cpu")
    starts = []
    base = q.data_ptr()

    def attn(query, *a, **k):
        starts.append((query.data_ptr() - base) // query[0].nbytes)

    hk.staged_sparse_attention(attn, q, kv_cache, hd, logical, bt, t2r, True, out, gate, arena)
    return starts


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.uint8])
def test_qsa_overflow_splits_are_warm(kv_dtype):
    # uint8: 0260-qsa-kv-fp8's e4m3 bytes, the FP8 kernel and a uint8 arena
    from vllm.models.qwen4_exp.nvidia import qsa_host_kv as hk
    from vllm.models.qwen4_exp.nvidia.ops import qsa as qsa_ops

    starts = _qsa_split_points(13)
    assert len(starts) > 1, "the case must overflow the arena and split"
    # an int32 token_to_req[half:] not 16-byte aligned would be a new key:
    # 0220 splits at multiples of split_row_quantum (4 rows)
    assert not any(s % 4 for s in starts), starts
    fp8 = kv_dtype == torch.uint8
    scales = dict(k_scale=1.0, v_scale=1.0) if fp8 else {}
    kernel = "_qsa_sparse_paged_gqa_splitk_fp8_kernel" if fp8 else "_qsa_sparse_paged_gqa_splitk_kernel"
    kv_cache, bt, *_, hd, q_heads, width = _qsa_case(13, kv_dtype=kv_dtype)
    arena = hk.QSAStagingArena(1, 64, 2, hd, "cpu", kv_dtype)
    with recording() as recs:
        qsa_ops.warmup_qsa_sparse_paged_attention(kv_cache, bt, num_query_heads=q_heads,
                                                  selection_width=width)
        qsa_ops.warmup_qsa_sparse_paged_attention(arena.kv_view, bt, num_query_heads=q_heads,
                                                  selection_width=width)
        hk.warmup_staging(kv_cache, arena, bt, max_rows=33, selection_width=width)
    warm = keys_of(recs)
    with recording() as recs:
        for rows in (5, 7, 9, 13, 17, 31, 33):
            kv_cache, bt, logical, t2r, q, out, gate, hd, _, _ = _qsa_case(rows, kv_dtype=kv_dtype)
            hk.staged_sparse_attention(qsa_ops.qsa_sparse_paged_attention, q, kv_cache, hd, logical,
                                       bt, t2r, True, out, gate, arena, **scales)
    replay = keys_of(recs)
    assert recs[kernel].launches > 7  # split parts launched
    assert recs["_qsa_stage_rows_kernel"].launches
    assert not missing(warm, replay), missing(warm, replay)


# ----------------------------------------------------------------------------
# limits -> shapes


def test_batch_limits_enumerate_every_fused_count():
    assert COMPOSE.fused_decode_tokens() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert COMPOSE.prefill_token_classes() == [9, 16]
    assert COMPOSE_MTP.verify_rows == 4
    small = kw.BatchLimits(max_num_batched_tokens=6, max_num_seqs=2)
    assert small.fused_decode_tokens() == [1, 2, 3, 4, 5, 6] and small.prefill_token_classes() == []
    # every replayed decode shape is within the enumeration
    for lim in (COMPOSE, COMPOSE_MTP):
        assert {r for r, _ in decode_batches(lim)} <= set(lim.fused_decode_tokens())


def test_series_kernels_exist():
    from spec_keys import series_kernels

    for patch, mod, name in series_kernels():
        assert hasattr(getattr(mod, name), "fn"), (patch, name)


def test_model_walk_warms_each_geometry_once(monkeypatch):
    """warmup_model_kernels over a model: every MoE block carrying an enabled
    fused path is visited, blocks of one geometry are warmed once (the keys
    depend on shapes / strides / dtypes only), a disabled block is skipped."""
    a, b, c = (_moe_fused(monkeypatch) for _ in range(3))
    c.disabled = "TP/EP > 1"
    d = _moe_fused(monkeypatch, group=128)  # another geometry (scale groups)
    model = torch.nn.Module()
    for i, f in enumerate((a, b, c, d)):
        m = torch.nn.Module()
        m._moe_fused = f
        model.add_module(f"layer{i}", m)
    with recording() as recs:
        counts = kw.warmup_model_kernels(model, COMPOSE, require_cuda=False)
    per_geometry = 3 * len(COMPOSE.fused_decode_tokens()) + 2 * len(
        {*COMPOSE.fused_decode_tokens(), *COMPOSE.prefill_token_classes()})
    assert counts == {"moe": 2 * per_geometry, "hc": 0}
    assert len(recs["_moe_route_kernel"].keys) == 7  # the route does not read the scales
    assert len(recs["_shared_gate_up_silu_kernel"].keys) == 2 * 4
