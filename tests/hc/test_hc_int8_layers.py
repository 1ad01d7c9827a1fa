"""Patch 0020-int8-hc-embed-lmhead: HC linears, embed_tokens and lm_head are
built with the checkpoint's compressed-tensors INT8 config (gate on) or with
quant_config=None as upstream (VLLM_INT8_HC_EMBED_LMHEAD=0).

A real CompressedTensorsConfig is made from a small config dict shaped like
the checkpoint's (INT8 channel group for HC/embed/lm_head, INT4 group-128 for
every other Linear). The CPU has no WNA16 GEMM kernel, so kernel selection is
stubbed; parameter creation and scheme matching are the real code.
"""

import pytest
import torch

from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.compressed_tensors import (
    compressed_tensors as ct,
)
from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
    compressed_tensors_wNa16 as w16,
)

HIDDEN, HC, RANK = 64, 4, 32  # small; real: 2560, 4, 320
PACKED = {
    "input_mix_weight_down_block_inject": [
        "input_mix_weight_down",
        "block_inject_weight",
        "_input_mix_padding",
    ],
}
INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
        "group_size": None, "dynamic": False}
INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
        "group_size": 16, "dynamic": False}


def make_ct(int8_targets, ignore=()):
    cfg = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "g_int8": {"targets": list(int8_targets), "weights": dict(INT8),
                       "input_activations": None, "format": "pack-quantized"},
            "g_int4": {"targets": ["Linear"], "weights": dict(INT4),
                       "input_activations": None, "format": "pack-quantized"},
        },
        "ignore": list(ignore),
    }
    qc = ct.CompressedTensorsConfig.from_config(cfg)
    # What configure_quant_config does before the model is built.
    qc.packed_modules_mapping = dict(PACKED)
    return qc


REGEX_GROUP = ["re:.*hyper_connection.*", "re:.*embed_tokens$", "re:.*lm_head$"]
# Names only the real shards: the padding shard matches none of these.
NAMED_GROUP = ["re:.*input_mix_weight_down$", "re:.*block_inject_weight$",
               "re:.*input_mix_weight_up$", "re:.*embed_tokens$", "re:.*lm_head$"]


class _FakeKernel:
    def __init__(self, config, **kw):
        self.config = config


@pytest.fixture(autouse=True)
def cpu_kernel(monkeypatch):
    monkeypatch.setattr(w16, "choose_mp_linear_kernel", lambda c: _FakeKernel)
    # Single rank without a process group (as in tests of vLLM parameters).
    import vllm.model_executor.layers.vocab_parallel_embedding as vpe
    import vllm.model_executor.layers.linear as vlin
    import vllm.model_executor.parameter as vparam

    for mod in (vpe, vparam, vlin):
        for fn, val in (("get_tensor_model_parallel_world_size", 1),
                        ("get_tensor_model_parallel_rank", 0)):
            if hasattr(mod, fn):
                monkeypatch.setattr(mod, fn, lambda v=val: v)


def _gate(monkeypatch, on: bool):
    monkeypatch.setenv("VLLM_INT8_HC_EMBED_LMHEAD", "1" if on else "0")
    # This file checks patch 0020 alone; 0400 (VLLM_HC_FUSED) swaps the HC
    # method afterwards and is tested in test_hc_fused_layer.py.
    monkeypatch.setenv("VLLM_HC_FUSED", "0")


def _hc(qc, use_combine=True):
    from vllm.models.qwen4_exp.nvidia.hyperconnection import (
        GatedResidual,
        HyperConnectionConfig,
    )

    cfg = HyperConnectionConfig(hc_count=HC, hidden_size=HIDDEN, hc_lowrank=RANK,
                                params_dtype=torch.bfloat16, hc_per_branch_norm=True)
    return GatedResidual(cfg, use_combine=use_combine, quant_config=qc,
                         prefix="model.layers.3.attn_hyper_connection"
                         if use_combine else "model.hyper_connection_mixer")


def _linears(g):
    names = ["input_mix_weight_up"] + (
        ["input_mix_weight_down_block_inject"] if g.use_combine else ["input_mix_weight_down"])
    return {n: getattr(g, n) for n in names}


