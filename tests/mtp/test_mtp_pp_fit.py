"""Patches 0630-mtp-pp (VLLM_MTP_PP) and 0640-mtp-fit (VLLM_MTP_FIT): the
Qwen4Exp MTP draft on the last rank of a real PP=3 parallel state (and PP=1),
every gate setting. See mtp_pp_worker.py for what is real and what is stubbed.
"""

import pytest
import torch
import torch.multiprocessing as mp

import mtp_pp_worker as w
from pp_ranks import run_ranks

CT_EMB = "CompressedTensorsEmbeddingWNA16Int"
CT_LIN = "CompressedTensorsLinearMethod"
ALIGN = 256


@pytest.fixture(scope="module")
def ctx():
    # Ranks forked from a fresh forkserver that has imported vllm once: a rank
    # then starts in seconds instead of a ~30 s import each on CI's 2 cores.
    # (Forking pytest itself hangs the ranks in libgomp once an earlier test
    # has run a threaded CPU matmul.) Preload by installed module name: the
    # 3.11 forkserver does not apply sys.path before preloading.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["vllm.models.qwen4_exp.nvidia.mtp"])
    return ctx


def _run(world, ctx):
    return run_ranks(ctx, w.run_rank, world)[world - 1]


@pytest.fixture(scope="module")
def pp3(ctx):
    return _run(3, ctx)


@pytest.fixture(scope="module")
def pp1(ctx):
    return _run(1, ctx)


