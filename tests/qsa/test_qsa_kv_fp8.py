"""0260-qsa-kv-fp8: QSA K/V as FP8-e4m3 bytes in the host pool.

CPU, Triton interpreter, small shapes (the interpreter runs the plain-Triton
byte decode and computes bf16 tl.dot wrongly, so values are compared with a
reference only on a GPU: scripts/bench/qsa_fp8_device_check.py also compares
with vLLM 0.33.0's own kernel and the PTX decode). Checked here: the e4m3
codec and the scale folding, the staged prefill and the row cache
bit-identical to the direct FP8 kernel, the host backing / views / arena in
bytes, the layer's gate through the real forward_qsa, and the sm_86 compile
of every FP8 variant.
"""

from types import SimpleNamespace

import pytest
import torch

qhk = pytest.importorskip("vllm.models.qwen4_exp.nvidia.qsa_host_kv")
import vllm.models.qwen4_exp.nvidia.model  # noqa: E402,F401  (qsa.py imports it; avoids a cycle)
from vllm.models.qwen4_exp.nvidia.ops import qsa as ops_qsa  # noqa: E402
from vllm.models.qwen4_exp.nvidia.ops import qsa_fp8  # noqa: E402
from vllm.models.qwen4_exp.nvidia.ops import qsa_row_cache as rc  # noqa: E402
from vllm.models.qwen4_exp.nvidia.ops.qsa import qsa_sparse_paged_attention  # noqa: E402
from vllm.models.qwen4_exp.nvidia.qsa import Qwen4ExpQSAFlashAttentionImpl  # noqa: E402

from test_qsa_host_kv_attention import BS, D, GROUP, H_KV  # noqa: E402
from test_qsa_host_kv_attention import _case as _bf16_case  # noqa: E402

K_SCALE, V_SCALE = 0.5, 2.0


def _case(seed, k_scale=K_SCALE, v_scale=V_SCALE, **shape):
    """test_qsa_host_kv_attention's batch over its random K/V, the K/V
    (x 3, to reach past e4m3's finest steps) stored as e4m3 bytes: an FP8
    host K/V layer view ([blocks, heads, block, 2D] uint8, K then V per head)."""
    kv_cache, *batch = _bf16_case(seed, **shape)
    kv = kv_cache.transpose(1, 2).float() * 3
    k8 = qsa_fp8.quantize_kv_e4m3(kv[..., :D], k_scale)
    v8 = qsa_fp8.quantize_kv_e4m3(kv[..., D:], v_scale)
    return (torch.cat([k8, v8], -1).transpose(1, 2), *batch)


def _direct(kv_cache, q, gate, packed, table, tok2req, prefill=True, k_scale=K_SCALE,
            v_scale=V_SCALE):
    k, v = kv_cache.transpose(1, 2).split(D, dim=-1)
    out = torch.zeros_like(q)
    qsa_sparse_paged_attention(q, k, v, packed, table, tok2req, prefill, out,
                               output_gate=gate.contiguous(), k_scale=k_scale, v_scale=v_scale)
    return out


