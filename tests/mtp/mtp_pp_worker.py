"""Worker for test_mtp_pp_fit.py: one process per PP rank (gloo).

Every rank sets up vLLM's parallel state for real (init_distributed_environment
+ initialize_model_parallel over gloo, as mem_pp_worker.py); the last rank,
the only one that builds the MTP draft in vLLM (model_runner builds the
speculator there), builds Qwen4ExpMTP from a tiny config once per gate
setting. Stand-ins: the decoder layer (a recorder: the question is what the
draft feeds it, not what a layer computes), the low-latency GEMM pass, the
final HC mixer's combine_and_mix (a CUDA op), and for mtp-02 only the two
steps that need a GPU: cudaHostRegister inside 0210's pool and the UVA view.
The embedding, lm_head, fc_*, norms, quant dispatch, the draft quant-config
remap, the loaders and the pinned pool's exact-size mmap are the real code.
"""

import os
import tempfile
import traceback
import types

from pp_ranks import report

HIDDEN, VOCAB, HC, N_MAIN = 64, 256, 2, 6
GATES = [("1", "1"), ("1", "0"), ("0", "1"), ("0", "0")]  # (MTP_PP, MTP_FIT)


def run_rank(rank, world, port, q, vllm_cfg=None):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    report(rank, q, build_all, rank, world, port, vllm_cfg)


def _text_config():
    from vllm.models.qwen4_exp.config import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=N_MAIN,
        hc_count=HC,
        hc_lowrank=8,
        layer_types=["linear_attention"] * N_MAIN,
        tie_word_embeddings=False,
    )


def _ct_config():
    """The checkpoint's shape of quant config: INT8 channel for embed /
    lm_head (and HC), INT4 group for every other Linear."""
    from vllm.model_executor.layers.quantization.compressed_tensors import (
        compressed_tensors as ct,
    )

    int8 = {"num_bits": 8, "type": "int", "symmetric": True,
            "strategy": "channel", "group_size": None, "dynamic": False}
    int4 = {"num_bits": 4, "type": "int", "symmetric": True,
            "strategy": "group", "group_size": 16, "dynamic": False}
    return ct.CompressedTensorsConfig.from_config({
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "g8": {"targets": ["re:.*hyper_connection.*", "re:.*embed_tokens$",
                               "re:.*lm_head$"],
                   "weights": int8, "format": "pack-quantized"},
            "g4": {"targets": ["Linear"], "weights": int4,
                   "format": "pack-quantized"},
        },
        "ignore": [],
    })


def _install_stubs(mtp, torch, nn, calls):
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_wNa16 as w16,
    )
    from vllm.models.qwen4_exp.nvidia import mtp_fit
    from vllm.v1.worker import pinned_host_pool as php

    class TinyLayer(nn.Module):
        """Records what the draft passes to its decoder layer."""

        def __init__(self, *a, **k):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2))
            self.mlp = nn.Identity()  # not a MoE block

        def forward(self, hidden_states, prev_block_output, **kw):
            calls["layer"] = {
                "hidden": tuple(hidden_states.shape),
                "prev_block_output": None if prev_block_output is None
                else tuple(prev_block_output.shape),
            }
            return hidden_states, prev_block_output, None

    mtp.Qwen4ExpDecoderLayer = TinyLayer
    mtp.enable_qwen4_exp_low_latency_gemm = lambda *a, **k: None
    # No WNA16 GEMM kernel on the CPU (as tests/hc): parameter creation and
    # scheme matching stay real.
    w16.choose_mp_linear_kernel = lambda c: type("K", (), {"__init__": lambda s, *a, **k: None})
    # draft config: the real _make_draft_vllm_config, with the quant config
    # it would resolve from the checkpoint and a namespace-friendly replace.
    mtp.get_draft_quant_config = lambda cfg: cfg._draft_qc
    mtp.replace = lambda cfg, **kw: types.SimpleNamespace(**{**vars(cfg), **kw})
    # 0210's pool without cudaHostRegister (no GPU); mmap, sizes are real.
    kw = php.allocate_pinned_host_pool.__kwdefaults__
    kw["pin"] = lambda t: calls.setdefault("pinned", []).append(t.nbytes)
    kw["unpin"] = None
    kw["lock_path"] = os.path.join(tempfile.mkdtemp(), "pool.lock")

    def fake_uva_view(host):
        calls.setdefault("uva", []).append((host.data_ptr(), host.nbytes))
        return host  # stands in for the CUDA view of the same memory

    mtp_fit.get_accelerator_view_from_cpu_tensor = fake_uva_view


