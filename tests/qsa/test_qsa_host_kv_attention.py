"""0220-qsa-kv-offload: QSA attention over host K/V (prefill staging arena)
equals the in-VRAM path, bit for bit, on small shapes in the Triton
interpreter; both gate settings through the real forward_qsa."""

from types import SimpleNamespace

import pytest
import torch

qhk = pytest.importorskip("vllm.models.qwen4_exp.nvidia.qsa_host_kv")
import vllm.models.qwen4_exp.nvidia.model  # noqa: E402,F401  (qsa.py imports it; avoids a cycle)
from vllm.models.qwen4_exp.nvidia.ops.qsa import qsa_sparse_paged_attention  # noqa: E402
from vllm.models.qwen4_exp.nvidia.qsa import Qwen4ExpQSAFlashAttentionImpl  # noqa: E402

H_KV, GROUP, D, BS = 2, 2, 16, 16


def _case(seed, rows=6, num_blocks=9, topk=20, num_reqs=2, width=4):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_blocks, BS, H_KV, 2 * D, generator=g).to(torch.bfloat16)
    kv_cache = kv.transpose(1, 2)  # [blocks, heads, block, 2D] like the bound layer view
    q = torch.randn(rows, H_KV * GROUP, D, generator=g).to(torch.bfloat16)
    gate = torch.randn(rows, H_KV * GROUP, D, generator=g).to(torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=g)[: num_reqs * width]
    table = perm.view(num_reqs, width).to(torch.int32)
    table[1, -1] = -1  # a hole, and a page past the cache below
    table[0, -1] = num_blocks + 3
    tok2req = torch.randint(0, num_reqs, (rows,), generator=g).to(torch.int32)
    tok2req[-1] = -1  # padded row
    idx = torch.randint(-2, width * BS + 5, (rows, topk), generator=g).to(torch.int32)
    count = torch.randint(topk // 2, topk + 1, (rows, 1), generator=g).to(torch.int32)
    packed = torch.cat([idx, count], 1).contiguous()
    return kv_cache, q, gate, packed, table, tok2req


def _direct(kv_cache, q, gate, packed, table, tok2req, prefill=True):
    k, v = kv_cache.transpose(1, 2).split(D, dim=-1)
    out = torch.zeros_like(q)
    qsa_sparse_paged_attention(q, k, v, packed, table, tok2req, prefill, out,
                               output_gate=gate.contiguous())
    return out


@pytest.mark.parametrize("seed,arena_blocks,topk", [(0, 4, 20), (1, 2, 20), (2, 1, 20),
                                                    (5, 3, 31)])
# (split-K merge kernel does not run in the Triton interpreter: the GPU test covers it)
def test_staged_equals_direct(seed, arena_blocks, topk):
    kv_cache, q, gate, packed, table, tok2req = _case(seed, topk=topk)
    ref = _direct(kv_cache, q, gate, packed, table, tok2req)
    arena = qhk.QSAStagingArena(arena_blocks, BS, H_KV, D, "cpu")
    out = torch.zeros_like(q)
    qhk.staged_sparse_attention(qsa_sparse_paged_attention, q, kv_cache, D, packed,
                                table, tok2req, True, out, gate.contiguous(), arena)
    assert ref.abs().sum() > 0
    assert torch.equal(out, ref)


def test_stage_rewrites_only_into_arena():
    kv_cache, q, gate, packed, table, tok2req = _case(3)
    arena = qhk.QSAStagingArena(4, BS, H_KV, D, "cpu")
    staged = qhk.stage_selected_rows(kv_cache, packed, table, tok2req, arena)
    assert staged is not None
    view, idx, new_table = staged
    assert view.data_ptr() == arena.buffer.data_ptr()
    assert torch.equal(idx[:, -1], packed[:, -1])  # count column kept
    assert int(idx[:, :-1].max()) < arena.rows
    assert (new_table[:, :4] == torch.arange(4, dtype=torch.int32)).all()
    assert (new_table[:, 4:] == -1).all()
    # too small an arena says so instead of truncating
    tiny = qhk.QSAStagingArena(1, BS, H_KV, D, "cpu")
    assert qhk.stage_selected_rows(kv_cache, packed, table, tok2req, tiny) is None


def test_host_views_layout():
    backing = torch.zeros(3 * 5 * BS * H_KV * 2 * D * 2, dtype=torch.uint8)
    views = qhk.host_kv_layer_views(backing, 3, 5, BS, H_KV, D)
    assert len(views) == 3 and views[0].shape == (5, H_KV, BS, 2 * D)
    # one token's two heads are one contiguous 2*H*D run (BLNHC), as in VRAM
    assert views[0].stride() == (BS * H_KV * 2 * D, 2 * D, H_KV * 2 * D, 1)
    views[2][4, 1, BS - 1, -1] = 1.0
    assert backing.view(torch.bfloat16)[-1] == 1.0


@pytest.mark.parametrize("gate_on", [False, True])
def test_forward_qsa_both_gates(monkeypatch, gate_on):
    monkeypatch.setenv("VLLM_QSA_KV_OFFLOAD", "1" if gate_on else "0")
    kv_cache, q, gate, packed, table, tok2req = _case(4)
    ref = _direct(kv_cache, q, gate, packed, table, tok2req)
    used = []
    real_stage = qhk.stage_selected_rows

    def spy(*a, **kw):
        used.append(1)
        return real_stage(*a, **kw)

    monkeypatch.setattr(qhk, "stage_selected_rows", spy)
    impl = SimpleNamespace(alibi_slopes=None, sinks=None, sliding_window=(-1, -1), head_size=D)
    layer = SimpleNamespace(topk_indices_buffer=packed,
                            qsa_staging_arena=qhk.QSAStagingArena(2, BS, H_KV, D, "cpu"))
    meta = SimpleNamespace(num_actual_tokens=q.shape[0], block_table=table)
    out = torch.empty_like(q)
    Qwen4ExpQSAFlashAttentionImpl.forward_qsa(
        impl, layer, q, None, None, kv_cache, meta, out, token_to_req=tok2req,
        use_prefill_config=True, output_gate=gate.contiguous())
    assert torch.equal(out, ref)
    assert bool(used) == gate_on


def test_split_parts_keep_whole_batch_config(monkeypatch):
    # the launch config (tile width, split count) decides the summation order;
    # a part of a split batch must launch as the whole batch would (on the GPU
    # a 64-row prefill split into 8-row parts otherwise changes the result)
    monkeypatch.setattr(qhk, "SPLIT_MIN_REUSE", 0.0)  # always split
    kv_cache, q, gate, packed, table, tok2req = _case(6, rows=8)
    seen = []

    def spy(*a, config_rows=None, **kw):
        seen.append((a[0].shape[0], config_rows))
        return qsa_sparse_paged_attention(*a, config_rows=config_rows, **kw)

    arena = qhk.QSAStagingArena(1, BS, H_KV, D, "cpu")
    out = torch.zeros_like(q)
    qhk.staged_sparse_attention(spy, q, kv_cache, D, packed, table, tok2req, True, out,
                                gate.contiguous(), arena)
    assert len(seen) > 1 and all(c == 8 for _, c in seen)
    assert sum(r for r, _ in seen) == 8
    assert torch.equal(out, _direct(kv_cache, q, gate, packed, table, tok2req))


def test_bind_host_kv_layers(monkeypatch):
    got = []

    def fake_alloc(nbytes, *, what):
        got.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(qhk, "allocate_host_kv_backing", fake_alloc)
    # bind registers the backing's range; the backing is freed after this test
    # and its addresses reused, so the registry must not outlive it
    monkeypatch.setattr(qhk, "_HOST_RANGES", [])
    layers = [SimpleNamespace(num_kv_heads=H_KV, head_dim=D) for _ in range(3)]
    arena = qhk.bind_host_kv_layers(layers, num_blocks=5, block_size=BS, arena_layers=4,
                                    device="cpu", to_device_view=lambda t: t)
    per_layer = 5 * BS * H_KV * 2 * D * 2
    assert got == [3 * per_layer]  # one exact-size backing for the rank
    assert arena.rows == 4 * BS and arena.nbytes == 4 * BS * H_KV * 2 * D * 2
    ptrs = [layer.kv_cache.data_ptr() for layer in layers]
    assert ptrs[1] - ptrs[0] == per_layer and ptrs[2] - ptrs[1] == per_layer
    assert all(layer.qsa_host_kv and layer.qsa_staging_arena is arena for layer in layers)
    assert layers[0].kv_cache.shape == (5, H_KV, BS, 2 * D)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 33])