def _reference(kv_cache, q, gate, packed, table, tok2req, k_scale=K_SCALE, v_scale=V_SCALE):
    """float64 attention over the dequantized rows the kernel's validity rules
    select (same rules as the staging reference of test_qsa_host_kv_attention):
    every column of the tiles the row's count reaches (the kernel does not
    mask columns past the count inside its last tile)."""
    kv = kv_cache.transpose(1, 2)  # [blocks, block, heads, 2D] uint8
    num_blocks = kv.shape[0]
    out = torch.zeros(q.shape, dtype=torch.float64)
    topk = packed.shape[1] - 1
    block_n = ops_qsa._select_config(q.shape[0], H_KV, True, topk)[0]
    for r in range(q.shape[0]):
        req = int(tok2req[r])
        if req < 0 or req >= table.shape[0]:
            continue
        cols = []
        reach = -(-min(int(packed[r, topk]), topk) // block_n) * block_n
        for c in range(min(reach, topk)):
            t = int(packed[r, c])
            if t < 0 or t // BS >= table.shape[1]:
                continue
            page = int(table[req, t // BS])
            if 0 <= page < num_blocks:
                cols.append((page, t % BS))
        if not cols:
            continue
        rows = torch.stack([kv[p, o] for p, o in cols])  # [n, heads, 2D]
        k = qsa_fp8.dequantize_kv_e4m3(rows[..., :D], k_scale).double()
        v = qsa_fp8.dequantize_kv_e4m3(rows[..., D:], v_scale).double()
        for h in range(q.shape[1]):
            kvh = h // GROUP
            s = (k[:, kvh] @ q[r, h].double()) * D**-0.5
            p = torch.softmax(s, 0)
            out[r, h] = (p[:, None] * v[:, kvh]).sum(0) * torch.sigmoid(gate[r, h].double())
    return out


def test_e4m3_codec_roundtrip_and_saturation():
    x = torch.tensor([0.0, 1.0, -1.5, 448.0, 1000.0, -1e6, 2.0**-9])
    b = qsa_fp8.quantize_kv_e4m3(x)
    assert b.dtype == torch.uint8
    back = qsa_fp8.dequantize_kv_e4m3(b)
    # 448 is e4m3's largest finite value: larger inputs saturate (the cache
    # write's SATFINITE), never NaN
    assert back.tolist() == [0.0, 1.0, -1.5, 448.0, 448.0, -448.0, 2.0**-9]
    assert torch.equal(qsa_fp8.dequantize_kv_e4m3(qsa_fp8.quantize_kv_e4m3(x, 4.0), 4.0)[:3],
                       x[:3])


def test_kernel_scales_fold_byte_decode():
    # 0.33.0: softmax scale = 1/sqrt(D) x k_scale, output scale = v_scale,
    # both x 2^8 for the uint8 byte decode (which yields x * 2^-8)
    s, o = qsa_fp8.fp8_kernel_scales(256, 0.5, 2.0)
    assert s == pytest.approx(256**-0.5 * 0.5 * 256) and o == 512.0


@pytest.mark.skipif(
    not torch.cuda.is_available() or qsa_fp8._INTERPRET,
    reason="the Triton interpreter computes bf16 tl.dot wrongly (QK is a bf16 dot); "
    "scripts/bench/qsa_fp8_device_check.py compares with this reference and with "
    "vLLM 0.33.0's kernel on the GPU machine",
)
@pytest.mark.parametrize("seed,k_scale,v_scale", [(0, 0.5, 2.0), (1, 1.0, 1.0), (2, 0.25, 4.0)])
def test_fp8_kernel_matches_dequantized_reference(seed, k_scale, v_scale):
    kv_cache, q, gate, packed, table, tok2req = _case(seed, k_scale=k_scale, v_scale=v_scale)
    out = _direct(kv_cache, q, gate, packed, table, tok2req, k_scale=k_scale, v_scale=v_scale)
    ref = _reference(kv_cache, q, gate, packed, table, tok2req, k_scale, v_scale)
    assert ref.abs().sum() > 0
    # vLLM's FP8 paged-attention test (tests/kernels/attention/test_attention.py)
    # accepts atol 1e-2 against a reference over the dequantized cache
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-5)
    # rows the kernel must leave empty stay exactly zero
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))


def test_fp8_needs_its_scales():
    kv_cache, q, gate, packed, table, tok2req = _case(0)
    k, v = kv_cache.transpose(1, 2).split(D, dim=-1)
    with pytest.raises(AssertionError):
        qsa_sparse_paged_attention(q, k, v, packed, table, tok2req, True, torch.zeros_like(q),
                                   output_gate=gate.contiguous())


@pytest.mark.parametrize("seed,arena_blocks", [(0, 4), (1, 2), (2, 1)])
def test_fp8_staged_equals_direct(seed, arena_blocks):
    kv_cache, q, gate, packed, table, tok2req = _case(seed)
    ref = _direct(kv_cache, q, gate, packed, table, tok2req)
    arena = qhk.QSAStagingArena(arena_blocks, BS, H_KV, D, "cpu", torch.uint8)
    out = torch.zeros_like(q)
    qhk.staged_sparse_attention(qsa_sparse_paged_attention, q, kv_cache, D, packed, table,
                                tok2req, True, out, gate.contiguous(), arena,
                                k_scale=K_SCALE, v_scale=V_SCALE)
    assert ref.abs().sum() > 0
    assert torch.equal(out, ref)


def test_fp8_host_views_and_bind(monkeypatch):
    got = []

    def fake_alloc(nbytes, *, what):
        got.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(qhk, "allocate_host_kv_backing", fake_alloc)
    monkeypatch.setattr(qhk, "_HOST_RANGES", [])
    monkeypatch.setattr(qhk, "_row_cache_attach", lambda arena, n: None)
    layers = [SimpleNamespace(num_kv_heads=H_KV, head_dim=D) for _ in range(3)]
    arena = qhk.bind_host_kv_layers(layers, num_blocks=5, block_size=BS, arena_layers=4,
                                    device="cpu", to_device_view=lambda t: t,
                                    dtype=torch.uint8)
    per_layer = 5 * BS * H_KV * 2 * D  # 1 byte per element: half of bf16
    assert got == [3 * per_layer]
    # the arena keeps its rows (same overflow splits), in half the bytes
    assert arena.rows == 4 * BS and arena.nbytes == 4 * BS * H_KV * 2 * D
    assert arena.buffer.dtype == torch.uint8
    assert all(layer.kv_cache.dtype == torch.uint8 for layer in layers)
    assert layers[0].kv_cache.shape == (5, H_KV, BS, 2 * D)
    assert layers[0].kv_cache.stride() == (BS * H_KV * 2 * D, 2 * D, H_KV * 2 * D, 1)
    ptrs = [layer.kv_cache.data_ptr() for layer in layers]
    assert ptrs[1] - ptrs[0] == per_layer


