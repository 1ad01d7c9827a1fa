"""decode-05 wiring on the CPU: the gate, and the INT6 shared-expert linear
swapped to bit planes on a real compressed-tensors W6A16 layer (load-time
re-layout in place, then the prefill GEMM / decode GEMVs read it)."""

import pytest
import torch

import vllm.envs as envs
from vllm.models.qwen4_exp.nvidia.ops import moe_fused as mf


def test_gate_default_on_and_off(monkeypatch):
    monkeypatch.delenv("VLLM_MOE_FUSED", raising=False)
    assert envs.environment_variables["VLLM_MOE_FUSED"]() is True
    monkeypatch.setenv("VLLM_MOE_FUSED", "0")
    assert envs.environment_variables["VLLM_MOE_FUSED"]() is False


class _OtherKernel:  # stands in for HummingLinearKernel (not installed here)
    def __init__(self, c, w_q_param_name, w_s_param_name, w_zp_param_name=None):
        self.config, self.w_q_name, self.w_s_name, self.w_zp_name = c, w_q_param_name, w_s_param_name, w_zp_param_name

    def process_weights_after_loading(self, layer):
        raise AssertionError("upstream kernel must not run once swapped")


def _ct_int6_layer(monkeypatch, n, k, group):
    import vllm.model_executor.parameter as P
    import vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 as m

    monkeypatch.setattr(P, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(P, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(m, "choose_mp_linear_kernel", lambda c: _OtherKernel)
    s = m.CompressedTensorsWNA16("channel" if group == 0 else "group", 6, group_size=None if group == 0 else group)
    layer = torch.nn.Module()
    s.create_weights(layer, n, k, [n], k, torch.bfloat16, lambda *a, **kw: None)
    layer.scheme = s
    return layer, s


@pytest.mark.parametrize("group", [0, 128])
def test_int6_linear_swapped_to_planes(monkeypatch, group):
    from vllm.models.qwen4_exp.nvidia.moe_fused_layer import Int6PlanesLinearKernel, maybe_use_int6_planes

    n, k = 64, 256
    layer, scheme = _ct_int6_layer(monkeypatch, n, k, group)
    assert layer.weight_packed.shape == (n, k * 6 // 32)  # vLLM's dense INT6 param
    assert maybe_use_int6_planes(layer)
    assert isinstance(scheme.kernel, Int6PlanesLinearKernel)
    g = torch.Generator().manual_seed(0)
    u = torch.randint(0, 64, (n, k), generator=g, dtype=torch.int32)
    layer.weight_packed.data.copy_(mf.int6_pack_dense(u))
    layer.weight_scale.data.copy_((torch.rand(layer.weight_scale.shape, generator=g) * 4e-3 + 1e-3).bfloat16())
    dense = layer.weight_packed.data
    scheme.process_weights_after_loading(layer)
    # one new buffer of the same size replaces the dense one (write-up §3.5)
    assert layer.weight_packed.data_ptr() != dense.data_ptr()
    assert layer.weight_packed.shape == dense.shape and layer.weight_packed.dtype == dense.dtype
    assert torch.equal(mf.planes_to_u(layer.weight_packed.data, k), u)
    x = torch.randn(12, k, generator=g).bfloat16()
    out = scheme.apply_weights(layer, x, None)
    sc = layer.weight_scale.float().repeat_interleave(k // layer.weight_scale.shape[1], 1)
    ref = x.float() @ ((u.float() - 32) * sc).T
    torch.testing.assert_close(out.float(), ref.bfloat16().float(), rtol=1.6e-2, atol=1e-3)


def test_non_int6_linear_not_swapped(monkeypatch):
    import vllm.model_executor.parameter as P
    import vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 as m
    from vllm.models.qwen4_exp.nvidia.moe_fused_layer import maybe_use_int6_planes

    monkeypatch.setattr(P, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(P, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(m, "choose_mp_linear_kernel", lambda c: _OtherKernel)
    s = m.CompressedTensorsWNA16("channel", 4)
    layer = torch.nn.Module()
    s.create_weights(layer, 64, 256, [64], 256, torch.bfloat16, lambda *a, **kw: None)
    layer.scheme = s
    assert not maybe_use_int6_planes(layer)
    assert isinstance(s.kernel, _OtherKernel)
    assert not maybe_use_int6_planes(torch.nn.Linear(4, 4))


@pytest.mark.parametrize("M,pad_rows", [(3, []), (4, [3]), (8, [5, 6, 7])])
def test_fused_block_forward_composes_like_upstream(monkeypatch, M, pad_rows):
    """MoeFusedDecode.forward with the Marlin call replaced by a torch expert
    evaluator that reads ONLY sorted_token_ids / expert_ids / num_tokens_post_padded
    / topk_weights (as Marlin does): output vs the upstream block semantics
    (gate GEMV -> topk_softmax + renorm -> experts -> moe_sum; shared MLP ->
    sigmoid(shared gate) * shared; sum).

    With padding rows in the forward context (upstream VLLM_MOE_SKIP_PADDING,
    a batch of 3 padded to 4 by the graph) those rows read no expert (no
    slot reaches the expert evaluator), and the router's capture / replay
    hooks get the ids (-1 for padding) as on the upstream path."""
    import types

    import vllm.envs as envs
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.forward_context import create_forward_context, override_forward_context

    import vllm.model_executor.layers.fused_moe.experts.marlin_moe as mm
    from vllm.models.qwen4_exp.nvidia.moe_fused_layer import MoeFusedDecode

    E, k, H, I, Ie = 64, 4, 256, 128, 64
    monkeypatch.setattr(envs, "VLLM_MOE_SKIP_PADDING", True, raising=False)
    g = torch.Generator().manual_seed(42)
    bf = lambda t: t.bfloat16()  # noqa: E731
    gw = bf(torch.randn(E, H, generator=g) * 0.1)
    sgw = bf(torch.randn(1, H, generator=g) * 0.1)
    u_gu = torch.randint(0, 64, (2 * I, H), generator=g, dtype=torch.int32)
    u_dn = torch.randint(0, 64, (H, I), generator=g, dtype=torch.int32)
    s_gu = bf(torch.rand(2 * I, 1, generator=g) * 2e-3 + 5e-4)
    s_dn = bf(torch.rand(H, 1, generator=g) * 2e-3 + 5e-4)
    w13 = bf(torch.randn(E, 2 * Ie, H, generator=g) * 0.05)  # dense stand-ins for Marlin weights
    w2 = bf(torch.randn(E, H, Ie, generator=g) * 0.05)
    x = bf(torch.randn(M, H, generator=g))
    x[pad_rows] = 0
    read = []

    def expert(e, v):
        h = v.float() @ w13[e].float().T
        return (torch.nn.functional.silu(h[:Ie]) * h[Ie:]) @ w2[e].float().T

    def fake_marlin(**kw):
        hs, tw = kw["hidden_states"], kw["topk_weights"]
        s_ids, e_ids, n = kw["sorted_token_ids"], kw["expert_ids"], int(kw["num_tokens_post_padded"][0])
        bs, kk = kw["block_size_m"], kw["num_topk"]
        assert kw["workspace"] is ws and kw["quant_type"] is not None and kw["activation"] == "silu"
        assert kw["topk_ids"] is None and kw["expert_map"] is None  # as upstream fused_marlin_moe
        out = torch.zeros(hs.shape[0] * kk, hs.shape[1])
        for p in range(n):
            i = int(s_ids[p])
            if i >= hs.shape[0] * kk:
                continue  # padding slot
            read.append(i // kk)
            out[i] = tw.flatten()[i] * expert(int(e_ids[p // bs]), hs[i // kk])
        return out.bfloat16()

    monkeypatch.setattr(mm, "_fused_marlin_moe", fake_marlin)
    lin = lambda wp, sc: types.SimpleNamespace(weight_packed=wp, weight_scale=sc)  # noqa: E731
    ws = torch.zeros(4, dtype=torch.int32)
    block = types.SimpleNamespace(
        gate=types.SimpleNamespace(weight=gw), shared_expert_gate=types.SimpleNamespace(weight=sgw),
        shared_expert=types.SimpleNamespace(
            gate_up_proj=lin(mf.int6_to_planes(mf.int6_pack_dense(u_gu), H), s_gu),
            down_proj=lin(mf.int6_to_planes(mf.int6_pack_dense(u_dn), I), s_dn)),
        _moe_fused_counter=torch.zeros(1, dtype=torch.int32),
        experts=types.SimpleNamespace(router=types.SimpleNamespace(
            capture_fn=None, _routing_replay_out=torch.full((8, k), 99, dtype=torch.int16))))
    captured = []
    block.experts.router.capture_fn = lambda ids: captured.append(ids.clone())
    fe = types.SimpleNamespace(w1_bias=None, w2_bias=None, w1_scale=None, w2_scale=None, quant_type_id=0,
                               activation=None, a1_gscale=None, a2_gscale=None, g1_alphas=None,
                               g2_alphas=None, w1_zp=None, w2_zp=None, input_dtype=None, activation_config=None)
    re_ = types.SimpleNamespace(w13_weight=w13, w2_weight=w2, workspace=ws, activation="silu")
    f = object.__new__(MoeFusedDecode)
    f.block, f.top_k, f.renormalize, f.hidden, f.num_experts = block, k, True, H, E
    f.disabled, f._marlin = None, (re_, fe)
    monkeypatch.setattr("vllm.scalar_type.ScalarType.from_id", staticmethod(lambda i: "uint4b8"))
    is_padding = torch.zeros(16, dtype=torch.bool)  # the runner's persistent mask
    is_padding[pad_rows] = True
    ctx = create_forward_context(None, VllmConfig(device_config=DeviceConfig(device="cpu")), is_padding=is_padding)
    with override_forward_context(ctx):
        out = f.forward(x)
    real = [m for m in range(M) if m not in pad_rows]
    assert sorted(set(read)) == real  # padded rows read no expert
    (ids_cap,) = captured
    assert (ids_cap[pad_rows] == -1).all() and (ids_cap[real] >= 0).all()
    assert torch.equal(block.experts.router._routing_replay_out[:M], ids_cap.to(torch.int16))

    # upstream semantics
    logits = torch.nn.functional.linear(x.float(), gw.float()).bfloat16()
    w, ids = mf.ref_topk_softmax(logits, k)
    assert torch.equal(ids[real].int(), ids_cap[real])
    routed = torch.stack([torch.stack([(w[t, j] * expert(int(ids[t, j]), x[t])).bfloat16().float()
                                       if t in real else torch.zeros(H) for j in range(k)])
                          for t in range(M)])
    sg = torch.nn.functional.linear(x.float(), sgw.float()).bfloat16().float()[:, 0]
    ref, _ = mf.ref_shared_block(x, u_gu, s_gu, u_dn, s_dn, sg, routed)
    assert out.shape == (M, H) and out.dtype == torch.bfloat16
    assert int(block._moe_fused_counter) == 0
    torch.testing.assert_close(out.float(), ref, rtol=1.6e-2, atol=4e-3)
