"""mem-01 (VLLM_PP_MISSING_LAYERS): which modules each PP rank builds.

Real parallel state: one spawned process per rank, gloo, vLLM's
init_distributed_environment + initialize_model_parallel (mem_pp_worker.py).
"""

import pytest
import torch.multiprocessing as mp

import mem_pp_worker as w
from pp_ranks import run_ranks
from vllm.models.qwen4_exp.nvidia.pp_missing_layers import pp_keeps

EMB, LM = "model.embed_tokens.weight", "lm_head.weight"


def _run(world, gate):
    return run_ranks(mp.get_context("spawn"), w.run_rank, world, gate)


def _expect(rank, world, gate):
    first, last = rank == 0, rank == world - 1
    on = gate == "1"
    emb = "VocabParallelEmbedding" if (first or not on) else "PPMissingLayer"
    lm = "ParallelLMHead" if (last or not on) else "PPMissingLayer"
    vis = "TinyViT" if (first or not on) else "StageMissingLayer"
    loaded = sorted(
        ([EMB] if emb != "PPMissingLayer" else []) + ([LM] if lm != "PPMissingLayer" else [])
    )
    return {
        "causal.embed_tokens": emb,
        "causal.lm_head": lm,
        "causal.loaded": loaded,
        "vl.visual": vis,
        "vl.lm.embed_tokens": emb,
        "vl.lm.lm_head": lm,
    }


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("gate", ["1", "0"])
def test_modules_built_per_rank(world, gate):
    res = _run(world, gate)
    # The default 6-layer split over the ranks (real make_layers).
    spans = [res[r]["causal.layers"] for r in range(world)]
    assert spans == ([[0, 6]] if world == 1 else [[0, 2], [2, 4], [4, 6]])
    for r in range(world):
        got = {k: res[r][k] for k in _expect(r, world, gate)}
        assert got == _expect(r, world, gate), f"rank {r}"
    if world == 3 and gate == "1":
        # Rank 1 (middle) builds neither; its checkpoint embed/lm_head weights
        # are dropped by AutoWeightsLoader rather than failing the load.
        assert res[1]["causal.loaded"] == []


def test_pp_keeps_logic():
    kw = dict(enabled=True)
    assert pp_keeps("embed_tokens", is_first_rank=True, is_last_rank=False, **kw)
    assert not pp_keeps("embed_tokens", is_first_rank=False, is_last_rank=True, **kw)
    # Tied head or an eagle-style drafter needs the embed on the last rank.
    assert pp_keeps(
        "embed_tokens", is_first_rank=False, is_last_rank=True,
        tie_word_embeddings=True, **kw,
    )
    assert pp_keeps(
        "embed_tokens", is_first_rank=False, is_last_rank=False,
        needs_target_embed=True, **kw,
    )
    assert pp_keeps("lm_head", is_first_rank=False, is_last_rank=True, **kw)
    assert not pp_keeps("lm_head", is_first_rank=True, is_last_rank=False, **kw)
    assert not pp_keeps("visual", is_first_rank=False, is_last_rank=True, **kw)
    for part in ("embed_tokens", "lm_head", "visual"):
        assert pp_keeps(part, is_first_rank=False, is_last_rank=False, enabled=False)
    with pytest.raises(ValueError):
        pp_keeps("norm", is_first_rank=True, is_last_rank=True, **kw)


def test_pp_keeps_reads_gate(monkeypatch):
    monkeypatch.setenv("VLLM_PP_MISSING_LAYERS", "0")
    assert pp_keeps("lm_head", is_first_rank=True, is_last_rank=False)
    monkeypatch.setenv("VLLM_PP_MISSING_LAYERS", "1")
    assert not pp_keeps("lm_head", is_first_rank=True, is_last_rank=False)
