"""0220-qsa-kv-offload: the attention block size vLLM picks under
VLLM_QSA_KV_OFFLOAD=1, from a Qwen4Exp config shaped like the real one:
12,144 tokens (9,776 with MTP on a 16/17/15 split), no mamba padding; the
mamba page comes from vLLM's own Qwen4Exp state specs. Gate off: upstream.
A smaller (FP8) host K/V page halves the host pool and leaves the block: the
host K/V takes no device bytes, checked through vLLM's own specs and grouping."""

import json
from types import SimpleNamespace

import pytest
import torch

qc = pytest.importorskip("vllm.models.qwen4_exp.common.qsa_capacity")
import kv_capacity as kc  # noqa: E402
from vllm.models.qwen4_exp.config import Qwen4ExpTextConfig  # noqa: E402
from vllm.platforms.interface import Platform  # noqa: E402


def _vllm_config(mtp, ple=True):
    raw = json.loads(kc.DEFAULT_CONFIG.read_text())["text_config"]
    raw = {k: v for k, v in raw.items() if k not in ("model_type", "torch_dtype")}
    if not ple:
        raw["ple_layer_ids"] = []
    hf = Qwen4ExpTextConfig(**raw)
    spec = SimpleNamespace(method="mtp", num_speculative_tokens=1) if mtp else None
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=hf, dtype=torch.bfloat16),
        cache_config=SimpleNamespace(block_size=16, mamba_cache_mode="align",
                                     mamba_block_size=None, mamba_page_size_padded=123,
                                     mamba_cache_dtype="auto",
                                     mamba_ssm_cache_dtype="float32"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=3, tensor_parallel_size=1),
        speculative_config=spec,
        num_speculative_tokens=int(mtp),
        attention_config=SimpleNamespace(resolve_indexer_kv_dtype=lambda d: d),
    )


def _mamba_page(vcfg):
    from vllm.models.qwen4_exp.nvidia.model import Qwen4ExpForCausalLM
    return max(s.page_size_bytes for s in Qwen4ExpForCausalLM.get_mamba_specs_from_config(vcfg))


@pytest.mark.parametrize("mtp,split,block,page", [
    (False, None, 12_144, 3_207_168),
    (True, "16,17,15", 9_776, 3_227_648),
])
def test_offload_block_size(monkeypatch, mtp, split, block, page):
    monkeypatch.setenv("VLLM_QSA_KV_OFFLOAD", "1")
    if split:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", split)
    else:
        monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    vcfg = _vllm_config(mtp)
    mamba_page = _mamba_page(vcfg)
    assert mamba_page == page  # vLLM's own state shapes agree with the tool
    assert Platform._align_qsa_offload_block_size(vcfg, mamba_page) is True
    cc = vcfg.cache_config
    assert cc.block_size == block == cc.mamba_block_size
    assert cc.mamba_page_size_padded is None
    # the same number from the tool's derivation (config dict + rank layout)
    assert kc.model_block_size(kc.load_config(kc.DEFAULT_CONFIG), 3, split,
                               int(mtp), int(mtp)) == block


def test_gate_off_is_upstream(monkeypatch):
    monkeypatch.setenv("VLLM_QSA_KV_OFFLOAD", "0")
    vcfg = _vllm_config(False)
    assert Platform._align_qsa_offload_block_size(vcfg, 3_207_168) is False
    assert vcfg.cache_config.block_size == 16
    assert vcfg.cache_config.mamba_page_size_padded == 123


def _group_vcfg():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout.BLNHC
    return SimpleNamespace(
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout,
                                     mamba_cache_mode="align", num_gpu_blocks_override=None,
                                     prefix_cache_retention_interval=None),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        attention_config=SimpleNamespace(hisparse_config=None),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        speculative_config=None, model_config=SimpleNamespace(max_model_len=262144))


@pytest.mark.parametrize("kv_dtype,cache_dtype", [("bf16", "auto"), ("fp8", "fp8_e5m2"),
                                                  ("fp8", "fp8_e4m3")])
