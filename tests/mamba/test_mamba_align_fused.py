"""0650-mamba-align-fused (VLLM_MAMBA_ALIGN_FUSED).

In prefix caching's align mode the GDN and PLE short-conv metadata builders
take their state indices from the model state's one-launch
``compute_aligned_state_indices`` (all mamba groups) instead of running
``mamba_get_block_table_tensor`` (7 eager kernels) per group and build.

Everything runs on the CPU: the Triton kernel in the interpreter, the builders
on CPU tensors. What is compared is the upstream function / upstream builder
path against the fused one, on the same inputs.
"""

import dataclasses
import random
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import vllm.envs as envs
import vllm.utils.torch_utils as torch_utils
import vllm.v1.worker.mamba_utils as mamba_utils
from vllm.config import CacheConfig, DeviceConfig, VllmConfig
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
from vllm.v1.attention.backends.short_conv_attn import (
    PleShortConvAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor
from vllm.v1.kv_cache_interface import MambaSpec

BUILDERS = {
    "gdn": (GDNAttentionMetadataBuilder, "gdn_attention"),
    "ple": (PleShortConvAttentionMetadataBuilder, "short_conv"),
}


def _ctx(block_tables, max_num_reqs, num_slots, block_size):
    """A MambaSpecDecodeGPUContext holding only what
    compute_aligned_state_indices reads, filled the way
    initialize_from_forward_context fills it (pointers + one shared stride)."""
    ctx = object.__new__(mamba_utils.MambaSpecDecodeGPUContext)
    strides = {bt.stride(0) for bt in block_tables}
    assert len(strides) == 1
    ctx.block_table_stride_req = strides.pop()
    ctx.block_table_ptrs = torch.tensor(
        [mamba_utils._reinterpret_u64_as_i64(bt.data_ptr()) for bt in block_tables],
        dtype=torch.int64,
    )
    ctx.aligned_state_indices = torch.full(
        (len(block_tables), max_num_reqs, num_slots), -7, dtype=torch.int32
    )
    ctx.block_size = block_size
    ctx.num_groups = len(block_tables)
    ctx.is_initialized = True
    return ctx


@pytest.fixture
def fake_cuda(monkeypatch):
    # compute_aligned_state_indices asserts seq_lens.is_cuda; on this CPU-only
    # runner the kernel runs in the Triton interpreter on CPU tensors.
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    # and the builders' host staging must not try to pin without a driver
    # (PIN_MEMORY is imported by value into several modules)
    for name, mod in list(sys.modules.items()):
        if name.startswith("vllm") and getattr(mod, "PIN_MEMORY", None) is True:
            monkeypatch.setattr(mod, "PIN_MEMORY", False)
    monkeypatch.setattr(torch_utils, "PIN_MEMORY", False)


def _random_case(rng, num_groups, block_size, nspec, num_reqs, max_num_reqs):
    width = rng.randint(1, 6) + nspec  # columns per request row
    tables = [
        torch.randint(0, 1 << 20, (max_num_reqs, width), dtype=torch.int32)
        for _ in range(num_groups)
    ]
    seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32)
    for r in range(num_reqs):
        kind = rng.random()
        if kind < 0.15:
            seq_lens[r] = 0  # graph-padded row
        else:
            # any length whose last 1 + nspec blocks fit the row (the scheduler
            # guarantees this; torch.gather would assert otherwise)
            max_len = (width - nspec) * block_size
            seq_lens[r] = min(
                max_len,
                rng.choice(
                    [1, block_size, block_size + 1, max_len, rng.randint(1, max_len)]
                ),
            )
    return tables, seq_lens