def _cfg(vllm_cfg, qc, torch):
    text = _text_config()
    model_config = types.SimpleNamespace(
        hf_text_config=text, hf_config=text, dtype=torch.bfloat16
    )
    spec = types.SimpleNamespace(
        draft_model_config=model_config, method="mtp", moe_backend=None,
        kv_cache_dtype=None, attention_backend=None,
    )
    # The real VllmConfig's sub-configs (what layers read from the current
    # config), with the model/speculative/quant parts of the tiny draft.
    import dataclasses

    base = {f.name: getattr(vllm_cfg, f.name) for f in dataclasses.fields(vllm_cfg)}
    cfg = types.SimpleNamespace(**{
        **base,
        "model_config": model_config,
        "quant_config": qc,
        "speculative_config": spec,
        "cache_config": types.SimpleNamespace(mamba_cache_mode="align"),
        "scheduler_config": types.SimpleNamespace(max_num_batched_tokens=16),
    })
    cfg._draft_qc = qc
    return cfg


def _checkpoint(model, torch):
    """Checkpoint names for every draft parameter as the HF file has them
    (inverse of mtp._remap_mtp_weight_name), plus the target's lm_head."""
    g = torch.Generator().manual_seed(0)
    ckpt = {}
    for name, p in model.named_parameters():
        if name.startswith("model.embed_tokens."):
            ck = "model.language_model." + name.removeprefix("model.")
        elif name.startswith("model."):
            ck = "mtp." + name.removeprefix("model.")
        else:
            ck = name
        ckpt[ck] = torch.randn(p.shape, generator=g).to(p.dtype)
    ckpt["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16)
    return ckpt


def _one(mtp, cfg, torch, calls, gate_pp, gate_fit, is_last):
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
    )
    from vllm.model_executor.models.utils import PPMissingLayer
    from vllm.v1.worker import pinned_host_pool as php

    os.environ["VLLM_MTP_PP"] = gate_pp
    os.environ["VLLM_MTP_FIT"] = gate_fit
    out = {}

    # (1) quant dispatch with the checkpoint-shaped config.
    qm = mtp.Qwen4ExpMTP(vllm_config=_cfg(cfg, _ct_config(), torch), prefix="")
    out["embed_quant"] = type(qm.model.embed_tokens.quant_method).__name__
    out["embed_params"] = sorted(n for n, _ in qm.model.embed_tokens.named_parameters())
    out["lm_head"] = type(qm.lm_head).__name__
    out["lm_head_quant"] = type(getattr(qm.lm_head, "quant_method", None)).__name__
    out["mixer_quant"] = sorted({
        type(mod.quant_method).__name__
        for mod in qm.model.hyper_connection_mixer.modules()
        if hasattr(mod, "quant_method")
    })
    # The checkpoint's INT8 embed and lm_head tensors (pack-quantized).
    g = torch.Generator().manual_seed(1)
    int8 = {}
    for ck in ("model.language_model.embed_tokens", "lm_head"):
        int8[f"{ck}.weight_packed"] = torch.randint(
            -2**31, 2**31 - 1, (VOCAB, HIDDEN // 4), generator=g, dtype=torch.int64
        ).to(torch.int32)
        int8[f"{ck}.weight_scale"] = torch.rand(VOCAB, 1, generator=g).to(torch.bfloat16)
        int8[f"{ck}.weight_shape"] = torch.tensor([VOCAB, HIDDEN])
    try:
        out["int8_load"] = sorted(qm.load_weights(iter(int8.items())))
        out["int8_embed_equal"] = bool(torch.equal(
            qm.model.embed_tokens.weight_packed.data,
            int8["model.language_model.embed_tokens.weight_packed"]))
    except ValueError as e:
        out["int8_load"] = str(e).split(" in ")[0]
    del qm

    # (2) where the embed is built: the loader builds under a device context
    # (cuda there); meta here, so only host_build_context can yield "cpu".
    with torch.device("meta"):
        mm = mtp.Qwen4ExpMTP(vllm_config=_cfg(cfg, None, torch), prefix="")
    out["embed_built_on"] = sorted({p.device.type for p in mm.model.embed_tokens.parameters()})
    out["fc_built_on"] = sorted({p.device.type for p in mm.model.fc_hidden.parameters()})
    del mm

    # (3) load + forward, unquantized (the CPU runs bf16 linears).
    m = mtp.Qwen4ExpMTP(vllm_config=_cfg(cfg, None, torch), prefix="")
    out["lm_head_unquant"] = type(m.lm_head).__name__
    ckpt = _checkpoint(m, torch)
    out["ckpt_has_lm_head"] = "lm_head.weight" in ckpt
    calls.clear()
    pools_before = len(php._LIVE_POOLS)
    loaded = m.load_weights(iter(ckpt.items()))
    params = {n for n, _ in m.named_parameters()}
    out["loaded_all_params"] = loaded == params
    out["missing"] = sorted(params - loaded)
    out["lm_head_loaded"] = "lm_head.weight" in loaded
    emb = m.model.embed_tokens.weight
    out["embed_equal"] = bool(torch.equal(
        emb.data, ckpt["model.language_model.embed_tokens.weight"]))
    out["embed_uva_flag"] = bool(getattr(emb, "_vllm_is_uva_offloaded", False))
    new_pools = php._LIVE_POOLS[pools_before:]
    out["pools"] = [p.nbytes for p in new_pools]
    out["pinned_calls"] = calls.get("pinned", [])
    out["uva_calls"] = len(calls.get("uva", []))
    if new_pools:
        base = new_pools[-1].tensor.data_ptr()
        out["embed_in_pool"] = base <= emb.data_ptr() < base + new_pools[-1].nbytes
        out["uva_view_of"] = [ptr - base for ptr, _ in calls["uva"]]
    out["embed_nbytes"] = emb.nbytes
    # Second post-load pass (model-level hook) must not move it again.
    m.process_weights_after_loading()
    out["pools_after_hook"] = len(php._LIVE_POOLS) - pools_before

    # (4) the speculator's call: the main model's hidden state, no
    # intermediate tensors (speculator.py propose).
    T = 3
    ids = torch.tensor([1, 5, 7])
    pos = torch.arange(T)
    hidden = torch.randn(T, HC * HIDDEN).to(torch.bfloat16)
    m.model.hyper_connection_mixer.combine_and_mix = (
        lambda h, b, inj: (h, h[:, :HIDDEN], None)
    )
    calls.clear()
    try:
        res = m(ids, pos, hidden_states=hidden, intermediate_tensors=None)
        out["forward"] = "ok"
        out["forward_out"] = [tuple(t.shape) for t in res]
        out["layer_call"] = calls.get("layer")
        out["embeds_match"] = bool(torch.equal(
            m.model.embed_input_ids(ids), ckpt["model.language_model.embed_tokens.weight"][ids]))
    except AssertionError as e:
        out["forward"] = "AssertionError"
        out["forward_assert"] = traceback.extract_tb(e.__traceback__)[-1].line
    # compute_logits before load_eagle_model: the placeholder must not pass
    # hidden states through as logits.
    try:
        m.compute_logits(torch.zeros(1, HIDDEN, dtype=torch.bfloat16))
        out["logits_unreplaced"] = "ran"
    except RuntimeError as e:
        out["logits_unreplaced"] = "RuntimeError" if "not replaced" in str(e) else str(e)
    except Exception as e:  # noqa: BLE001
        out["logits_unreplaced"] = type(e).__name__

    # (5) the real load_eagle_model on the built draft (get_model returns it):
    # the target's lm_head replaces the draft's (placeholder or copy); the
    # embed is shared only at PP=1. The target as on this rank with 0600:
    # lm_head here, embed_tokens only if this is also the first rank.
    from vllm.distributed import get_pp_group
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
    )
    from vllm.v1.worker.gpu.spec_decode.eagle import utils as eagle_utils

    target = torch.nn.Module()
    target.model = torch.nn.Module()
    target.model.embed_tokens = (
        VocabParallelEmbedding(VOCAB, HIDDEN) if get_pp_group().is_first_rank
        else PPMissingLayer()
    )
    target.lm_head = ParallelLMHead(VOCAB, HIDDEN, prefix="lm_head")
    own_embed = m.model.embed_tokens
    eagle_utils.get_model = lambda **kw: m
    draft = eagle_utils.load_eagle_model(target, _cfg(cfg, None, torch))
    out["eagle_lm_head_is_target"] = draft.lm_head is target.lm_head
    out["eagle_embed"] = (
        "target" if draft.model.embed_tokens is target.model.embed_tokens
        else "own" if draft.model.embed_tokens is own_embed else "other"
    )
    out["eagle_logits"] = tuple(
        draft.compute_logits(torch.zeros(2, HIDDEN, dtype=torch.bfloat16)).shape
    )
    out["is_last"] = is_last
    return out


def make_vllm_config():
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device="cpu"))


def build_all(rank, world, port, vllm_cfg=None):
    import torch
    from torch import nn

    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if vllm_cfg is None:
        vllm_cfg = make_vllm_config()
    with set_current_vllm_config(vllm_cfg):
        ps.init_distributed_environment(
            world_size=world,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
        )
        ps.initialize_model_parallel(1, world, backend="gloo")
        pp = ps.get_pp_group()
        if not pp.is_last_rank:
            return {"skipped": "the draft is built on the last PP rank only"}
        from vllm.models.qwen4_exp.nvidia import mtp

        from vllm.utils.torch_utils import set_default_torch_dtype

        calls = {}
        _install_stubs(mtp, torch, nn, calls)
        # As the loader: parameters in the model dtype.
        with set_default_torch_dtype(torch.bfloat16):
            return {
                f"pp{g_pp}_fit{g_fit}": _one(mtp, vllm_cfg, torch, calls, g_pp,
                                             g_fit, pp.is_last_rank)
                for g_pp, g_fit in GATES
            }