def test_allocate_host_resident_kv_takes_the_spec_dtype(monkeypatch):
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        HostResidentFullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        UniformTypeKVCacheSpecs,
    )

    got = []
    monkeypatch.setattr(qhk, "allocate_host_kv_backing",
                        lambda n, *, what: got.append(n) or torch.zeros(n, dtype=torch.uint8))
    monkeypatch.setattr(qhk, "_HOST_RANGES", [])
    monkeypatch.setattr(qhk, "_ARENAS", {})
    monkeypatch.setattr(qhk, "_row_cache_attach", lambda arena, n: None)
    partner = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=16, head_size_v=16,
                                dtype=torch.bfloat16)
    specs = {"idx.k": partner}
    for i in range(2):
        specs[f"l{i}.attn"] = HostResidentFullAttentionSpec(
            block_size=BS, num_kv_heads=H_KV, head_size=D, head_size_v=D, dtype=torch.uint8,
            partner_layer="idx.k", staging_blocks=2)
    group = KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs.from_specs(specs))
    cfg = KVCacheConfig(num_blocks=7, kv_cache_tensors=[], kv_cache_groups=[group])
    views = qhk.allocate_host_resident_kv(cfg, "cpu", None, to_device_view=lambda t: t)
    assert set(views) == {"l0.attn", "l1.attn"}
    assert got == [2 * 7 * BS * H_KV * 2 * D]  # 1 KiB per token at the real shape
    assert all(v.dtype == torch.uint8 for v in views.values())
    assert qhk._ARENAS["cpu"].buffer.dtype == torch.uint8


@pytest.mark.parametrize("gate_on", [False, True])
def test_forward_qsa_fp8_through_the_layer_path(monkeypatch, gate_on):
    monkeypatch.setenv("VLLM_QSA_KV_OFFLOAD", "1")
    monkeypatch.setenv("VLLM_QSA_KV_FP8", "1" if gate_on else "0")
    monkeypatch.setenv("VLLM_QSA_ROW_CACHE", "0")
    kv_cache, q, gate, packed, table, tok2req = _case(4)
    impl = SimpleNamespace(alibi_slopes=None, sinks=None, sliding_window=(-1, -1), head_size=D)
    layer = SimpleNamespace(topk_indices_buffer=packed, _k_scale_float=K_SCALE,
                            _v_scale_float=V_SCALE,
                            qsa_staging_arena=qhk.QSAStagingArena(2, BS, H_KV, D, "cpu",
                                                                  torch.uint8))
    meta = SimpleNamespace(num_actual_tokens=q.shape[0], block_table=table)
    out = torch.empty_like(q)
    call = lambda prefill: Qwen4ExpQSAFlashAttentionImpl.forward_qsa(  # noqa: E731
        impl, layer, q, None, None, kv_cache, meta, out, token_to_req=tok2req,
        use_prefill_config=prefill, output_gate=gate.contiguous())
    if not gate_on:
        # a uint8 cache without the gate is refused, not read as bf16
        with pytest.raises(NotImplementedError):
            call(True)
        return
    call(True)  # staged through the uint8 arena
    assert torch.equal(out, _direct(kv_cache, q, gate, packed, table, tok2req))
    call(False)  # decode config, over "UVA"
    assert torch.equal(out, _direct(kv_cache, q, gate, packed, table, tok2req, prefill=False))


def _row_cache_step(cache, layer, kv_cache, q, gate, packed, table, tok2req):
    k, v = kv_cache.transpose(1, 2).split(D, dim=-1)
    out = torch.zeros_like(q)
    cache.attention(layer, q, k, v, packed, table, tok2req, out, output_gate=gate.contiguous(),
                    k_scale=K_SCALE, v_scale=V_SCALE)
    return out