def _assert_int8(layer, n_out, k):
    assert isinstance(layer.quant_method, ct.CompressedTensorsLinearMethod)
    assert isinstance(layer.scheme, w16.CompressedTensorsWNA16)
    assert str(layer.scheme.quant_type) == "uint8b128"
    params = dict(layer.named_parameters())
    assert "weight" not in params
    assert params["weight_packed"].shape == (n_out, k // 4)
    assert params["weight_packed"].dtype == torch.int32
    assert params["weight_scale"].shape == (n_out, 1)
    assert params["weight_scale"].dtype == torch.bfloat16


@pytest.mark.parametrize("targets", [REGEX_GROUP, NAMED_GROUP], ids=["regex", "named"])
@pytest.mark.parametrize("use_combine", [True, False], ids=["gated", "final_mixer"])
def test_hc_linears_int8_when_on(monkeypatch, targets, use_combine):
    _gate(monkeypatch, True)
    qc = make_ct(targets)
    g = _hc(qc, use_combine)
    lin = _linears(g)
    n_down = RANK + (HC + 12 if use_combine else 0)  # 320 + 4 + 12 padding at real size
    key = "input_mix_weight_down_block_inject" if use_combine else "input_mix_weight_down"
    _assert_int8(lin[key], n_down, HIDDEN * HC)
    _assert_int8(lin["input_mix_weight_up"], HIDDEN * HC, RANK)
    # The model's shared mapping keeps the padding shard.
    assert "_input_mix_padding" in qc.packed_modules_mapping[
        "input_mix_weight_down_block_inject"]


def test_named_targets_would_fall_to_int4_without_padding_fix(monkeypatch):
    """Why hc_quant_config drops the padding shard: with it, a target list
    naming the real shards misses the merged layer and the class-name target
    'Linear' (the INT4 group) wins."""
    _gate(monkeypatch, True)
    qc = make_ct(NAMED_GROUP)
    layer_name = "model.layers.3.attn_hyper_connection.input_mix_weight_down_block_inject"
    import torch.nn as nn

    class MergedColumnParallelLinear(nn.Module):
        pass

    d = qc.get_scheme_dict(MergedColumnParallelLinear(), layer_name)
    assert d["weights"].num_bits == 4
    from vllm.models.qwen4_exp.nvidia.hyperconnection import hc_quant_config

    d = hc_quant_config(qc).get_scheme_dict(MergedColumnParallelLinear(), layer_name)
    assert d["weights"].num_bits == 8


def test_hc_ignored_shards_stay_unquantized(monkeypatch):
    """An ignore list naming the two real shards (not the synthetic padding)
    must not raise 'different quantization schemes'."""
    _gate(monkeypatch, True)
    qc = make_ct(["re:.*embed_tokens$"],
                 ignore=["re:.*input_mix_weight_down$", "re:.*block_inject_weight$",
                         "re:.*input_mix_weight_up$"])
    with pytest.raises(ValueError, match="different quantization schemes"):
        qc.get_scheme_dict(torch.nn.Linear(1, 1),
                           "model.layers.3.attn_hyper_connection.input_mix_weight_down_block_inject")
    g = _hc(qc)
    for layer in _linears(g).values():
        assert isinstance(layer.quant_method, UnquantizedLinearMethod)


@pytest.mark.parametrize("use_combine", [True, False])
def test_hc_linears_bf16_when_off(monkeypatch, use_combine):
    _gate(monkeypatch, False)
    g = _hc(make_ct(REGEX_GROUP), use_combine)
    for layer in _linears(g).values():
        assert isinstance(layer.quant_method, UnquantizedLinearMethod)
        assert layer.weight.dtype == torch.bfloat16
        assert not hasattr(layer, "weight_packed")


def test_non_ct_config_keeps_none(monkeypatch):
    from vllm.models.qwen4_exp.nvidia.hyperconnection import int8_checkpoint_quant_config

    _gate(monkeypatch, True)

    class Other:
        def get_name(self):
            return "modelopt_fp4"

    assert int8_checkpoint_quant_config(Other()) is None
    assert int8_checkpoint_quant_config(None) is None
    qc = make_ct(REGEX_GROUP)
    assert int8_checkpoint_quant_config(qc) is qc
    _gate(monkeypatch, False)
    assert int8_checkpoint_quant_config(qc) is None


@pytest.mark.parametrize("on", [True, False])
def test_embed_and_lm_head(monkeypatch, on):
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_embedding import (  # noqa: E501
        CompressedTensorsEmbeddingWNA16Int,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )
    from vllm.models.qwen4_exp.nvidia.hyperconnection import int8_checkpoint_quant_config

    _gate(monkeypatch, on)
    qc = int8_checkpoint_quant_config(make_ct(REGEX_GROUP))
    # The same calls model.py makes (prefixes as Qwen4ExpModel / ForCausalLM).
    emb = VocabParallelEmbedding(256, HIDDEN, quant_config=qc, prefix="model.embed_tokens")
    head = ParallelLMHead(256, HIDDEN, quant_config=qc, prefix="lm_head")
    if on:
        assert isinstance(emb.quant_method, CompressedTensorsEmbeddingWNA16Int)
        assert emb.weight_packed.shape == (256, HIDDEN // 4)
        assert isinstance(head.quant_method, ct.CompressedTensorsLinearMethod)
        assert head.weight_packed.shape == (256, HIDDEN // 4)
    else:
        assert isinstance(emb.quant_method, UnquantizedEmbeddingMethod)
        assert isinstance(head.quant_method, UnquantizedEmbeddingMethod)
        assert emb.weight.dtype == head.weight.dtype


def test_model_passes_quant_config(monkeypatch):
    """model.py hands the checkpoint config to every HC / embed / lm_head
    constructor (the layers above then decide). Checked on the source of the
    patched constructors, since building the full model needs a GPU."""
    import inspect

    from vllm.models.qwen4_exp.nvidia import model as md

    dec = inspect.getsource(md.Qwen4ExpDecoderLayer.__init__)
    assert dec.count("quant_config=quant_config,\n        )") >= 2
    mdl = inspect.getsource(md.Qwen4ExpModel.__init__)
    assert "int8_checkpoint_quant_config(vllm_config.quant_config)" in mdl
    assert "quant_config=vllm_config.quant_config" in mdl
    lm = inspect.getsource(md.Qwen4ExpForCausalLM.__init__)
    assert "quant_config=int8_checkpoint_quant_config(self.quant_config)" in lm
