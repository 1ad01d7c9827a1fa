"""vit-stream (VLLM_VIT_STREAM): double-buffered ViT blocks on the CPU.

Uses the real qwen3_vl Qwen3_VisionBlock (@support_torch_compile) at width 64
with a real single-process gloo parallel state; CustomOps run their native
path (the CUDA rotary kernel cannot run here).
"""

import copy
import socket
import types

import pytest
import torch
from torch import nn

from vit_stream_check import check_trace


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vc():
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(cfg):
        ps.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{_port()}")
        ps.initialize_model_parallel(1, 1, backend="gloo")
        try:
            yield cfg
        finally:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


def _native(mod: nn.Module) -> nn.Module:
    from vllm.model_executor.custom_op import CustomOp

    for m in mod.modules():
        if isinstance(m, CustomOp):
            m._forward_method = m.forward_native
    return mod


def _blocks(vc, depth: int, dim=64, heads=4, mlp=128) -> nn.ModuleList:
    from vllm.model_executor.models.qwen3_vl import Qwen3_VisionBlock

    torch.manual_seed(0)
    blocks = nn.ModuleList(
        _native(Qwen3_VisionBlock(dim=dim, num_heads=heads, mlp_hidden_dim=mlp,
                                  vllm_config=vc, prefix=f"blocks.{i}"))
        for i in range(depth))
    for p in blocks.parameters():
        p.data.normal_(0, 0.05)
    return blocks


def _run(blocks, x):
    t = x.shape[0]
    kw = dict(cu_seqlens=torch.tensor([0, 7, t], dtype=torch.int32),
              rotary_pos_emb_cos=torch.ones(t, 8) * 0.6,
              rotary_pos_emb_sin=torch.ones(t, 8) * 0.8,
              max_seqlen=torch.tensor(t - 7), sequence_lengths=None)
    for blk in blocks:
        x = blk(x, **kw)
    return x


@pytest.mark.parametrize("depth", [2, 3, 5])
def test_stream_matches_resident_real_blocks(vc, depth):
    from vllm.models.qwen4_exp.nvidia.vit_stream import ViTBlockStreamer

    resident = _blocks(vc, depth)
    streamed = _blocks(vc, depth)  # same seed: same weights
    # support_torch_compile replaced __call__: block hooks would not fire.
    assert type(streamed[0]).__call__ is not nn.Module.__call__
    assert streamed[0].do_not_compile
    trace = []
    st = ViTBlockStreamer(streamed, torch.device("cpu"), trace=trace)
    st.install()
    # The swap must really happen: the fc1 weight a block computes with lies
    # in slot i % 2 (child-Linear hooks still fire).
    seen = []
    for i, blk in enumerate(streamed):
        blk.mlp.linear_fc1.register_forward_pre_hook(
            lambda m, a, _i=i: seen.append((_i, m.weight.data_ptr())))
    x = torch.randn(13, 1, 64)
    ref = _run(resident, x)
    for call in range(2):  # second call: slots reused across forwards
        seen.clear()
        out = _run(streamed, x)
        assert torch.equal(out, ref)
        for i, ptr in seen:
            slot = st.slots[st.slot_of(i)]
            assert slot.data_ptr() <= ptr < slot.data_ptr() + slot.numel()
        assert [i for i, _ in seen] == list(range(depth))
    # Outside forward, params are views of the host pack again.
    for blk, pack in zip(streamed, st.packs):
        for p in blk.parameters():
            h = pack.host
            assert h.data_ptr() <= p.data_ptr() < h.data_ptr() + h.numel()
    assert check_trace(trace) == []
    n_copies = sum(e.op == "copy" for e in trace)
    # depth 2: both stay in their slots; depth 3: block 1 is still in slot 1
    # at the second call; depth 5: every block is copied on every call.
    assert n_copies == {2: 2, 3: 5, 5: 10}[depth]