def test_stage_rows_gathers_token_rows(n):
    # the Triton gather equals torch indexing of the same token rows, for
    # row counts around the 8-rows-per-program tile, and leaves the rest of
    # the destination untouched
    g = torch.Generator().manual_seed(n)
    kv = torch.randn(5, BS, H_KV, 2 * D, generator=g).to(torch.bfloat16)
    kv_cache = kv.transpose(1, 2)
    slots = torch.randperm(5 * BS, generator=g)[:n].to(torch.int32)
    dst = torch.full((n + 3, H_KV, 2 * D), 7.0, dtype=torch.bfloat16)
    qhk.stage_rows(kv_cache, slots, dst)
    want = kv[slots.long() // BS, slots.long() % BS]
    assert torch.equal(dst[:n], want)
    assert (dst[n:] == 7.0).all()


def test_stage_rows_refuses_other_layouts():
    kv = torch.zeros(2, H_KV, BS, 2 * D, dtype=torch.bfloat16)  # heads outer: rows not contiguous
    with pytest.raises(ValueError, match="BLNHC"):
        qhk.stage_rows(kv, torch.zeros(1, dtype=torch.int32),
                       torch.zeros(1, H_KV, 2 * D, dtype=torch.bfloat16))
    kv = torch.zeros(2, BS, H_KV, 2 * D, dtype=torch.bfloat16).transpose(1, 2)
    with pytest.raises(ValueError, match="int32"):  # one compiled gather variant
        qhk.stage_rows(kv, torch.zeros(1, dtype=torch.int64),
                       torch.zeros(1, H_KV, 2 * D, dtype=torch.bfloat16))


def test_staging_kernels_fit_sm86():
    # every staging kernel at the production shape (2,051 selection columns,
    # 12,144-token blocks, 22-page table), specialized as at run time: fresh
    # buffers aligned, the sliced pointers and runtime ints unspecialized
    from sm86 import compile_many, check_fits

    shape = {"TOPK": 2051, "PAGE_SIZE": 12144, "PAGE_TABLE_WIDTH": 22,
             "BLOCK_N": qhk.STAGE_COLUMN_BLOCK}
    common = {"indices_ptr": "*i32", "block_table_ptr": "*i32", "token_to_req_ptr": "*i32",
              "stride_indices_row": "i32", "stride_table_req": "i32",
              "num_cache_blocks": "i32", "num_requests": "i32"}
    configs = [
        dict(fn=qhk._qsa_stage_rows_kernel,
             signature={"src_ptr": "*bf16", "dst_ptr": "*bf16", "slots_ptr": "*i32",
                        "num_rows": "i32", "block_size": "i32", "stride_src_block": "i64",
                        "stride_src_token": "i32"},
             constexprs={"ROW": 1024, "ROWS_PER_PROGRAM": qhk.STAGE_ROWS_PER_PROGRAM},
             aligned=("src_ptr", "dst_ptr", "slots_ptr", "block_size", "stride_src_block",
                      "stride_src_token"),
             num_warps=qhk.STAGE_NUM_WARPS),
        dict(fn=qhk._qsa_stage_mark_kernel, signature={**common, "marks_ptr": "*i32"},
             constexprs=shape, aligned=("marks_ptr",)),
        dict(fn=qhk._qsa_stage_compact_kernel,
             signature={"ranks_ptr": "*i32", "unique_ptr": "*i32", "num_slots": "i32"},
             constexprs={"BLOCK": qhk.STAGE_COMPACT_BLOCK}, aligned=("ranks_ptr", "unique_ptr")),
        dict(fn=qhk._qsa_stage_rewrite_kernel,
             signature={**common, "ranks_ptr": "*i32", "out_ptr": "*i32", "stride_out_row": "i32"},
             constexprs=shape, aligned=("ranks_ptr", "out_ptr")),
    ]
    for c in compile_many(configs):
        check_fits(c)


def _reference_stage(kv_cache, packed, table, tok2req):
    # the first version's dedup (int64 + torch.unique): the same ranks
    bs = kv_cache.shape[2]
    topk = packed.shape[1] - 1
    idx = packed[:, :topk].long()
    nreq, width = table.shape
    req = tok2req.long()
    safe_idx = idx.clamp_min(0)
    page = safe_idx // bs
    valid = ((req >= 0) & (req < nreq))[:, None] & (idx >= 0) & (page < width)
    physical = table[req.clamp(0, nreq - 1)[:, None], page.clamp_max(width - 1)].long()
    valid &= (physical >= 0) & (physical < kv_cache.shape[0])
    slots = physical * bs + safe_idx % bs
    unique, inverse = torch.unique(slots[valid], sorted=True, return_inverse=True)
    new_idx = torch.full_like(packed, -1)
    new_idx[:, topk] = packed[:, topk]
    new_idx[:, :topk][valid] = inverse.to(torch.int32)
    return unique, new_idx, int(valid.sum())


@pytest.mark.parametrize("seed,topk", [(0, 20), (1, 31), (2, 5)])
def test_stage_dedup_equals_sorted_unique(seed, topk):
    # the Triton mark / prefix-sum / compact / rewrite path gives exactly the
    # ranks torch.unique(sorted=True) gave, and gathers the same rows
    kv_cache, q, gate, packed, table, tok2req = _case(seed, rows=7, topk=topk)
    unique, want_idx, selected = _reference_stage(kv_cache, packed, table, tok2req)
    arena = qhk.QSAStagingArena(4, BS, H_KV, D, "cpu")
    stats = {}
    view, idx, _ = qhk.stage_selected_rows(kv_cache, packed, table, tok2req, arena, stats)
    assert stats == {"selected": selected, "distinct": unique.numel()}
    assert torch.equal(idx, want_idx)
    kv = kv_cache.transpose(1, 2)
    assert torch.equal(arena.token_rows[: unique.numel()], kv[unique // BS, unique % BS])


def test_stage_sliced_inputs():
    # a split part's inputs are row slices at any offset of the batch buffers
    kv_cache, q, gate, packed, table, tok2req = _case(8, rows=9)
    arena = qhk.QSAStagingArena(4, BS, H_KV, D, "cpu")
    _, want_idx, _ = _reference_stage(kv_cache, packed[3:], table, tok2req[3:])
    _, idx, _ = qhk.stage_selected_rows(kv_cache, packed[3:], table, tok2req[3:], arena)
    assert torch.equal(idx, want_idx)


def _peak_cpu_bytes(fn):
    # peak of the live CPU tensor bytes allocated inside fn (torch profiler)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage),
                    key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def test_stage_transient_bytes_matches_measured():
    # stage_transient_bytes (what the ledger counts) against the bytes a real
    # call allocates on CPU torch (no 512 B rounding, no CUB workspace there):
    # it covers them, and is not looser than its rounding + scan bound
    from vllm.models.qwen4_exp.common import qsa_capacity as qc

    rows, topk, blocks, bs = 12, 300, 40, 64
    g = torch.Generator().manual_seed(11)
    kv_cache = torch.zeros(blocks, bs, H_KV, 2 * D, dtype=torch.bfloat16).transpose(1, 2)
    table = torch.randperm(blocks, generator=g)[:36].view(3, 12).to(torch.int32)
    idx = torch.randint(0, 4 * bs, (rows, topk), generator=g).to(torch.int32)
    packed = torch.cat([idx, torch.full((rows, 1), topk, dtype=torch.int32)], 1)
    tok2req = torch.randint(0, 3, (rows,), generator=g).to(torch.int32)
    arena = qhk.QSAStagingArena(12, bs, H_KV, D, "cpu")  # holds all 3 x 4 pages
    assert qhk.stage_selected_rows(kv_cache, packed, table, tok2req, arena) is not None
    measured = _peak_cpu_bytes(
        lambda: qhk.stage_selected_rows(kv_cache, packed, table, tok2req, arena))
    bound = qc.stage_transient_bytes(rows, topk + 1, blocks, bs, arena.rows, 3, 12)
    assert 0 < measured <= bound
    assert bound - measured <= qc.SCAN_WORKSPACE_BYTES + 6 * qc.ALLOC_ROUND


def test_split_row_quantum():
    t32 = torch.zeros(10, dtype=torch.int32)
    assert qhk.split_row_quantum(t32) == 4
    assert qhk.split_row_quantum(torch.zeros(10, 2051, dtype=torch.int32)) == 4
    assert qhk.split_row_quantum(torch.zeros(10, 2052, dtype=torch.int32)) == 1
    assert qhk.split_row_quantum(torch.zeros(10, 8, 128, dtype=torch.bfloat16)) == 1
    assert qhk.split_row_quantum(torch.zeros(10, 3, dtype=torch.int16), t32) == 8


@pytest.mark.parametrize("rows", [22, 13, 31])
def test_split_offsets_16_byte_aligned(monkeypatch, rows):
    # every part of a split batch (and the dedup kernels' inputs) starts
    # 16-byte aligned, like the warmed variants: rows // 2 = 11 used to give
    # token_to_req[11:] at 44 B, a new attention variant in service
    monkeypatch.setattr(qhk, "SPLIT_MIN_REUSE", 0.0)  # always split
    kv_cache, q, gate, packed, table, tok2req = _case(9, rows=rows)
    seen, staged_inputs = [], []

    def spy(q_, k, v, idx, tbl, t2r, prefill, out, *, output_gate, config_rows):
        seen.append((q_.shape[0], [x.data_ptr() % 16 for x in (q_, t2r, out, output_gate)],
                     idx.data_ptr() % 16))
        return qsa_sparse_paged_attention(q_, k, v, idx, tbl, t2r, prefill, out,
                                          output_gate=output_gate, config_rows=config_rows)

    real_stage = qhk.stage_selected_rows

    def stage_spy(kv, idx, tbl, t2r, *a, **kw):
        staged_inputs.append((idx.data_ptr() % 16, t2r.data_ptr() % 16))
        return real_stage(kv, idx, tbl, t2r, *a, **kw)

    monkeypatch.setattr(qhk, "stage_selected_rows", stage_spy)
    # every buffer 16-byte aligned at row 0, as the runner's are
    assert all(x.data_ptr() % 16 == 0 for x in (q, packed, tok2req, gate))
    arena = qhk.QSAStagingArena(1, BS, H_KV, D, "cpu")
    out = torch.zeros_like(q)
    qhk.staged_sparse_attention(spy, q, kv_cache, D, packed, table, tok2req, True, out,
                                gate.contiguous(), arena)
    assert len(seen) > 1 and sum(r for r, _, _ in seen) == rows
    assert all(ptrs == [0, 0, 0, 0] and idx == 0 for _, ptrs, idx in seen)
    assert all(a == (0, 0) for a in staged_inputs)
    assert torch.equal(out, _direct(kv_cache, q, gate, packed, table, tok2req))


@pytest.mark.parametrize("min_reuse", [0.0, float("inf")])
def test_overflow_splits_or_reads_over_uva(monkeypatch, min_reuse):
    # an arena too small for the batch: with enough reuse the batch is split
    # into staged parts, without it the whole batch reads the host view
    # directly (original indices and table); both equal the direct path
    monkeypatch.setattr(qhk, "SPLIT_MIN_REUSE", min_reuse)
    kv_cache, q, gate, packed, table, tok2req = _case(7, rows=8)
    calls = []

    def spy(q_, k, v, idx, tbl, *a, **kw):
        calls.append((q_.shape[0], tbl is table))
        return qsa_sparse_paged_attention(q_, k, v, idx, tbl, *a, **kw)

    # 63 distinct rows > 48; each 4-row part fits (splits keep 4-row alignment)
    arena = qhk.QSAStagingArena(3, BS, H_KV, D, "cpu")
    stats = {}
    assert qhk.stage_selected_rows(kv_cache, packed, table, tok2req, arena, stats) is None
    assert stats["distinct"] > arena.rows and stats["selected"] >= stats["distinct"]
    out = torch.zeros_like(q)
    qhk.staged_sparse_attention(spy, q, kv_cache, D, packed, table, tok2req, True, out,
                                gate.contiguous(), arena)
    if min_reuse == 0.0:
        assert len(calls) > 1 and not all(direct for _, direct in calls)
    else:
        assert calls == [(8, True)]
    assert torch.equal(out, _direct(kv_cache, q, gate, packed, table, tok2req))
