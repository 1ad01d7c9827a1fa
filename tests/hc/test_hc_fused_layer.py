"""Patch 0400-hc-fused wired into GatedResidual (CPU, TRITON_INTERPRET=1).

With VLLM_HC_FUSED=1 and INT8 channel HC linears, GatedResidual swaps in
HCInt8LinearMethod (weight kept as stored, cloned once, padding rows zeroed)
and runs mix/combine_and_mix through the two fused kernels (1..8 tokens) or
the two prefill GEMMs (more); the result matches the fp32 reference of the
unfused math (interpreter bf16 = truncation) but for rare rounding flips.
VLLM_HC_FUSED=0 keeps the compressed-tensors method (upstream + patch 0020).
"""

import pytest
import torch

from test_hc_int8_layers import HC, HIDDEN, RANK, REGEX_GROUP, _hc, make_ct
from test_hc_int8_layers import cpu_kernel as _cpu_kernel  # noqa: F401  (autouse fixture)
from test_hc_fused_kernels import assert_bf16_match
from vllm.models.qwen4_exp.nvidia.ops import hc_int8 as H

cpu_kernel = _cpu_kernel
INJ = HC
K = HIDDEN * HC


@pytest.fixture
def gates(monkeypatch):
    def set_(fused: bool):
        monkeypatch.setenv("VLLM_INT8_HC_EMBED_LMHEAD", "1")
        monkeypatch.setenv("VLLM_HC_FUSED", "1" if fused else "0")
    return set_


def _load(layer, loaded_rows, gen):
    """What the weight loader leaves: checkpoint rows, garbage padding rows."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    n, k = layer.weight_packed.shape[0], layer.weight_packed.shape[1] * 4
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    layer.weight_packed.data.copy_(pack_to_int32(q, 8))
    scale = (torch.rand(n, 1, generator=gen) * 0.02 + 0.005).bfloat16()
    scale[loaded_rows:] = float("nan")
    layer.weight_scale.data.copy_(scale)


def _prepare(g, gen):
    from vllm.models.qwen4_exp.nvidia.hyperconnection import HCInt8LinearMethod

    down = g._down_linear()
    up = g.input_mix_weight_up
    for layer, rows in ((down, RANK + g.num_inject), (up, K)):
        assert isinstance(layer.quant_method, HCInt8LinearMethod)
        _load(layer, rows, gen)
        before = layer.weight_packed.data_ptr()
        layer.quant_method.process_weights_after_loading(layer)
        # Cloned once (upstream's repack allocates new, frees old), and the
        # kernels' uint8 view is that clone, not a copy.
        assert layer.weight_packed.data_ptr() != before
        assert layer.hc_weight_u8.data_ptr() == layer.weight_packed.data_ptr()
        assert bool((layer.hc_weight_u8[rows:] == 128).all())
        assert bool((layer.weight_scale[rows:] == 0).all())
    g.hc_norm.weight.data.copy_((torch.randn(K, generator=gen) * 0.1).bfloat16())
    return down, up


def _ref(g, down, up, xn, w_rnd=None):
    return H.reference_mix(xn, down.hc_weight_u8, down.hc_scale, up.hc_weight_u8, up.hc_scale,
                           RANK, g.num_inject, HC, rnd=H.round_bf16_trunc, w_rnd=w_rnd)


@pytest.mark.parametrize("m", [1, 3, 8, 20])
def test_combine_and_mix_fused(gates, m):
    """1..8 tokens: the fused GEMV kernels; 20: the prefill GEMMs on the
    INT8 bytes (no bf16 weight copy), with the default configs (K split
    adapted to the small test K): both exact but for rounding flips."""
    from vllm.models.qwen4_exp.nvidia.ops.hc import hc_combine_norm

    gates(True)
    g = _hc(make_ct(REGEX_GROUP))
    assert g.hc_fused
    gen = torch.Generator().manual_seed(m)
    down, up = _prepare(g, gen)
    h = torch.randn(m, K, generator=gen).bfloat16()
    blk = torch.randn(m, HIDDEN, generator=gen).bfloat16()
    inj = torch.randn(m, HC, generator=gen).bfloat16()
    h_out, block_input, injection = g.combine_and_mix(h, blk, inj)
    h_ref, xn = hc_combine_norm(h, blk, inj, g.hc_norm.weight, g.config.rms_norm_eps, HC)
    ref_bi, ref_inj = _ref(g, down, up, xn)
    assert torch.equal(h_out, h_ref)
    assert injection.shape == (m, HC)
    assert_bf16_match(block_input, ref_bi)
    assert_bf16_match(injection, ref_inj, ulps=1)


@pytest.mark.parametrize("use_combine", [True, False], ids=["gated", "final_mixer"])
def test_mix_fused(gates, use_combine):
    from vllm.models.qwen4_exp.nvidia.ops.hc import grouped_gemma_rmsnorm

    gates(True)
    g = _hc(make_ct(REGEX_GROUP), use_combine)
    assert g.hc_fused
    gen = torch.Generator().manual_seed(5)
    down, up = _prepare(g, gen)
    h = torch.randn(2, K, generator=gen).bfloat16()
    _, block_input, injection = g.mix(h)
    xn = grouped_gemma_rmsnorm(h, g.hc_norm.weight, g.config.rms_norm_eps, HC)
    ref_bi, ref_inj = _ref(g, down, up, xn)
    assert_bf16_match(block_input, ref_bi)
    if use_combine:
        assert_bf16_match(injection, ref_inj, ulps=1)
    else:
        assert injection is None


def test_fused_linear_apply_is_dequant_gemm(gates):
    gates(True)
    g = _hc(make_ct(REGEX_GROUP))
    down, up = _prepare(g, torch.Generator().manual_seed(9))
    x = torch.randn(3, K).bfloat16()
    y = down.quant_method.apply(down, x)
    w = (down.hc_weight_u8.float() - 128) * down.hc_scale[:, None].float()
    # The interpreter's dequant rounds by truncation; the matmul is torch's.
    assert torch.equal(y, torch.nn.functional.linear(x, H.round_bf16_trunc(w).bfloat16()))
    assert y.shape == (3, down.hc_weight_u8.shape[0])


def test_gate_off_keeps_compressed_tensors_method(gates):
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E501
        CompressedTensorsLinearMethod,
    )

    gates(False)
    g = _hc(make_ct(REGEX_GROUP))
    assert not g.hc_fused
    for layer in (g._down_linear(), g.input_mix_weight_up):
        assert type(layer.quant_method) is CompressedTensorsLinearMethod


def test_bf16_hc_is_not_fused(gates, monkeypatch):
    """No INT8 config (upstream bf16 weights): the fused path stays off."""
    from vllm.models.qwen4_exp.nvidia import hyperconnection

    said = []
    monkeypatch.setattr(hyperconnection.logger, "warning_once",
                        lambda msg, *args, **kw: said.append(msg % args))
    gates(True)
    monkeypatch.setenv("VLLM_INT8_HC_EMBED_LMHEAD", "0")
    g = _hc(make_ct(REGEX_GROUP))
    assert not g.hc_fused
    # Not silent: one line says the unfused path runs, and why.
    assert len(said) == 1 and "unfused" in said[0] and "not INT8" in said[0], said