def test_slot_reuse_order_and_checker_catches_missing_waits(vc):
    from vllm.models.qwen4_exp.nvidia.vit_stream import ViTBlockStreamer

    blocks = _blocks(vc, 6)
    trace = []
    st = ViTBlockStreamer(blocks, torch.device("cpu"), trace=trace)
    st.install()
    x = torch.randn(13, 1, 64)
    _run(blocks, x)
    _run(blocks, x)
    assert check_trace(trace) == []
    # Block i+1 is copied after block i's compute was issued (prefetch
    # while i runs) and into the other slot.
    order = [(e.op, e.block, e.slot) for e in trace if e.op in ("copy", "compute")]
    assert order[:7] == [("copy", 0, 0), ("copy", 1, 1), ("compute", 0, 0),
                         ("copy", 2, 0), ("compute", 1, 1), ("copy", 3, 1),
                         ("compute", 2, 0)]
    for k, (op, b, s) in enumerate(order):
        if op == "compute" and b + 1 < 6:
            assert ("copy", b + 1, (b + 1) % 2) in order[:k + 2]
    # Mutants: drop the side-stream slot-free wait, or the compute wait on
    # the copy -> the checker must report a race.
    for drop in ("side", "compute"):
        bad = []
        st2 = ViTBlockStreamer(_blocks(vc, 4), torch.device("cpu"), trace=bad)
        real_wait = st2.ops.wait
        st2.ops.wait = (lambda s, e, _d=drop, _w=real_wait:
                        None if s == _d else _w(s, e))
        st2.install()
        _run(st2.blocks, x)
        _run(st2.blocks, x)
        assert check_trace(bad), f"missing {drop} waits not detected"


def test_pack_keeps_dtypes_and_alignment(vc):
    from vllm.models.qwen4_exp.nvidia.vit_stream import ViTBlockStreamer

    blk = nn.Sequential(nn.Linear(5, 3), nn.LayerNorm(3))
    blk[1].to(torch.bfloat16)
    vals = [p.detach().clone() for p in blk.parameters()]
    st = ViTBlockStreamer([blk, copy.deepcopy(blk)], torch.device("cpu"))
    for (p, off, _), v in zip(st.packs[0].params, vals):
        assert off % 256 == 0
        assert torch.equal(p.data, v) and p.dtype == v.dtype
    with pytest.raises(ValueError):
        ViTBlockStreamer([blk], torch.device("cpu"), num_slots=1)


def test_gate(monkeypatch):
    from vllm.compilation.passes import __name__ as _  # noqa: F401 (import order)
    from vllm.models.qwen4_exp.nvidia.vit_stream import stream_enabled

    cc = types.SimpleNamespace(compile_mm_encoder=False,
                               cudagraph_mm_encoder=False)
    cfg = types.SimpleNamespace(compilation_config=cc)
    monkeypatch.delenv("VLLM_VIT_STREAM", raising=False)
    assert stream_enabled(cfg) is True  # default on
    monkeypatch.setenv("VLLM_VIT_STREAM", "0")
    assert stream_enabled(cfg) is False
    monkeypatch.setenv("VLLM_VIT_STREAM", "1")
    cc.compile_mm_encoder = True  # override bypassed when compiled
    assert stream_enabled(cfg) is False
    cc.compile_mm_encoder, cc.cudagraph_mm_encoder = False, True
    assert stream_enabled(cfg) is False


class _TinyViT(nn.Module):
    """The shape setup_visual relies on: blocks + resident parts."""

    def __init__(self, vc):
        super().__init__()
        torch.manual_seed(1)
        self.patch_embed = nn.Linear(4, 64)
        self.blocks = _blocks(vc, 3)
        torch.manual_seed(2)
        self.merger = nn.Linear(64, 8)

    def forward(self, x):
        return self.merger(_run(self.blocks, self.patch_embed(x)))


@pytest.mark.parametrize("gate", ["1", "0"])
def test_model_glue_both_gates(vc, monkeypatch, gate):
    """Qwen4ExpForConditionalGeneration: tower built on the CPU under the
    target device and streamed after load when on; untouched when off."""
    from vllm.models.qwen4_exp.nvidia.model import (
        Qwen4ExpForConditionalGeneration as M)

    monkeypatch.setenv("VLLM_VIT_STREAM", gate)
    m = M.__new__(M)
    nn.Module.__init__(m)
    mm = types.SimpleNamespace(get_limit_per_prompt=lambda mod: 1,
                               mm_encoder_only=False)
    cfg = types.SimpleNamespace(
        compilation_config=vc.compilation_config,
        model_config=types.SimpleNamespace(get_multimodal_config=lambda: mm))
    with torch.device("meta"):  # stands in for the load target (cuda)
        with m._mark_tower_model(cfg, {"image", "video"}):
            m.visual = _TinyViT(vc)
        m.language_model = nn.Linear(2, 2)
    assert m._tower_model_names == ["visual"]
    dev = m.visual.blocks[0].mlp.linear_fc1.weight.device.type
    assert dev == ("cpu" if gate == "1" else "meta")
    if gate == "0":
        m.process_weights_after_loading()
        assert not hasattr(m, "_vit_streamer")
        assert all("forward" not in b.__dict__ for b in m.visual.blocks)
        return
    m.language_model.to_empty(device="cpu")  # device the ViT parts move to
    ref = _TinyViT(vc)
    m.process_weights_after_loading()
    assert all("forward" in b.__dict__ for b in m.visual.blocks)
    x = torch.randn(13, 1, 4)
    assert torch.equal(m.visual(x), ref(x))