def test_fp8_row_cache_bit_identical_over_steps():
    # randomized decode steps (rows <= 12) over one FP8 host layer: every
    # step's output through the row cache equals the direct FP8 kernel, with
    # hits (repeated selections) and stores (invalidate) in between
    kv_cache, _, _, _, table, _ = _case(7, num_blocks=9)
    arena = qhk.QSAStagingArena(2, BS, H_KV, D, "cpu", torch.uint8)
    cache = rc.QSARowCache(arena.token_rows, 1)
    cache.count_hits = True
    g = torch.Generator().manual_seed(11)
    prev = None
    for step in range(6):
        rows = int(torch.randint(1, 5, (1,), generator=g))
        q = torch.randn(rows, H_KV * GROUP, D, generator=g).to(torch.bfloat16)
        gate = torch.randn(rows, H_KV * GROUP, D, generator=g).to(torch.bfloat16)
        tok2req = torch.randint(0, 2, (rows,), generator=g).to(torch.int32)
        idx = torch.randint(0, 3 * BS, (rows, 20), generator=g).to(torch.int32)
        if prev is not None:
            idx[:, :10] = prev[: 1, :10]  # overlap with the previous step: hits
        prev = idx
        packed = torch.cat([idx, torch.full((rows, 1), 20, dtype=torch.int32)], 1).contiguous()
        out = _row_cache_step(cache, 0, kv_cache, q, gate, packed, table, tok2req)
        ref = _direct(kv_cache, q, gate, packed, table, tok2req, prefill=False)
        assert torch.equal(out, ref), step
        # a K/V store of a few slots, then invalidation (as _run_qsa does)
        slots = torch.randint(0, 9 * BS, (3,), generator=g)
        flat = kv_cache.transpose(1, 2).reshape(9 * BS, H_KV, 2 * D)
        flat[slots] = torch.randint(0, 120, flat[slots].shape, generator=g).to(torch.uint8)
        cache.invalidate(0, slots.to(torch.int64))
    hits, lookups = cache.stats[0].tolist()
    assert 0 < hits < lookups  # the cache did serve rows, not only misses
    # the lines hold the host's bytes (raw e4m3, not decoded values)
    assert cache.rows.dtype == torch.uint8