def test_kernel_equals_per_group_gather(fake_cuda):
    """One launch for G groups == G calls of mamba_get_block_table_tensor."""
    rng = random.Random(10)
    for _ in range(40):
        num_groups = rng.choice([1, 2, 3, 7, 19])
        block_size = rng.choice([1, 16, 528, 9776, 12144])
        nspec = rng.choice([0, 0, 1, 3])
        max_num_reqs = rng.choice([1, 4, 33, 48])
        num_reqs = rng.randint(1, max_num_reqs)
        tables, seq_lens = _random_case(
            rng, num_groups, block_size, nspec, num_reqs, max_num_reqs
        )
        spec = MambaSpec(
            block_size=block_size,
            shapes=((1,),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
            num_speculative_blocks=nspec,
        )
        ctx = _ctx(tables, max_num_reqs, 1 + nspec, block_size)
        fused = ctx.compute_aligned_state_indices(seq_lens, num_reqs)
        assert fused.shape == (num_groups, num_reqs, 1 + nspec)
        for g in range(num_groups):
            ref = mamba_get_block_table_tensor(
                tables[g][:num_reqs], seq_lens[:num_reqs], spec, "align"
            )
            assert ref.dtype == fused.dtype
            assert torch.equal(fused[g], ref), (num_groups, block_size, nspec, g)


def _vllm_config(mode):
    return VllmConfig(
        cache_config=CacheConfig(mamba_cache_mode=mode, enable_prefix_caching=True),
        device_config=DeviceConfig(device="cpu"),
    )


def _common(rng, table, seq_lens, num_reqs, max_len):
    """Decodes first, then prefills (the order reorder_batch_threshold=1 gives).
    Raises seq_lens (in place) to at least the query length."""
    num_decodes = rng.randint(0, num_reqs)
    qlens = [1] * num_decodes + [
        rng.randint(2, min(40, max_len)) for _ in range(num_reqs - num_decodes)
    ]
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(qlens, dtype=torch.int32), 0)
    sl = seq_lens[:num_reqs].clone()
    sl = torch.maximum(sl, torch.tensor(qlens, dtype=torch.int32))
    seq_lens[:num_reqs] = sl
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=sl,
        seq_lens_cpu_upper_bound=sl.clone(),
        num_reqs=num_reqs,
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(qlens),
        max_seq_len=int(sl.max()),
        block_table_tensor=table[:num_reqs],
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        is_prefilling=torch.tensor(qlens) > 1,
    )


def _equal_metadata(a, b):
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor), f.name
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        elif f.name != "nums_dict":
            assert x == y, f.name


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_builders_fused_equal_upstream(kind, fake_cuda, monkeypatch):
    """Builder metadata with the precomputed rows == builder metadata from
    the upstream per-group gather, for random groups / block sizes / mixes."""
    monkeypatch.setenv("VLLM_MAMBA_ALIGN_FUSED", "1")
    cls, mamba_type = BUILDERS[kind]
    rng = random.Random(hash(kind) & 0xFFFF)
    vc = _vllm_config("align")
    for _ in range(12):
        num_groups = rng.choice([1, 2, 5])
        block_size = rng.choice([16, 64, 528])
        max_num_reqs = 8
        num_reqs = rng.randint(1, max_num_reqs)
        tables, seq_lens = _random_case(rng, num_groups, block_size, 0, num_reqs, 8)
        spec = MambaSpec(
            block_size=block_size,
            shapes=((1,),),
            dtypes=(torch.float32,),
            mamba_type=mamba_type,
            mamba_cache_mode="align",
        )
        builders = [cls(spec, [f"l{g}"], vc, torch.device("cpu")) for g in range(2)]
        fused_b, ref_b = builders
        assert fused_b.mamba_aligned_state_indices is None
        ctx = _ctx(tables, max_num_reqs, 1, block_size)
        g = rng.randrange(num_groups)
        m = _common(rng, tables[g], seq_lens, num_reqs, tables[g].shape[1] * block_size)
        all_groups = ctx.compute_aligned_state_indices(seq_lens, num_reqs)
        # what MambaHybridModelState.prepare_attn does for a builder with the
        # attribute
        fused_b.mamba_aligned_state_indices = all_groups[g]
        del ref_b.mamba_aligned_state_indices  # upstream builder: no attribute
        got = fused_b.build(0, m)
        want = ref_b.build(0, m)
        _equal_metadata(got, want)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_gate(kind, monkeypatch):
    """=1 (default): builders declare the attribute the model state looks for
    (hasattr, mamba_hybrid.py:296); =0 or not align mode: they don't, so the
    model state launches nothing and the upstream per-group path runs."""
    cls, mamba_type = BUILDERS[kind]
    spec = MambaSpec(
        block_size=16,
        shapes=((1,),),
        dtypes=(torch.float32,),
        mamba_type=mamba_type,
        mamba_cache_mode="align",
    )
    for value, mode, expected in [
        (None, "align", True),
        ("1", "align", True),
        ("0", "align", False),
        ("1", "none", False),
    ]:
        if value is None:
            monkeypatch.delenv("VLLM_MAMBA_ALIGN_FUSED", raising=False)
        else:
            monkeypatch.setenv("VLLM_MAMBA_ALIGN_FUSED", value)
        assert envs.VLLM_MAMBA_ALIGN_FUSED == (value != "0")
        b = cls(spec, ["l0"], _vllm_config(mode), torch.device("cpu"))
        assert hasattr(b, "mamba_aligned_state_indices") == expected, (value, mode)


