"""0220-qsa-kv-offload: the attention block size vLLM picks under
VLLM_QSA_KV_OFFLOAD=1, from a Qwen4Exp config shaped like the real one:
12,144 tokens (9,776 with MTP on a 16/17/15 split), no mamba padding; the
mamba page comes from vLLM's own Qwen4Exp state specs. Gate off: upstream."""

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
