"""Worker for test_mtp_overlay_load.py: loads the Qwen4Exp MTP draft from a
make_mtp_int4.py overlay directory through vLLM's DefaultModelLoader, in one
process with vLLM's parallel state (gloo, PP=1).

Real: Qwen4ExpMTP with its real decoder layer (Qwen4ExpSparseMoeBlock ->
RoutedExperts with the compressed-tensors WNA16 MoE method, INT4 g128 from
the overlay's config.json), the draft quant-config remap (0630), the loader
(_prepare_weights, the index file filter, the safetensors iterators, 0120),
Qwen4ExpMTP.load_weights / AutoWeightsLoader and RoutedExperts.load_weights.
Stand-ins, each because the CPU platform has no GPU kernel to choose: the
attention op inside Qwen3NextAttention (no attention backend on CPU; its
qkv/o projections and norms are real), the WNA16 MoE backend oracle (set to
Marlin, what it picks on sm_86), the low-latency GEMM pass, and
get_draft_quant_config (its checkpoint read is replaced by the same
CompressedTensorsConfig.from_config on the overlay's quantization_config).
"""

import json
import logging
import os
import types

from pp_ranks import report

HIDDEN, INTER, N_EXPERTS, VOCAB, HC, N_MAIN = 128, 128, 4, 256, 2, 4


def text_config():
    from vllm.models.qwen4_exp.config import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=N_MAIN,
        hc_count=HC, hc_lowrank=8,
        layer_types=["linear_attention"] * (N_MAIN - 1) + ["full_attention"],
        tie_word_embeddings=False,
        num_experts=N_EXPERTS, num_experts_per_tok=2,
        moe_intermediate_size=INTER, shared_expert_intermediate_size=INTER,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        intermediate_size=256,
        linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=32, linear_value_head_dim=32,
    )