def _aligned(n):
    return -(-n // ALIGN) * ALIGN


@pytest.mark.parametrize("fit", ["1", "0"])
@pytest.mark.parametrize("pp", ["1", "0"])
def test_pp3_last_rank(pp3, pp, fit):
    r = pp3[f"pp{pp}_fit{fit}"]
    assert r["is_last"]
    pp_on, fit_on = pp == "1", fit == "1"

    # mtp-01: embed (and the draft's own lm_head) with the INT8 checkpoint
    # config; upstream: unquantized, so weight_packed/weight_scale cannot load.
    # ... and the draft's final HC mixer, as 0020 does for the target's.
    assert r["mixer_quant"] == [CT_LIN if pp_on else "UnquantizedLinearMethod"]
    if pp_on:
        assert r["embed_quant"] == CT_EMB
        assert r["embed_params"] == ["weight_packed", "weight_scale", "weight_shape"]
        int8 = ["model.embed_tokens." + n for n in r["embed_params"]]
        if not fit_on:
            int8 += ["lm_head." + n for n in r["embed_params"]]
        assert r["int8_load"] == sorted(int8)
        assert r["int8_embed_equal"]
    else:
        assert r["embed_quant"] == "UnquantizedEmbeddingMethod"
        assert r["embed_params"] == ["weight"]
        # Upstream: the checkpoint's INT8 embed does not load.
        assert r["int8_load"] == (
            "There is no module or parameter named 'embed_tokens.weight_packed'")

    # mtp-01: the speculator's call (hidden state, no intermediate tensors)
    # takes the embedding branch on the last rank; upstream asserts.
    if pp_on:
        assert r["forward"] == "ok", r
        assert r["layer_call"] == {"hidden": (3, w.HC * w.HIDDEN),
                                   "prev_block_output": (3, w.HIDDEN)}
        assert r["forward_out"] == [(3, w.HIDDEN), (3, w.HC * w.HIDDEN)]
        assert r["embeds_match"]  # rows read from where the embed now lives
    else:
        assert r["forward"] == "AssertionError"
        assert r["forward_assert"] == "assert intermediate_tensors is not None"

    # mtp-02: lm_head placeholder from the start; upstream builds the copy
    # (INT8 with mtp-01, bf16 without).
    if fit_on:
        assert r["lm_head"] == r["lm_head_unquant"] == "PPMissingLayer"
        assert not r["lm_head_loaded"]  # lm_head.* dropped by AutoWeightsLoader
        assert r["logits_unreplaced"] == "RuntimeError"
    else:
        assert r["lm_head"] == r["lm_head_unquant"] == "ParallelLMHead"
        assert r["lm_head_quant"] == (CT_LIN if pp_on else "UnquantizedEmbeddingMethod")
        assert r["lm_head_loaded"]
    assert r["ckpt_has_lm_head"]
    # eagle/utils.py load_eagle_model: the target's head in both settings; at
    # PP>1 the draft keeps its own embed (the target's is on rank 0).
    assert r["eagle_lm_head_is_target"]
    assert r["eagle_logits"] == (2, w.VOCAB)
    assert r["eagle_embed"] == "own"
    # Every draft parameter that exists is loaded, in all settings.
    assert r["loaded_all_params"], r["missing"]
    assert r["embed_equal"]

    # mtp-02: at PP>1 the embed is built on the CPU (not under the loader's
    # device), then moved into one exact-size pinned pool and viewed via UVA.
    assert r["fc_built_on"] == ["meta"]
    if fit_on:
        assert r["embed_built_on"] == ["cpu"]
        assert r["embed_uva_flag"] and r["embed_in_pool"]
        assert r["pools"] == r["pinned_calls"] == [_aligned(r["embed_nbytes"])]
        assert r["uva_calls"] == 1 and r["uva_view_of"] == [0]
        assert r["pools_after_hook"] == 1  # the post-load hook did not re-pin
    else:
        assert r["embed_built_on"] == ["meta"]
        assert not r["embed_uva_flag"]
        assert r["pools"] == [] and r["uva_calls"] == 0


@pytest.mark.parametrize("fit", ["1", "0"])
@pytest.mark.parametrize("pp", ["1", "0"])
def test_pp1(pp1, pp, fit):
    """PP=1: the first rank is the last; the forward works either way, and the
    embed stays where the loader builds it (the target's replaces it)."""
    r = pp1[f"pp{pp}_fit{fit}"]
    assert r["forward"] == "ok", r
    assert r["embed_quant"] == (CT_EMB if pp == "1" else "UnquantizedEmbeddingMethod")
    assert r["embed_built_on"] == ["meta"] and r["pools"] == [] and not r["embed_uva_flag"]
    assert r["lm_head"] == ("PPMissingLayer" if fit == "1" else "ParallelLMHead")
    assert r["loaded_all_params"], r["missing"]
    assert r["eagle_lm_head_is_target"] and r["eagle_embed"] == "target"
    assert r["eagle_logits"] == (2, w.VOCAB)


def test_move_to_pinned_uva_int8_embed(monkeypatch, tmp_path):
    """The INT8 embed's gather reads identical rows from the pinned copy;
    parameters are packed at 256-byte offsets into one buffer of exactly
    their aligned size (0210's pool; torch pin_memory would round up)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
    )
    from vllm.models.qwen4_exp.nvidia import mtp_fit
    from vllm.v1.worker import pinned_host_pool as php

    import vllm.model_executor.layers.vocab_parallel_embedding as vpe
    import vllm.model_executor.parameter as vparam

    # Single rank without a process group (as tests/hc).
    for mod in (vpe, vparam):
        monkeypatch.setattr(mod, "get_tensor_model_parallel_world_size", lambda: 1)
        monkeypatch.setattr(mod, "get_tensor_model_parallel_rank", lambda: 0)
    kw = dict(php.allocate_pinned_host_pool.__kwdefaults__)
    monkeypatch.setattr(php.allocate_pinned_host_pool, "__kwdefaults__",
                        {**kw, "pin": lambda t: None, "unpin": None,
                         "lock_path": str(tmp_path / "lock")})
    views = []
    monkeypatch.setattr(mtp_fit, "get_accelerator_view_from_cpu_tensor",
                        lambda t: views.append(t) or t)
    monkeypatch.setenv("VLLM_PINNED_POOL", "1")

    emb = VocabParallelEmbedding(w.VOCAB, w.HIDDEN, quant_config=w._ct_config(),
                                 prefix="mtp.embed_tokens")
    g = torch.Generator().manual_seed(1)
    emb.weight_packed.data.copy_(torch.randint(-2**31, 2**31 - 1, emb.weight_packed.shape,
                                               generator=g, dtype=torch.int64).to(torch.int32))
    emb.weight_scale.data.copy_(torch.rand(emb.weight_scale.shape, generator=g))
    ids = torch.tensor([0, 3, 255, 3])
    before = emb(ids)
    sizes = {n: p.nbytes for n, p in emb.named_parameters()}
    n = len(php._LIVE_POOLS)
    total = mtp_fit.move_to_pinned_uva(emb, what="test embed")
    pool = php._LIVE_POOLS[n]
    assert total == pool.nbytes == sum(_aligned(s) for s in sizes.values())
    assert total < 2 * max(sizes.values())  # not a power-of-two rounding
    base = pool.tensor.data_ptr()
    assert [v.data_ptr() - base for v in views] == [0, _aligned(sizes["weight_packed"]),
                                                     _aligned(sizes["weight_packed"])
                                                     + _aligned(sizes["weight_scale"])]
    assert all(p._vllm_is_uva_offloaded for p in emb.parameters())
    assert torch.equal(emb(ids), before)
    assert mtp_fit.move_to_pinned_uva(emb, what="again") == 0  # idempotent
    pool.release()


def test_gate_reading(monkeypatch):
    from vllm.models.qwen4_exp.nvidia.mtp_fit import draft_embed_on_host

    monkeypatch.setenv("VLLM_MTP_FIT", "1")
    assert draft_embed_on_host(3) and not draft_embed_on_host(1)
    monkeypatch.setenv("VLLM_MTP_FIT", "0")
    assert not draft_embed_on_host(3)


def test_pp1_says_which_half_applies(monkeypatch):
    """At PP=1 the gate reads "on" but the embed stays on the GPU: one line
    says so (only the lm_head copy is skipped)."""
    import vllm.models.qwen4_exp.nvidia.mtp_fit as mf

    monkeypatch.setenv("VLLM_MTP_FIT", "1")
    said = []
    monkeypatch.setattr(mf.logger, "info_once", lambda msg, *a, **k: said.append(msg % a))
    assert not mf.draft_embed_on_host(1)
    assert len(said) == 1 and "PP=1" in said[0] and "lm_head" in said[0]
    said.clear()
    assert mf.draft_embed_on_host(3) and not said


@pytest.mark.parametrize("on", [True, False])
def test_draft_ct_names_remapped(monkeypatch, on):
    """mtp-01: the checkpoint's compressed-tensors config names MTP modules
    mtp.layers.0.*; the draft builds mtp.layers.<num_hidden_layers>.*. With the
    gate the draft config's ignore list and targets (make_mtp_int4.py's INT4
    g128 expert group is a regex) follow; upstream they miss and the experts
    take the generic "Linear" group."""
    import types

    import make_mtp_int4 as tool
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E501
        CompressedTensorsConfig,
    )
    from vllm.models.qwen4_exp.nvidia import mtp

    experts = [f"mtp.layers.0.mlp.experts.{e}.{p}.weight"
               for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    int4_g32 = {"num_bits": 4, "type": "int", "symmetric": True,
                "strategy": "group", "group_size": 32}
    ckpt_cfg = {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": int4_g32}},
        "ignore": ["lm_head", "mtp.layers.0.self_attn.o_proj"]
        + [n.removesuffix(".weight") for n in experts]}}
    qc = CompressedTensorsConfig.from_config(
        tool.build_config(ckpt_cfg, experts, 128)["quantization_config"])
    monkeypatch.setenv("VLLM_MTP_PP", "1" if on else "0")
    monkeypatch.setattr(mtp, "get_draft_quant_config", lambda cfg: qc)
    monkeypatch.setattr(mtp, "replace",
                        lambda cfg, **kw: types.SimpleNamespace(**{**vars(cfg), **kw}))
    cfg = types.SimpleNamespace(speculative_config=types.SimpleNamespace(
        draft_model_config=object()))
    draft_qc = mtp._make_draft_vllm_config(cfg, 48).quant_config
    assert draft_qc is qc

    def scheme(name):
        d = qc.get_scheme_dict(torch.nn.Linear(1, 1), name)
        return None if d is None else (d["weights"].num_bits, d["weights"].group_size)

    L = 48
    if on:
        for p in ("gate_proj", "up_proj", "down_proj"):  # as get_moe_method asks
            assert scheme(f"mtp.layers.{L}.mlp.experts.0.{p}") == (4, 128)
        assert scheme(f"mtp.layers.{L}.self_attn.o_proj") is None  # ignored
    else:
        assert scheme(f"mtp.layers.{L}.mlp.experts.0.gate_proj") == (4, 32)
        assert scheme(f"mtp.layers.{L}.self_attn.o_proj") == (4, 32)
    assert scheme("model.layers.3.mlp.experts.0.gate_proj") == (4, 32)  # target untouched
    assert scheme("lm_head") is None