class _CountKernels(TorchDispatchMode):
    """Counts aten ops that launch a kernel on a CUDA tensor: views and
    .item() reads are not counted, in-place and out-of-place compute ops are."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        returns = func._schema.returns
        is_view = bool(returns) and all(
            r.alias_info is not None and not r.alias_info.is_write for r in returns
        )
        if not is_view and func.__name__ not in ("_local_scalar_dense.default",):
            self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_launch_count_per_step(kind, fake_cuda, monkeypatch):
    """Per step, G mamba groups: upstream = 7 eager ops per group build;
    fused = 0 per build + 1 Triton launch for all groups. Counted: aten
    compute ops dispatched inside build() (each one CUDA kernel on device
    tensors; views and .item() excluded) and launches of the Triton kernel."""
    monkeypatch.setenv("VLLM_MAMBA_ALIGN_FUSED", "1")
    launches = []
    real = mamba_utils.get_aligned_state_indices_multi_group_kernel

    class _Wrap:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(
        mamba_utils, "get_aligned_state_indices_multi_group_kernel", _Wrap()
    )
    vc = _vllm_config("align")
    num_groups, num_reqs, block_size = 7, 4, 16
    tables = [
        torch.randint(0, 1 << 20, (num_reqs, 5), dtype=torch.int32)
        for _ in range(num_groups)
    ]
    seq_lens = torch.tensor([17, 40, 3, 64], dtype=torch.int32)
    spec = MambaSpec(
        block_size=block_size,
        shapes=((1,),),
        dtypes=(torch.float32,),
        mamba_type=BUILDERS[kind][1],
        mamba_cache_mode="align",
    )
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32)  # 4 decodes

    def common(g):
        return CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl,
            seq_lens=seq_lens[:num_reqs],
            seq_lens_cpu_upper_bound=seq_lens[:num_reqs],
            num_reqs=num_reqs,
            num_actual_tokens=num_reqs,
            max_query_len=1,
            max_seq_len=64,
            block_table_tensor=tables[g][:num_reqs],
            slot_mapping=torch.zeros(num_reqs, dtype=torch.int64),
            is_prefilling=torch.zeros(num_reqs, dtype=torch.bool),
        )

    def step(fused):
        builders = [
            BUILDERS[kind][0](spec, [f"l{g}"], vc, torch.device("cpu"))
            for g in range(num_groups)
        ]
        # The model state's one launch (prepare_attn, mamba_hybrid.py:296-306)
        # is counted by the wrapper; the interpreter's own torch calls are
        # kept out of the aten count.
        if fused:
            ctx = _ctx(tables, num_reqs, 1, block_size)
            all_groups = ctx.compute_aligned_state_indices(seq_lens, num_reqs)
            for g, b in enumerate(builders):
                b.mamba_aligned_state_indices = all_groups[g]
        else:
            for b in builders:
                del b.mamba_aligned_state_indices
        counter = _CountKernels()
        with counter:
            out = [b.build(0, common(g)) for g, b in enumerate(builders)]
        return counter.ops, out

    ops_up, out_up = step(fused=False)
    assert launches == []
    # VLLM_MAMBA_ALIGN_FUSED=0: no attribute (so MambaHybridModelState skips
    # its launch) and the builds dispatch exactly the upstream ops.
    monkeypatch.setenv("VLLM_MAMBA_ALIGN_FUSED", "0")
    builders_off = [
        BUILDERS[kind][0](spec, [f"l{g}"], vc, torch.device("cpu"))
        for g in range(num_groups)
    ]
    assert not any(hasattr(b, "mamba_aligned_state_indices") for b in builders_off)
    counter = _CountKernels()
    with counter:
        out_off = [b.build(0, common(g)) for g, b in enumerate(builders_off)]
    assert counter.ops == ops_up
    for a, b in zip(out_up, out_off):
        _equal_metadata(a, b)
    monkeypatch.setenv("VLLM_MAMBA_ALIGN_FUSED", "1")
    ops_fused, out_fused = step(fused=True)
    assert len(launches) == 1
    for a, b in zip(out_up, out_fused):
        _equal_metadata(a, b)
    per_group_up = [
        "sub",
        "floor_divide",
        "clamp_",
        "arange",
        "add",
        "_to_copy",
        "gather",
    ]
    # Everything else the builds do is the same in both paths.
    removed = list(ops_up)
    for op in ops_fused:
        removed.remove(op)
    assert sorted(removed) == sorted(per_group_up * num_groups), removed
    print(
        f"\n{num_groups} {kind} groups, 4 decodes: upstream {len(ops_up)} aten "
        f"kernels in build, fused {len(ops_fused)} aten + {len(launches)} Triton"
    )


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_builders_spec_decode_equal_upstream(kind, fake_cuda, monkeypatch):
    """Same with MTP: 1 + nspec state slots per request, spec-decode rows
    (query 1 + nspec, draft count >= 0) mixed with prefills."""
    monkeypatch.setenv("VLLM_MAMBA_ALIGN_FUSED", "1")
    cls, mamba_type = BUILDERS[kind]
    rng = random.Random(77 + len(kind))
    for _ in range(8):
        nspec = rng.choice([1, 2, 3])
        vc = _vllm_config("align")
        # only these two fields are read by the builders
        spec_cfg = SimpleNamespace(
            num_speculative_tokens=nspec, parallel_drafting=False
        )
        object.__setattr__(vc, "speculative_config", spec_cfg)
        num_groups = rng.choice([1, 3])
        block_size = rng.choice([16, 64])
        num_reqs = rng.randint(1, 6)
        tables, seq_lens = _random_case(rng, num_groups, block_size, nspec, num_reqs, 6)
        width = tables[0].shape[1]
        max_len = (width - nspec) * block_size
        num_spec = rng.randint(1, num_reqs)
        qlens = [1 + nspec] * num_spec + [
            rng.randint(2, min(40, max_len)) for _ in range(num_reqs - num_spec)
        ]
        seq_lens[:num_reqs] = torch.maximum(
            seq_lens[:num_reqs], torch.tensor(qlens, dtype=torch.int32)
        ).clamp_(max=max_len)
        drafts = torch.tensor(
            [nspec] * num_spec + [-1] * (num_reqs - num_spec), dtype=torch.int32
        )
        qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(qlens, dtype=torch.int32), 0)
        spec = MambaSpec(
            block_size=block_size,
            shapes=((1,),),
            dtypes=(torch.float32,),
            mamba_type=mamba_type,
            mamba_cache_mode="align",
            num_speculative_blocks=nspec,
        )
        g = rng.randrange(num_groups)
        sl = seq_lens[:num_reqs].clone()
        m = CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl.clone(),
            seq_lens=sl,
            seq_lens_cpu_upper_bound=sl.clone(),
            num_reqs=num_reqs,
            num_actual_tokens=int(qsl[-1]),
            max_query_len=max(qlens),
            max_seq_len=int(sl.max()),
            block_table_tensor=tables[g][:num_reqs],
            slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
            is_prefilling=torch.tensor(qlens) > 1 + nspec,
        )
        fused_b, ref_b = (cls(spec, ["l0"], vc, torch.device("cpu")) for _ in "ab")
        ctx = _ctx(tables, 6, 1 + nspec, block_size)
        fused_b.mamba_aligned_state_indices = ctx.compute_aligned_state_indices(
            seq_lens, num_reqs
        )[g]
        del ref_b.mamba_aligned_state_indices
        kw = dict(
            num_accepted_tokens=torch.ones(num_reqs, dtype=torch.int32),
            num_decode_draft_tokens_cpu=drafts,
        )
        got = fused_b.build(0, m, **kw)
        want = ref_b.build(0, m, **kw)
        _equal_metadata(got, want)
        # the spec-decode branch really ran
        assert got.spec_state_indices_tensor is not None
        if kind == "gdn":
            assert got.spec_state_indices_tensor.shape[1] == 1 + nspec
        else:
            assert got.num_spec_decodes == num_spec
