"""0220-qsa-kv-offload: the startup warmup also compiles the sparse
attention variants of the VRAM staging arena and the staging gather, so no
QSA kernel compiles and loads mid-serving; gate off (or VRAM K/V) warms
exactly what upstream warms."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

qhk = pytest.importorskip("vllm.models.qwen4_exp.nvidia.qsa_host_kv")
import vllm.models.qwen4_exp.nvidia.model  # noqa: E402,F401  (import order as in serving)
from vllm.model_executor.warmup import qwen4_exp_qsa_warmup as w  # noqa: E402
from vllm.models.qwen4_exp.nvidia import indexer_qsa, qsa  # noqa: E402
from vllm.models.qwen4_exp.nvidia.ops import qsa as qsa_ops  # noqa: E402
from vllm.models.qwen4_exp.nvidia.ops import qsa_indexer  # noqa: E402

H_KV, D, BS, NB = 2, 16, 16, 5


def _worker(kv_cache):
    indexer = indexer_qsa.QSAIndexer.__new__(indexer_qsa.QSAIndexer)
    nn.Module.__init__(indexer)
    indexer.compressed_key_cache = SimpleNamespace(kv_cache=torch.zeros(4, 1, 4, 8),
                                                   prefix="l3.indexer.compressed_key_cache")
    indexer.index_n_heads, indexer.index_head_dim = 4, 8
    indexer.token_topk, indexer.compress_ratio = 17, 4  # output_width 20
    owner = qsa.Qwen4ExpQSAAttention.__new__(qsa.Qwen4ExpQSAAttention)
    nn.Module.__init__(owner)
    owner.kv_cache, owner.layer_name, owner.num_heads = kv_cache, "l3.self_attn.attn", 4
    groups = [SimpleNamespace(layer_names=["l3.indexer.compressed_key_cache", "l3.self_attn.attn"])]
    table = torch.zeros(2, 3, dtype=torch.int32)
    runner = SimpleNamespace(kv_cache_config=SimpleNamespace(kv_cache_groups=groups),
                             block_tables=SimpleNamespace(input_block_tables=[table]),
                             decode_query_len=1, max_num_reqs=2, max_num_tokens=32)
    return SimpleNamespace(get_model=lambda: SimpleNamespace(modules=lambda: [indexer, owner]),
                           model_runner=runner, use_v2_model_runner=True), table


@pytest.mark.parametrize("gate_on,host", [(False, True), (True, False), (True, True)])
def test_warmup_covers_arena(monkeypatch, gate_on, host):
    monkeypatch.setenv("VLLM_QSA_KV_OFFLOAD", "1" if gate_on else "0")
    kv = torch.randn(NB, BS, H_KV, 2 * D).to(torch.bfloat16)
    kv_cache = kv.transpose(1, 2)
    arena = qhk.QSAStagingArena(2, BS, H_KV, D, "cpu")
    arena.buffer.fill_(0)
    if host:
        monkeypatch.setattr(qhk, "_HOST_RANGES", [(kv.data_ptr(), kv.data_ptr() + kv.nbytes)])
        monkeypatch.setattr(qhk, "_ARENAS", {"cpu": arena})
    warmed = []
    monkeypatch.setattr(qsa_indexer, "warmup_qsa_mqa_paged_decode", lambda *a, **kw: ())
    monkeypatch.setattr(qsa_ops, "warmup_qsa_sparse_paged_attention",
                        lambda view, table, **kw: warmed.append((view.data_ptr(), table)) or ())
    staged_calls = []
    real_stage = qhk.stage_selected_rows

    def stage_spy(kv, idx, tbl, t2r, *a, **kw):
        staged_calls.append((tuple(idx.shape), tuple(tbl.shape)))
        return real_stage(kv, idx, tbl, t2r, *a, **kw)

    monkeypatch.setattr(qhk, "stage_selected_rows", stage_spy)
    worker, table = _worker(kv_cache)
    w.qwen4_exp_qsa_triton_warmup(worker)
    if gate_on and host:
        # the worst case ran at startup: max_num_tokens rows of the full
        # selection width (+ count) against the runner's table shape, and
        # filled the whole arena with distinct rows (slots 0 .. 31, in order)
        assert staged_calls == [((32, 21), (2, 3))]
        assert torch.equal(arena.token_rows, kv[:2].flatten(0, 1))
    else:
        assert staged_calls == []
    want = [kv_cache.data_ptr()] + ([arena.buffer.data_ptr()] if gate_on and host else [])
    assert [p for p, _ in warmed] == want
    assert all(t is table for _, t in warmed)