class _Cfg(types.SimpleNamespace):
    """A config namespace whose unset attributes read as None (the optional
    features the layers probe for are off)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def run_rank(rank, world, port, cases, q):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    report(rank, q, run_cases, rank, world, port, cases)


def _install_stand_ins(torch):
    import vllm.model_executor.models.qwen3_next as q3n
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (  # noqa: E501
        compressed_tensors_moe_wna16 as wna16,
    )
    from vllm.models.qwen4_exp.nvidia import mtp

    class NoBackendAttention(torch.nn.Module):
        def __init__(self, *a, **k):
            super().__init__()

    q3n.Attention = NoBackendAttention
    wna16.select_wna16_moe_backend = lambda **kw: (WNA16MoEBackend.MARLIN, object)
    mtp.enable_qwen4_exp_low_latency_gemm = lambda *a, **k: None
    mtp.replace = lambda cfg, **kw: _Cfg(**{**vars(cfg), **kw})


def _build(vllm_cfg, overlay, torch):
    import dataclasses

    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E501
        CompressedTensorsConfig,
    )
    from vllm.models.qwen4_exp.nvidia import mtp
    from vllm.utils.torch_utils import set_default_torch_dtype

    qcfg = json.loads((overlay / "config.json").read_text())["quantization_config"]
    mtp.get_draft_quant_config = lambda cfg: CompressedTensorsConfig.from_config(qcfg)
    text = text_config()
    model_config = _Cfg(hf_text_config=text, hf_config=text, dtype=torch.bfloat16,
                        is_mm_prefix_lm=False)
    base = {f.name: getattr(vllm_cfg, f.name) for f in dataclasses.fields(vllm_cfg)}
    cfg = _Cfg(**{
        **base,
        "model_config": model_config,
        "quant_config": None,
        "speculative_config": _Cfg(draft_model_config=model_config, method="mtp",
                                   enable_adaptive_verification=False),
    })
    with set_default_torch_dtype(torch.bfloat16):
        return mtp.Qwen4ExpMTP(vllm_config=cfg, prefix="")


def _expected(overlay, torch):
    """The expert parameters as mtp-int4.safetensors dictates them, in the
    layout of the Marlin WNA16 MoE method (per expert [in/8, out] packed,
    [in/128, out] scales; w13 = gate then up along out)."""
    from safetensors import safe_open

    w13p, w13s, w2p, w2s = [], [], [], []
    with safe_open(str(overlay / "mtp-int4.safetensors"), framework="pt") as f:
        def t(e, p, s):
            return f.get_tensor(f"mtp.layers.0.mlp.experts.{e}.{p}.{s}")

        for e in range(N_EXPERTS):
            w13p.append(torch.cat([t(e, "gate_proj", "weight_packed"),
                                   t(e, "up_proj", "weight_packed")]).T)
            w13s.append(torch.cat([t(e, "gate_proj", "weight_scale"),
                                   t(e, "up_proj", "weight_scale")]).T)
            w2p.append(t(e, "down_proj", "weight_packed").T)
            w2s.append(t(e, "down_proj", "weight_scale").T)
    return {"w13_weight_packed": torch.stack(w13p), "w13_weight_scale": torch.stack(w13s),
            "w2_weight_packed": torch.stack(w2p), "w2_weight_scale": torch.stack(w2s)}


def _one(vllm_cfg, case, torch):
    from pathlib import Path

    from vllm.config.load import LoadConfig
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.model_loader import default_loader as dl

    overlay = Path(case["overlay"])
    os.environ["VLLM_SAFETENSORS_INDEX_FILTER"] = case["gate"]
    # One draft per case: forget the previous one's layer registrations.
    cc = vllm_cfg.compilation_config
    cc.static_forward_context.clear()
    cc.static_all_moe_layers.clear()
    m = _build(vllm_cfg, overlay, torch)
    experts = m.model.layers[0].mlp.experts.routed_experts
    assert isinstance(experts, RoutedExperts)
    out = {"quant_method": type(experts.quant_method).__name__,
           "layer_name": experts.layer_name}

    reached = []
    real = RoutedExperts.load_weights

    def spy(self, weights):
        def rec():
            for name, w in weights:
                reached.append((name, str(w.dtype)))
                yield name, w
        return real(self, rec())

    RoutedExperts.load_weights = spy
    if case["format"] == "fastsafetensors":
        # The real one needs CUDA and GDS; like it, yield every tensor of
        # every file without saying which file it came from.
        from safetensors import safe_open

        def all_tensors(files, use_tqdm):
            for fn in sorted(files):
                with safe_open(fn, framework="pt") as f:
                    for k in f.keys():  # noqa: SIM118
                        yield k, f.get_tensor(k)

        dl.fastsafetensors_weights_iterator = all_tensors
    load_config = LoadConfig(
        load_format=("auto" if case["format"] in ("multithread", "eager") else case["format"]),
        safetensors_load_strategy="eager" if case["format"] == "eager" else None,
        model_loader_extra_config=(
            {"enable_multithread_load": True, "num_threads": 2}
            if case["format"] == "multithread" else {}),
        use_tqdm_on_load=False,
    )
    model_config = _Cfg(model=str(overlay), revision=None, quantization="compressed-tensors")
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    wu_logger = logging.getLogger("vllm.model_executor.model_loader.weight_utils")
    wu_logger.addHandler(handler)
    try:
        dl.DefaultModelLoader(load_config).load_weights(m, model_config)
        out["load"] = "ok"
    except Exception as e:  # noqa: BLE001
        out["load"] = f"{type(e).__name__}: {e}"
    finally:
        RoutedExperts.load_weights = real
        wu_logger.removeHandler(handler)
    out["log"] = [r for r in records if "superseded" in r]
    out["reached"] = sorted(set(reached))
    if out["load"] == "ok":
        exp = _expected(overlay, torch)
        params = dict(experts.named_parameters())
        out["expert_params"] = sorted(params)
        out["equal"] = {n: bool(torch.equal(params[n].data, exp[n])) for n in exp}
        # Non-expert draft weights: the checkpoint's bf16 tensors, as named there.
        from safetensors import safe_open

        ckpt = Path(case["checkpoint"])
        wm = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
        sd = m.state_dict()
        out["other_equal"] = {}
        for param, ck_name in case["other"].items():
            with safe_open(str(ckpt / wm[ck_name]), framework="pt") as f:
                out["other_equal"][param] = bool(torch.equal(sd[param], f.get_tensor(ck_name)))
    return out


def run_cases(rank, world, port, cases):
    import torch

    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    vllm_cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(vllm_cfg):
        ps.init_distributed_environment(
            world_size=world, rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank, backend="gloo",
        )
        ps.initialize_model_parallel(1, world, backend="gloo")
        _install_stand_ins(torch)
        return {c["id"]: _one(vllm_cfg, c, torch) for c in cases}