def test_one_exact_size_host_buffer(vc):
    """All packs live in one buffer of exactly packs_layout's bytes (on the
    GPU path 0210's pool), each block's pack a slice of it at its start."""
    from vllm.models.qwen4_exp.nvidia import vit_stream as vs

    blocks = _blocks(vc, 3)
    sizes = [[p.numel() * p.element_size() for p in b.parameters()] for b in blocks]
    starts, total = vs.packs_layout(sizes)
    st = vs.ViTBlockStreamer(blocks, torch.device("cpu"))
    assert st.host_buffer.nbytes == total
    base = st.host_buffer.data_ptr()
    for pack, start, sz in zip(st.packs, starts, sizes):
        assert pack.host.data_ptr() - base == start and start % 256 == 0
        assert pack.host.numel() == vs.pack_offsets(sz)[1]
    assert st.slot_bytes == vs.slot_bytes_for(sizes) == max(vs.pack_offsets(s)[1] for s in sizes)
    # nothing on the CPU path goes through torch's pinned cache
    assert st.repinned_freed == 0


def test_vit_path_says_which_path_runs(monkeypatch):
    from vllm.models.qwen4_exp.nvidia.vit_stream import vit_path

    limit = {"image": 4, "video": 0}
    mm = types.SimpleNamespace(get_limit_per_prompt=lambda m: limit[m])
    cc = types.SimpleNamespace(compile_mm_encoder=False, cudagraph_mm_encoder=False)
    cfg = types.SimpleNamespace(compilation_config=cc,
                                model_config=types.SimpleNamespace(get_multimodal_config=lambda: mm))
    monkeypatch.setenv("VLLM_VIT_STREAM", "1")
    assert vit_path(cfg) == (True, vit_path(cfg)[1]) and "streamed" in vit_path(cfg)[1]
    cc.compile_mm_encoder = True
    on, why = vit_path(cfg)
    assert not on and "compile_mm_encoder" in why and "no effect" in why
    cc.compile_mm_encoder = False
    limit["image"] = 0
    on, why = vit_path(cfg)
    assert not on and "not built" in why


def test_images_limited_to_zero_builds_nothing_on_the_host(vc, monkeypatch):
    """limit 0 for every modality: upstream's placeholder wraps a tower built
    on the meta device; the streaming CPU context must not override that."""
    from vllm.model_executor.models.utils import StageMissingLayer
    from vllm.models.qwen4_exp.nvidia import vit_stream as vs
    from vllm.models.qwen4_exp.nvidia.model import (
        Qwen4ExpForConditionalGeneration as M)

    monkeypatch.setenv("VLLM_VIT_STREAM", "1")
    said = []
    monkeypatch.setattr(vs, "log_vit_path", said.append)
    m = M.__new__(M)
    nn.Module.__init__(m)
    mm = types.SimpleNamespace(get_limit_per_prompt=lambda mod: 0, mm_encoder_only=False)
    cfg = types.SimpleNamespace(
        compilation_config=vc.compilation_config,
        model_config=types.SimpleNamespace(get_multimodal_config=lambda: mm))
    with m._mark_tower_model(cfg, {"image", "video"}):
        m.visual = _TinyViT(vc)
    assert isinstance(m.visual, StageMissingLayer)
    inner = m.visual.__dict__["module"]
    assert {p.device.type for p in inner.parameters()} == {"meta"}
    assert not m._vit_stream and said and "not built" in said[0]