def test_fp8_variants_fit_sm86():
    from sm86 import check_fits, compile_many

    from test_qsa_row_cache_sm86 import (
        _CACHE_SIG,
        _SCALE_SIG,
        _SLICED,
        _SPLITK_ALIGNED,
        _SPLITK_SIG,
    )

    kv_heads, q_heads, head_dim, topk, block, width = 2, 16, 256, 2051, 12144, 22
    sig = {**_SPLITK_SIG, "k_cache_ptr": "*u8", "v_cache_ptr": "*u8", **_SCALE_SIG}
    configs = {ops_qsa._select_config(r, kv_heads, p, topk)
               for r in range(1, 8193) for p in (False, True)}
    cfgs = []
    for block_n, warps, tiles, splits in sorted(configs):
        common = dict(TOPK=topk, PAGE_SIZE=block, PAGE_TABLE_WIDTH=width,
                      GROUP_SIZE=q_heads // kv_heads, HEAD_DIM=head_dim,
                      NUM_QUERY_HEADS=q_heads, NUM_SPLITS=splits, NUM_TILES=tiles,
                      BLOCK_M=q_heads // kv_heads, BLOCK_N=block_n)
        cfgs.append(dict(fn=qsa_fp8._qsa_sparse_paged_gqa_splitk_fp8_kernel, signature=sig,
                         constexprs=common, aligned=_SPLITK_ALIGNED, num_warps=warps,
                         num_stages=2))
    decode = {ops_qsa._select_config(r, kv_heads, False, topk)
              for r in range(1, rc.ROW_CACHE_MAX_ROWS + 1)}
    for block_n, warps, tiles, splits in sorted(decode):
        common = dict(TOPK=topk, PAGE_SIZE=block, PAGE_TABLE_WIDTH=width,
                      GROUP_SIZE=q_heads // kv_heads, HEAD_DIM=head_dim,
                      NUM_QUERY_HEADS=q_heads, NUM_SPLITS=splits, NUM_TILES=tiles,
                      BLOCK_M=q_heads // kv_heads, BLOCK_N=block_n, NUM_LINES=block)
        cfgs.append(dict(fn=rc._qsa_row_cache_splitk_kernel,
                         signature={**sig, **_CACHE_SIG, "cache_rows_ptr": "*u8"},
                         constexprs=common,
                         aligned=tuple(a for a in _SPLITK_ALIGNED if a not in _SLICED)
                         + tuple(_CACHE_SIG),
                         num_warps=warps, num_stages=2))
    # the staging gather over uint8 rows (1,024 bytes per token)
    cfgs.append(dict(fn=qhk._qsa_stage_rows_kernel,
                     signature={"src_ptr": "*u8", "dst_ptr": "*u8", "slots_ptr": "*i32",
                                "num_rows": "i32", "block_size": "i32",
                                "stride_src_block": "i64", "stride_src_token": "i32"},
                     constexprs={"ROW": 1024, "ROWS_PER_PROGRAM": qhk.STAGE_ROWS_PER_PROGRAM},
                     aligned=("src_ptr", "dst_ptr", "slots_ptr", "block_size",
                              "stride_src_block", "stride_src_token"),
                     num_warps=qhk.STAGE_NUM_WARPS))
    res = compile_many(cfgs)
    assert len(res) == len(cfgs)
    for c, cfg in zip(res, cfgs):
        check_fits(c, str(cfg["constexprs"]))
    print({(c.name, cfg["constexprs"].get("BLOCK_N"), cfg["constexprs"].get("NUM_SPLITS")):
           c.shared for c, cfg in zip(res, cfgs)})


@pytest.mark.parametrize("offload,fp8", [("0", "1"), ("1", "1"), ("1", "0")])
def test_layer_dtype_spec_and_host_pool(monkeypatch, offload, fp8):
    """The layer's dtype decision (qsa_kv_cache_dtype, called before anything
    is built), its get_kv_cache_spec, vLLM's own dtype table and grouping, and
    0220's allocate_host_resident_kv: with the gate the host pool holds uint8
    e4m3 bytes, 1 KiB per token; without offload the start fails naming the fix."""
    from vllm.models.qwen4_exp.nvidia import qsa
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.core import kv_cache_utils as kvu
    from vllm.v1.kv_cache_interface import KVCacheConfig, MLAAttentionSpec

    monkeypatch.setenv("VLLM_QSA_KV_OFFLOAD", offload)
    monkeypatch.setenv("VLLM_QSA_KV_FP8", fp8)
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    if offload == "0":
        with pytest.raises(ValueError, match="needs VLLM_QSA_KV_OFFLOAD=1"):
            qsa.qsa_kv_cache_dtype("auto")
        return
    dtype_str = qsa.qsa_kv_cache_dtype("auto")
    assert dtype_str == ("fp8_e4m3" if fp8 == "1" else "auto")
    torch_dtype = kv_cache_dtype_str_to_dtype(dtype_str, SimpleNamespace(dtype=torch.bfloat16))
    assert torch_dtype == (torch.uint8 if fp8 == "1" else torch.bfloat16)
    # the real layer's spec (an owner made without its heavy __init__)
    import json
    from pathlib import Path

    hf = json.loads((Path(__file__).parents[2]
                     / "scripts/data/qwen4_exp_flash_next_config.json").read_text())
    owner = qsa.Qwen4ExpQSAAttention.__new__(qsa.Qwen4ExpQSAAttention)
    torch.nn.Module.__init__(owner)
    owner.num_kv_heads, owner.head_dim = H_KV, D
    owner.kv_cache_dtype, owner.kv_cache_torch_dtype = dtype_str, torch_dtype
    owner.indexer = SimpleNamespace(compressed_key_cache=SimpleNamespace(prefix="l3.idx"))
    vcfg = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(to_dict=lambda: hf)),
        speculative_config=None, parallel_config=SimpleNamespace(pipeline_parallel_size=3),
        cache_config=SimpleNamespace(block_size=BS))
    spec = owner.get_kv_cache_spec(vcfg)
    assert spec.dtype == torch_dtype and spec.partner_layer == "l3.idx"
    assert spec.page_size_bytes == BS * H_KV * 2 * D * torch_dtype.itemsize
    partner = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.bfloat16)
    groups = kvu._attach_host_resident_layers(
        [kvu.KVCacheGroupSpec(["l3.idx"], partner)], {"l3.attn": spec})
    cfg_kv = KVCacheConfig(num_blocks=6, kv_cache_tensors=[], kv_cache_groups=groups)
    got = []
    monkeypatch.setattr(qhk, "allocate_host_kv_backing",
                        lambda n, *, what: got.append(n) or torch.zeros(n, dtype=torch.uint8))
    monkeypatch.setattr(qhk, "_HOST_RANGES", [])
    monkeypatch.setattr(qhk, "_ARENAS", {})
    monkeypatch.setattr(qhk, "_row_cache_attach", lambda arena, n: None)
    views = qhk.allocate_host_resident_kv(cfg_kv, "cpu", None, to_device_view=lambda t: t)
    assert views["l3.attn"].dtype == torch_dtype
    assert got == [6 * spec.page_size_bytes]
