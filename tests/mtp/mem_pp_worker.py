"""Worker for test_mem_pp_missing_layers.py: one process per PP rank (gloo).

Each rank sets up vLLM's parallel state for real (init_distributed_environment
+ initialize_model_parallel over gloo) and builds Qwen4ExpForCausalLM and
Qwen4ExpForConditionalGeneration from a tiny config. Only the decoder layer
class, the ViT class and the tokenizer are replaced by small stand-ins (the
question is which modules each rank builds, not what a layer computes); the
embedding, the LM head, make_layers, the HC mixer and the loaders are real.
"""

import os
import types

from pp_ranks import report


def _tiny_text_config():
    from vllm.models.qwen4_exp.config import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=6,
        hc_count=2,
        hc_lowrank=8,
        layer_types=["linear_attention"] * 6,
        tie_word_embeddings=False,
    )


def _describe(model, prefix):
    from vllm.model_executor.models.utils import PPMissingLayer, StageMissingLayer

    out = {}
    for name in ("embed_tokens", "lm_head", "visual"):
        mod = None
        for cand in (model, getattr(model, "model", None)):
            if cand is not None and name in cand._modules:
                mod = cand._modules[name]
        if mod is None:
            continue
        if isinstance(mod, PPMissingLayer):
            out[prefix + name] = "PPMissingLayer"
        elif isinstance(mod, StageMissingLayer):
            out[prefix + name] = "StageMissingLayer"
        else:
            out[prefix + name] = type(mod).__name__
    return out


def run_rank(rank, world, port, gate, q):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["VLLM_PP_MISSING_LAYERS"] = gate
    report(rank, q, build_and_load, rank, world, port)


def build_and_load(rank, world, port):
    import torch
    from torch import nn

    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    vllm_cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(vllm_cfg):
        ps.init_distributed_environment(
            world_size=world,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
        )
        ps.initialize_model_parallel(1, world, backend="gloo")
        from vllm.models.qwen4_exp.nvidia import model as qm

        class TinyLayer(nn.Module):
            def __init__(self, *a, **k):
                super().__init__()
                self.w = nn.Parameter(torch.zeros(2))
                self.mlp = nn.Identity()  # not a MoE block: no EPLB setup

        class TinyViT(nn.Module):
            def __init__(self, *a, **k):
                super().__init__()
                self.w = nn.Parameter(torch.zeros(3))

        qm.Qwen4ExpDecoderLayer = TinyLayer
        qm.Qwen3_VisionTransformer = TinyViT
        qm.cached_tokenizer_from_config = lambda *a, **k: None
        qm.enable_qwen4_exp_low_latency_gemm = lambda *a, **k: None

        text = _tiny_text_config()
        vision = types.SimpleNamespace(
            deepstack_visual_indexes=[], out_hidden_size=64
        )
        mm = types.SimpleNamespace(
            language_model_only=False,
            mm_encoder_tp_mode="weights",
            video_pruning_rate=0.0,
            get_limit_per_prompt=lambda m: 1,
            get_video_pruning_spec=lambda: None,
            mm_encoder_only=False,
            is_multimodal_pruning_enabled=lambda: False,
        )
        hf = types.SimpleNamespace(
            text_config=text, vision_config=vision, **{"vocab_size": 256}
        )
        model_config = types.SimpleNamespace(
            hf_text_config=text,
            hf_config=hf,
            dtype=torch.bfloat16,
            multimodal_config=mm,
            get_multimodal_config=lambda: mm,
        )
        cfg = types.SimpleNamespace(
            model_config=model_config,
            quant_config=None,
            speculative_config=None,
            parallel_config=vllm_cfg.parallel_config,
            cache_config=types.SimpleNamespace(mamba_cache_mode="align"),
            scheduler_config=types.SimpleNamespace(max_num_batched_tokens=16),
            compilation_config=vllm_cfg.compilation_config,
        )
        result = {}
        lm = qm.Qwen4ExpForCausalLM(vllm_config=cfg, prefix="")
        result.update(_describe(lm, "causal."))
        result["causal.layers"] = [lm.model.start_layer, lm.model.end_layer]
        # Weight loading: a checkpoint with every rank's weights.
        ckpt = [
            ("model.embed_tokens.weight", torch.ones(256, 64)),
            ("lm_head.weight", torch.ones(256, 64)),
        ]
        loaded = lm.load_weights(iter(ckpt))
        result["causal.loaded"] = sorted(n for n in loaded if "layers" not in n and "hyper" not in n)

        vl = qm.Qwen4ExpForConditionalGeneration(vllm_config=cfg, prefix="")
        result.update(_describe(vl, "vl."))
        result.update(_describe(vl.language_model, "vl.lm."))
        result["vl.use_deepstack"] = vl.use_deepstack
        return result