def test_host_kv_dtype_sets_host_page_not_block(monkeypatch, kv_dtype, cache_dtype):
    """A smaller (FP8) QSA K/V page: upstream stores fp8 K/V as uint8 elements
    with per-tensor scales (kv_quant_mode FP8_PER_TENSOR, nothing per token).
    vLLM's own spec gives the host page the derivation's bytes per token, and
    vLLM's own grouping keeps it off the device page, so the block aligned to
    the mamba page (12,144) is the one the derivation gives for either dtype."""
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.core import kv_cache_utils as kvu
    from vllm.v1.kv_cache_interface import (HostResidentFullAttentionSpec, MLAAttentionSpec,
                                            get_kv_quant_mode)

    monkeypatch.setenv("VLLM_QSA_KV_OFFLOAD", "1")
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    vcfg = _vllm_config(False)
    mamba_page = _mamba_page(vcfg)
    assert Platform._align_qsa_offload_block_size(vcfg, mamba_page) is True
    block = vcfg.cache_config.block_size
    cfg = kc.load_config(kc.DEFAULT_CONFIG)
    lay = qc.capacity_layout(cfg, pp_size=3, max_model_len=262144, prefix_caching=True,
                             kv_dtype=kv_dtype)
    assert lay["block_size"] == block == qc.model_block_size(cfg, 3)
    dtype = torch.bfloat16 if cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]
    ratio, idx_dim = int(cfg["indexer_compress_ratio"]), int(cfg["indexer_head_dim"])
    layers = lay["qsa_layers_per_rank"][0]
    specs = {}
    for i in range(layers):
        p = f"layers.{4 * i + 3}.self_attn"
        specs[f"{p}.indexer.compressed_key_cache"] = MLAAttentionSpec(
            block_size=block, num_kv_heads=1, head_size=idx_dim, dtype=torch.bfloat16,
            tokens_per_state=ratio)
        specs[f"{p}.attn"] = HostResidentFullAttentionSpec(
            block_size=block, num_kv_heads=int(cfg["num_key_value_heads"]),
            head_size=int(cfg["head_dim"]), head_size_v=int(cfg["head_dim"]), dtype=dtype,
            kv_quant_mode=get_kv_quant_mode(cache_dtype),
            partner_layer=f"{p}.indexer.compressed_key_cache", staging_blocks=layers)
    host = specs["layers.3.self_attn.attn"]
    # vLLM's page of the host K/V = the derivation's bytes per token x block
    # (bf16 24,870,912 B, fp8 half of it)
    assert host.page_size_bytes == block * qc.qsa_kv_bytes_per_token(cfg, kv_dtype=kv_dtype)
    assert lay["host_bytes_per_block_per_rank"][0] == layers * host.page_size_bytes
    (group,) = kvu.get_kv_cache_groups(_group_vcfg(), specs)
    assert len(group.layer_names) == 2 * layers
    # the device page holds only the compressed keys, within one mamba page
    device = group.kv_cache_spec.page_size_bytes
    assert device == layers * (block // ratio) * idx_dim * 2
    assert device <= layers * block * qc.qsa_vram_bytes_per_token(cfg) <= mamba_page
    # (the rank's widest group per block is the mamba page, not the QSA group)
    assert lay["bytes_per_block_per_rank"][0] == mamba_page


def test_fp8_halves_host_kv_only():
    cfg = kc.load_config(kc.DEFAULT_CONFIG)
    assert qc.qsa_kv_bytes_per_token(cfg) == 2 * qc.qsa_kv_bytes_per_token(cfg, kv_dtype="fp8")
    for mtp, split in ((False, None), (True, "16,17,15")):
        kw = dict(pp_size=3, partition=split, max_model_len=262144, prefix_caching=True,
                  num_spec=int(mtp))
        bf, f8 = qc.capacity_layout(cfg, **kw), qc.capacity_layout(cfg, kv_dtype="fp8", **kw)
        same = ("block_size", "R", "page_bytes", "bytes_per_block_per_rank", "num_groups")
        assert {k: bf[k] for k in same} == {k: f8[k] for k in same}
        assert bf["host_bytes_per_block_per_rank"] == [2 * b for b in
                                                       f8["host_bytes_per_block_per_rank"]]
        assert bf["staging_arena_bytes"] == 2 * f8["staging_arena_bytes"]
    with pytest.raises(ValueError, match="QSA K/V dtype"):
        qc.qsa_kv_bytes_per_token(cfg, kv_dtype="fp4")
