"""0250-qsa-row-cache on the CPU (Triton interpreter, tiny shapes).

* randomized decode steps (qsa_row_cache_sim): heavy line collisions (16
  lines per layer, up to 4 rows of 32 columns over 6-block requests), host
  rows rewritten between steps, arena overwrites, shared prefix blocks,
  epoch wraps; every step the cached kernels' output equals the upstream
  split-K kernel's (torch.equal) and every tagged line holds its slot's
  current host row. The interpreter runs ~1-3 steps/s, so CI runs 30 steps
  plus 5 with 3 tiles (ROW_CACHE_STEPS=N for more); the GPU check
  (test_qsa_row_cache_gpu.py) ran 2 x 1,000 steps at the real sizes. The
  interpreter runs programs one after another: races are argued in
  ops/qsa_row_cache.py and tested on the GPU.
* the hooks in forward_qsa: gate on -> cached path (same output), gate off ->
  untouched state; > 12 rows and prefill-config batches -> the caller's path;
  with 0220's arena, a staged prefill and the staging warmup (the arena's
  writers) drop every tag.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

rc = pytest.importorskip("vllm.models.qwen4_exp.nvidia.ops.qsa_row_cache")
import vllm.models.qwen4_exp.nvidia.model  # noqa: E402,F401  (qsa.py imports it; avoids a cycle)
from qsa_row_cache_sim import Shape, line_of, run  # noqa: E402
from vllm.models.qwen4_exp.nvidia.ops.qsa import qsa_sparse_paged_attention  # noqa: E402
from vllm.models.qwen4_exp.nvidia.qsa import Qwen4ExpQSAFlashAttentionImpl  # noqa: E402

STEPS = int(os.environ.get("ROW_CACHE_STEPS", "30"))


def test_random_steps_equal_uncached():
    # epoch_limit 6: each layer wraps every ~10 steps; arena overwrite p 0.08
    # (seed 1, 30 steps: 6 wraps, 2 overwrites, hit rate 0.29).
    out = run(STEPS, Shape(epoch_limit=6, arena_overwrite_p=0.08, max_requests=2), seed=1)
    assert out["steps"] == out["equal"] == STEPS
    # the cache did work: rows served from VRAM, lines filled, the rare paths ran
    assert out["hits"] > 0.15 * out["lookups"], out
    assert out["tagged_max"] >= 8, out
    assert out["arena_overwrites"] >= 1 and out["epoch_resets"] >= 1, out


class _TorchMerge:
    """Stand-in for _qsa_merge_splitk_kernel (which does not run in the
    Triton interpreter): the same merge in torch, used by both paths, so
    multi-tile selections (several splits) compare on the CPU too."""

    def __getitem__(self, grid):
        def launch(po, lse, out, gate, *args, **kw):
            rows, heads = grid
            w = torch.exp2(lse - lse.amax(0, keepdim=True).clamp_min(-1e30))
            w = torch.where(torch.isfinite(lse), w, torch.zeros_like(w))
            den = w.sum(0)
            merged = (po * w[..., None]).sum(0) / den.clamp_min(1e-30)[..., None]
            merged = torch.where(den[..., None] > 0, merged, torch.zeros_like(merged))
            res = merged.to(out.dtype).float() * torch.sigmoid(gate.float())
            out[:rows, :heads].copy_(res[:rows, :heads].to(out.dtype))
        return launch


def test_random_steps_multi_tile(monkeypatch):
    # width 70: 3 tiles of 32 (the last partial), 3 splits: plan tiles > 0
    from vllm.models.qwen4_exp.nvidia.ops import qsa as upstream

    monkeypatch.setattr(upstream, "_qsa_merge_splitk_kernel", _TorchMerge())
    monkeypatch.setattr(rc, "_qsa_merge_splitk_kernel", _TorchMerge())
    out = run(max(5, STEPS // 6), Shape(topk=70, lines=24, max_requests=2, epoch_limit=1000),
              seed=3)
    assert out["steps"] == out["equal"]
    assert out["hits"] > 0.15 * out["lookups"], out


def test_line_hash_matches_kernel():
    # The sim's torch line_of must be the kernel's line (check_lines uses it).
    cache = rc.QSARowCache(torch.zeros(1, 16, 2, 32, dtype=torch.bfloat16))
    slots = torch.tensor([0, 1, 5, 77, 2**31 - 1, 123456789], dtype=torch.int64)
    # invalidate clears exactly the line a slot maps to when its tag matches
    for s in slots.tolist():
        line = int(line_of(torch.tensor([s]), 16))
        cache.tags.fill_(-1)
        cache.tags[0, line] = s
        cache.invalidate(0, torch.tensor([s], dtype=torch.int64))
        assert int(cache.tags[0, line]) == -1
        cache.tags[0, line] = s + 1  # another slot on the line survives
        cache.invalidate(0, torch.tensor([s, -1], dtype=torch.int64))
        assert int(cache.tags[0, line]) == s + 1


def test_epochs_and_wrap_reset():
    cache = rc.QSARowCache(torch.zeros(2, 8, 2, 32, dtype=torch.bfloat16), epoch_limit=4)
    cache.tags[0] = 3
    cache.hitmarks[0] = 2
    cache.claims[0] = 5
    cache.tags[1] = 3
    empty = torch.empty(0, dtype=torch.int64)
    cache.invalidate(0, empty)
    cache.invalidate(0, empty)
    assert cache.epochs.tolist() == [3, 1] and int(cache.tags[0, 0]) == 3
    cache.invalidate(0, empty)  # 3 + 1 reaches the limit: reset, restart at 1
    assert cache.epochs.tolist() == [1, 1]
    assert (cache.tags[0] == -1).all() and (cache.hitmarks[0] == 0).all()
    assert (cache.claims[0] == 0).all()
    assert (cache.tags[1] == 3).all()  # other layers untouched


H_KV, GROUP, D, BS = 2, 2, 16, 8


def _case(seed, rows=3, num_blocks=6, topk=24, width=3):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_blocks, BS, H_KV, 2 * D, generator=g).to(torch.bfloat16)
    kv_cache = kv.transpose(1, 2)
    q = torch.randn(rows, H_KV * GROUP, D, generator=g).to(torch.bfloat16)
    gate = torch.randn(rows, H_KV * GROUP, D, generator=g).to(torch.bfloat16)
    table = torch.randperm(num_blocks, generator=g)[: 2 * width].view(2, width).to(torch.int32)
    tok2req = torch.randint(0, 2, (rows,), generator=g).to(torch.int32)
    idx = torch.randint(0, width * BS, (rows, topk), generator=g).to(torch.int32)
    packed = torch.cat([idx, torch.full((rows, 1), topk, dtype=torch.int32)], 1)
    return kv_cache, q, gate, packed, table, tok2req


def _forward(layer, kv_cache, q, gate, table, tok2req, prefill=False):
    impl = SimpleNamespace(alibi_slopes=None, sinks=None, sliding_window=(-1, -1), head_size=D)
    meta = SimpleNamespace(num_actual_tokens=q.shape[0], block_table=table)
    out = torch.empty_like(q)
    Qwen4ExpQSAFlashAttentionImpl.forward_qsa(
        impl, layer, q, None, None, kv_cache, meta, out, token_to_req=tok2req,
        use_prefill_config=prefill, output_gate=gate.contiguous())
    return out


@pytest.mark.parametrize("gate_on", [False, True])
def test_forward_qsa_hook(monkeypatch, gate_on):
    monkeypatch.setenv("VLLM_QSA_ROW_CACHE", "1" if gate_on else "0")
    kv_cache, q, gate, packed, table, tok2req = _case(2)
    k, v = kv_cache.transpose(1, 2).split(D, dim=-1)
    ref = torch.zeros_like(q)
    qsa_sparse_paged_attention(q, k, v, packed, table, tok2req, False, ref,
                               output_gate=gate.contiguous())
    # stand-in for 0220's arena (token rows), its row cache made at bind
    # time for the rank's 2 QSA layers only when the gate is on
    arena = SimpleNamespace(token_rows=torch.zeros(2 * BS, H_KV, 2 * D, dtype=torch.bfloat16))
    if gate_on:
        rc.attach(arena, 2)
    layer = SimpleNamespace(topk_indices_buffer=packed, qsa_staging_arena=arena,
                            layer_name="l0")
    for step in range(2):
        out = _forward(layer, kv_cache, q, gate, table, tok2req)
        assert torch.equal(out, ref)
        cache = getattr(arena, "row_cache", None)
        assert (cache is not None) == gate_on
        if gate_on:
            assert int((cache.tags[0] >= 0).sum()) > 0  # rows were cached
            if step == 1:
                assert int(cache.stats[0, 0]) == 0  # (count_hits off)
    if gate_on:
        cache.count_hits = True
        # no invalidate ran, so the same epoch: bump it like a store would
        cache.invalidate(0, torch.empty(0, dtype=torch.int64))
        assert torch.equal(_forward(layer, kv_cache, q, gate, table, tok2req), ref)
        assert int(cache.stats[0, 0]) > 0  # served from VRAM
        # a prefill-config batch takes the caller's path: no cached attention
        tags = cache.tags.clone()
        _forward(layer, kv_cache, q, gate, table, tok2req, prefill=True)
        assert torch.equal(cache.tags, tags)
        # an arena writer drops every tag of every layer
        cache.tags[1] = 5
        rc.arena_overwritten(arena)
        assert (cache.tags == -1).all()


def test_forward_qsa_large_batch_takes_upstream(monkeypatch):
    monkeypatch.setenv("VLLM_QSA_ROW_CACHE", "1")
    kv_cache, q, gate, packed, table, tok2req = _case(3, rows=rc.ROW_CACHE_MAX_ROWS + 1, topk=8)
    k, v = kv_cache.transpose(1, 2).split(D, dim=-1)
    ref = torch.zeros_like(q)
    qsa_sparse_paged_attention(q, k, v, packed, table, tok2req, False, ref,
                               output_gate=gate.contiguous())
    arena = SimpleNamespace(token_rows=torch.zeros(BS, H_KV, 2 * D, dtype=torch.bfloat16))
    rc.attach(arena, 1)
    layer = SimpleNamespace(topk_indices_buffer=packed, qsa_staging_arena=arena)
    assert torch.equal(_forward(layer, kv_cache, q, gate, table, tok2req), ref)
    assert (arena.row_cache.tags == -1).all()  # the cache never ran
    # one QSA layer on the rank: a second layer gets no cache
    cache, idx = rc._cache_of(layer, kv_cache)
    assert cache is arena.row_cache and idx == 0
    other = SimpleNamespace(topk_indices_buffer=packed[:3], qsa_staging_arena=arena)
    assert rc._cache_of(other, kv_cache) == (None, -1)


def test_no_arena_no_cache(monkeypatch):
    # K/V in VRAM (no 0220 arena): the hooks do nothing
    monkeypatch.setenv("VLLM_QSA_ROW_CACHE", "1")
    kv_cache, *_ = _case(4)
    layer = SimpleNamespace()
    rc.invalidate(layer, kv_cache, torch.zeros(3, dtype=torch.int64))
    assert rc._cache_of(layer, kv_cache) == (None, -1)


def test_run_qsa_invalidates_after_store():
    # the hook sits right after the K/V store in _run_qsa
    import inspect

    from vllm.models.qwen4_exp.nvidia.qsa import Qwen4ExpQSAAttention

    src = inspect.getsource(Qwen4ExpQSAAttention._run_qsa)
    store = src.index("impl.do_kv_cache_update(")
    inval = src.index("qsa_row_cache.invalidate(")
    attn = src.index("impl.forward_qsa(")
    assert store < inval < attn


def test_with_0220_staged_prefill(monkeypatch):
    """With 0220's arena: decode (cached) -> staged prefill (overwrites the
    arena) -> decode: every output equals the uncached path; the staging
    warmup drops the tags too."""
    qhk = pytest.importorskip("vllm.models.qwen4_exp.nvidia.qsa_host_kv")
    monkeypatch.setenv("VLLM_QSA_ROW_CACHE", "1")
    monkeypatch.setenv("VLLM_QSA_KV_OFFLOAD", "1")
    kv_cache, q, gate, packed, table, tok2req = _case(5, rows=4, topk=32)
    tok2req.zero_()  # one request: its 3 pages (24 rows) fit the arena
    k, v = kv_cache.transpose(1, 2).split(D, dim=-1)
    arena = qhk.QSAStagingArena(3, BS, H_KV, D, "cpu")
    rc.attach(arena, 2)  # as bind_host_kv_layers does for 2 QSA layers
    layer = SimpleNamespace(topk_indices_buffer=packed, qsa_staging_arena=arena,
                            layer_name="l0")

    def ref(prefill):
        out = torch.zeros_like(q)
        qsa_sparse_paged_attention(q, k, v, packed, table, tok2req, prefill, out,
                                   output_gate=gate.contiguous())
        return out

    assert torch.equal(_forward(layer, kv_cache, q, gate, table, tok2req), ref(False))
    cache = arena.row_cache
    filled = int((cache.tags >= 0).sum())
    assert filled > 0
    before = arena.buffer.clone()
    assert torch.equal(_forward(layer, kv_cache, q, gate, table, tok2req, prefill=True), ref(True))
    assert not torch.equal(arena.buffer, before)  # staging overwrote cached rows
    assert (cache.tags == -1).all()
    cache.invalidate(0, torch.empty(0, dtype=torch.int64))  # next step's store
    assert torch.equal(_forward(layer, kv_cache, q, gate, table, tok2req), ref(False))
    assert int((cache.tags >= 0).sum()) == filled
    qhk.warmup_staging(kv_cache, arena)
    assert (cache.tags == -1).all()
    monkeypatch.setenv("VLLM_QSA_ROW_CACHE", "0")  # gate off: the hook does nothing
    cache.tags[0, 0] = 3
    qhk.warmup_staging(kv_cache, arena)
    assert int(cache.tags[0, 0]) == 3


@pytest.mark.parametrize("arena_blocks,block,layers,lines", [
    (4, 48, 4, 48),    # 4 x 12,144: one arena block per layer
    (5, 40, 4, 50),    # MTP ranks 0/1: 5 x 9,776 rows over 4 layers -> 12,220
    (5, 40, 5, 40),    # MTP last rank: 5 layers x 9,776
    (5, 41, 4, 50),    # odd quotient (51.25 -> 51) rounds down to even
])
def test_bind_allocates_whole_arena_cache(monkeypatch, arena_blocks, block, layers, lines):
    # 0220's bind makes the row cache at startup over the whole arena: lines
    # from the arena's rows / the rank's QSA layers (not the block size), the
    # state in one allocation of row_cache_state_bytes, every per-layer
    # slice 16-byte aligned (one kernel variant for every layer)
    qhk = pytest.importorskip("vllm.models.qwen4_exp.nvidia.qsa_host_kv")
    from vllm.models.qwen4_exp.common import qsa_capacity as qc

    monkeypatch.setenv("VLLM_QSA_ROW_CACHE", "1")
    monkeypatch.setattr(qhk, "allocate_host_kv_backing",
                        lambda n, *, what: torch.zeros(n, dtype=torch.uint8))
    monkeypatch.setattr(qhk, "_HOST_RANGES", [])
    geo = [SimpleNamespace(num_kv_heads=H_KV, head_dim=D) for _ in range(layers)]
    arena = qhk.bind_host_kv_layers(geo, num_blocks=2, block_size=block,
                                    arena_layers=arena_blocks, device="cpu",
                                    to_device_view=lambda t: t)
    cache = arena.row_cache
    assert cache.num_layers == layers and cache.num_lines == lines
    assert lines == rc.row_cache_lines(arena.rows, layers) == qc.row_cache_lines(arena.rows, layers)
    assert cache.rows.data_ptr() == arena.buffer.data_ptr()
    assert cache.rows.shape == (layers, lines, H_KV, 2 * D)
    assert arena.rows - layers * lines < 2 * layers  # the whole arena, bar rounding
    assert qc.alloc_bytes(cache.state_bytes) == qc.row_cache_state_bytes(arena.rows, layers)
    for t in (cache.tags, cache.hitmarks, cache.claims, cache.stats, cache.rows):
        assert all(t[i].data_ptr() % 16 == 0 for i in range(layers))
    assert all(cache.epochs[i:].data_ptr() % 16 == 0 for i in range(layers))
    assert (cache.tags == -1).all() and (cache.hitmarks == 0).all()
    assert (cache.claims == 0).all() and (cache.stats == 0).all()
    assert cache.epochs.tolist() == [1] * layers
    monkeypatch.setenv("VLLM_QSA_ROW_CACHE", "0")
    arena = qhk.bind_host_kv_layers(geo, num_blocks=2, block_size=block,
                                    arena_layers=arena_blocks, device="cpu",
                                    to_device_view=lambda t: t)
    assert getattr(arena, "row_cache", None) is None  # gate off: nothing allocated


def test_row_cache_state_bytes_production():
    from vllm.models.qwen4_exp.common import qsa_capacity as qc

    assert qc.row_cache_lines(4 * 12_144, 4) == 12_144
    assert qc.row_cache_lines(5 * 9_776, 4) == 12_220
    assert qc.row_cache_lines(5 * 9_776, 5) == 9_776
    assert qc.row_cache_state_bytes(4 * 12_144, 4) == 1_166_336
    assert qc.row_cache_state_bytes(5 * 9_776, 4) == qc.row_cache_state_bytes(5 * 9_776, 5)


def test_variant_keys_one_per_kernel():
    # decode batches of 1..12 rows x 2 KV heads: one config, so each kernel
    # has one variant (64 splits of 32-column tiles over 2,051 columns)
    keys = rc.row_cache_variant_keys(2051, 2)
    assert {k: len(v) for k, v in keys.items()} == {
        "_qsa_row_cache_invalidate_kernel": 1, "_qsa_row_cache_plan_kernel": 1,
        "_qsa_row_cache_splitk_kernel": 1, "_qsa_merge_splitk_kernel": 1}
    assert keys["_qsa_row_cache_splitk_kernel"] == {(32, 65, 64, 4)}
