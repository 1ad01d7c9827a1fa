"""0150/0160 with the real 0100 classes: a Qwen4ExpNGramEmbedding on an mmap'd
table file, the real Qwen4ExpModelState (base init stubbed), the real hash
kernel (interpreted Triton). The pages of the kernel's row ids for a prompt
become resident after add_request; a decode-sized stage_host_rows issues one
process_madvise; both gates off restore the plain path."""

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import vllm.models.qwen4_exp.nvidia.model_state as ms
import vllm.models.qwen4_exp.nvidia.ngram_embedding as ne
from vllm import ple_table_format as ptf
from vllm.models.qwen4_exp.config import Qwen4ExpTextConfig
from vllm.models.qwen4_exp.nvidia import ple_prefetch as pp
from vllm.models.qwen4_exp.nvidia.ops.ple import ple_ngram_ids
from vllm.v1.core.sched.output import NewRequestData

# One PLE layer, 16 heads x 160 bf16 = 320 B rows as in production; primes
# near 20,000 -> ~320k rows, a 102 MB sparse file.
TEXT_CONFIG = dict(
    num_hidden_layers=2, hidden_size=64, ple_layer_ids=[1], ple_embed_dim=2560,
    ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=20_000,
    make_ngram_vocab_size_divisible_by=128, split_ngram_parts=4, vocab_size=1000,
    eos_token_id=7,
)
CONFIG = Qwen4ExpTextConfig(**TEXT_CONFIG)
LAYOUT = ptf.layout_from_config(CONFIG)
EOS = 7


@pytest.fixture(autouse=True)
def single_rank(monkeypatch):
    group = SimpleNamespace(world_size=1, rank_in_group=0)
    monkeypatch.setattr(ne, "get_etp_group", lambda: group)
    monkeypatch.setattr(ne, "get_tp_group", lambda: group)
    monkeypatch.setattr(
        ne, "get_current_vllm_config", lambda: SimpleNamespace(engram_config=None)
    )


@pytest.fixture
def table(tmp_path, monkeypatch):
    path = tmp_path / "ple.bin"
    with open(path, "wb") as f:
        f.truncate(LAYOUT.file_size)
    monkeypatch.setenv("VLLM_PLE_MMAP_PATH", str(path))
    return str(path)


def build():
    return ne.Qwen4ExpNGramEmbedding(
        CONFIG, 2560, 0, 16, data_parallel_rank=0,
        prefix="model.layers.0.ple.ple_embedding", params_dtype=torch.bfloat16,
    )


class Model(torch.nn.Module):
    def __init__(self, modules):
        super().__init__()
        self.ples = torch.nn.ModuleList(modules)


def state_for(monkeypatch, model, pp_size=3):
    def fake_base_init(self, vllm_config, model, encoder_cache, device):
        self.model_config = vllm_config.model_config
        self.max_num_reqs = 4
        self.device = device
        self.rope_state = None
        self.prompt_embeds_state = None
        self.num_accepted_tokens_gpu = torch.zeros(4, dtype=torch.int32)
        self._align_mode = False

    monkeypatch.setattr(ms.MambaHybridModelState, "__init__", fake_base_init)
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=CONFIG),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp_size),
    )
    return ms.Qwen4ExpModelState(cfg, model, None, torch.device("cpu"))


def kernel_rows(mod, tokens):
    t = torch.tensor(tokens, dtype=torch.int32)
    return ple_ngram_ids(
        t, torch.tensor([0, len(tokens)], dtype=torch.int32),
        torch.full((1, 2), EOS, dtype=torch.int32), mod.layer_multipliers,
        mod.ngram_heads_vocab_sizes, mod.ngram_heads_offsets, EOS, 8,
    ).numpy()


def test_add_request_advises_exactly_the_kernel_rows_pages(table, monkeypatch):
    """What is guaranteed: the prefetcher asks the kernel for exactly the
    pages of the rows the real hash kernel produces (recorded at the
    syscall), and the kernel accepts them. Residency afterwards is readahead,
    best-effort: it is not asserted (a loaded host missed a deadline)."""
    mod = build()
    emb = mod.ngram_embedding
    assert isinstance(emb, ne.Qwen4ExpPLEMmapEmbedding)
    mod.layer_multipliers[2] += 2  # a checkpoint may overwrite the hash buffers
    state = state_for(monkeypatch, Model([mod]))
    pf = state.ple_prefetcher
    assert pf is not None
    try:
        if pf.advisor.use_fallback:
            pytest.skip(pf.advisor.fallback_reason)
        advised = []
        real = pf.advisor._syscall

        def record(pidfd, ptr, n, advice, flags):
            import ctypes

            arr = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * n)).from_address(ptr))
            advised.append(arr.reshape(n, 2).copy())
            return real(pidfd, ptr, n, advice, flags)

        pf.advisor._syscall = record
        tokens = np.random.default_rng(0).integers(0, 1000, 200).tolist()
        tokens[50] = EOS
        nrd = NewRequestData(
            req_id="r", prompt_token_ids=tokens, mm_features=[], sampling_params=None,
            pooling_params=None, block_ids=([],), num_computed_tokens=0,
            lora_request=None, prefill_token_ids=tokens,
        )
        state.add_request(0, nrd)
        assert pf.wait_idle(30) and pf.stats.completed == 1
        rows = kernel_rows(mod, tokens)  # the real kernel, loaded buffers
        pages = set(pp.rows_to_pages(rows, LAYOUT.row_bytes).tolist())
        base = emb.table.ctypes.data
        assert base % pp.PAGE_SIZE == 0  # one layer: the table starts the file
        got = set()
        for iov in advised:
            for start, length in iov.tolist():
                first = (start - base) // pp.PAGE_SIZE
                got.update(range(first, first + length // pp.PAGE_SIZE))
        assert got == pages
        assert pf.stats.bytes_advised == len(pages) * pp.PAGE_SIZE
        state.remove_request("r")
        state.remove_request("r")  # idempotent
    finally:
        pf.close()


def test_decode_stage_issues_one_process_madvise(table, monkeypatch):
    mod = build()
    g = mod.ngram_embedding.gather_willneed
    assert isinstance(g, pp.GatherWillNeed)
    calls0 = g.advisor.calls + g.advisor.fallback_calls
    ids = torch.tensor([1, 2, 3, EOS], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32)
    ctx = torch.full((4, 2), EOS, dtype=torch.int32)
    mod.stage_host_rows(ids, qsl, ctx)  # 4 decode tokens x 16 rows
    used = g.advisor.calls + g.advisor.fallback_calls - calls0
    assert used == (1 if not g.advisor.use_fallback else 64)


def test_gates_off(table, monkeypatch):
    monkeypatch.setenv("VLLM_PLE_GATHER_MADVISE", "0")
    monkeypatch.setenv("VLLM_PLE_PREFETCH", "0")
    mod = build()
    assert mod.ngram_embedding.gather_willneed is None
    state = state_for(monkeypatch, Model([mod]))
    assert state.ple_prefetcher is None
    ids = torch.tensor([1, 2], dtype=torch.int32)
    mod.stage_host_rows(ids, torch.tensor([0, 2], dtype=torch.int32),
                        torch.full((1, 2), EOS, dtype=torch.int32))


def test_no_prefetcher_without_mmap_table(monkeypatch):
    monkeypatch.delenv("VLLM_PLE_MMAP_PATH", raising=False)
    state = state_for(monkeypatch, Model([build()]), pp_size=1)  # upstream table
    assert state.host_gathered_ple == [] and state.ple_prefetcher is None


def host_batch_inputs(state, reqs, pad_to=None):
    """An InputBatch's host fields for prefill chunks ``reqs`` = [(req_id,
    start, n, prefill_len, prefilling)], padded to ``pad_to`` tokens."""
    qsl = np.zeros(len(reqs) + 1, dtype=np.int32)
    qsl[1:] = np.cumsum([r[2] for r in reqs])
    total = int(qsl[-1])
    return SimpleNamespace(
        num_reqs=len(reqs),
        req_ids=[r[0] for r in reqs],
        num_computed_tokens_np=np.array([r[1] for r in reqs], dtype=np.int32),
        prefill_len_np=np.array([r[3] for r in reqs], dtype=np.int32),
        is_prefilling_np=np.array([r[4] for r in reqs]),
        query_start_loc_np=qsl,
        num_tokens_after_padding=pad_to or total,
    )


def add(state, req_id, tokens, index):
    state.add_request(index, NewRequestData(
        req_id=req_id, prompt_token_ids=tokens, mm_features=[], sampling_params=None,
        pooling_params=None, block_ids=([],), num_computed_tokens=0,
        lora_request=None, prefill_token_ids=tokens,
    ))


def test_prefill_step_hashes_on_the_host_bit_exact(table, monkeypatch):
    """0170: a step of prefill chunks stages the same rows from host-hashed
    ids as from the kernel + D2H path, for every real token (two requests,
    mid-prompt chunks, an EOS in the context, padding)."""
    monkeypatch.setenv("VLLM_PLE_PREFETCH", "0")
    mod = build()
    mod.layer_multipliers[1] += 4  # loaded buffers, not the config's
    state = state_for(monkeypatch, Model([mod]))
    assert state.ple_host_tokens == {}
    rng = np.random.default_rng(5)
    a = rng.integers(0, 1000, 300).tolist()
    b = rng.integers(0, 1000, 40).tolist()
    a[99] = EOS  # context of a's chunk at 100 holds an EOS
    add(state, "a", a, 0)
    add(state, "b", b, 1)
    # 16 tokens: the layer's max_total_tokens in build().
    ib = host_batch_inputs(state, [("a", 100, 7, 300, True), ("b", 0, 6, 40, True)], pad_to=16)
    host = state._ple_host_batch(ib)
    assert host is not None
    ids, qsl, ctx = host
    # The kernel path on the same step: the device-side inputs the runner has.
    dev_ids = torch.tensor(ids, dtype=torch.int32)
    dev_qsl = torch.tensor(qsl, dtype=torch.int32)
    dev_ctx = torch.tensor(ctx, dtype=torch.int32)
    emb = mod.ngram_embedding
    mod.stage_host_rows(dev_ids, dev_qsl, dev_ctx)
    want = emb.device_rows[:13].clone()
    emb.device_rows.zero_()
    d2h = []
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t: d2h.append(1) or t.clone())
    mod.stage_host_rows(dev_ids, dev_qsl, dev_ctx, host_batch=host)
    assert len(d2h) == 3  # the hash buffers, read once after loading
    d2h.clear()
    mod.stage_host_rows(dev_ids, dev_qsl, dev_ctx, host_batch=host)
    assert d2h == []  # no device-to-host copy of the ids per step
    assert torch.equal(emb.device_rows[:13], want)
    # And the kernel's ids for request a's chunk are what the host path used.
    rows_a = kernel_rows(mod, a)[100:107]
    from vllm.models.qwen4_exp.nvidia.ple_prefetch import PLEHashConstants, ngram_row_ids

    host_rows = ngram_row_ids(ids, qsl, ctx, PLEHashConstants.from_module(mod))
    assert np.array_equal(host_rows[:7], rows_a)


def test_host_ids_only_for_prefill_only_steps(table, monkeypatch):
    monkeypatch.setenv("VLLM_PLE_PREFETCH", "0")
    mod = build()
    state = state_for(monkeypatch, Model([mod]))
    toks = list(range(10, 60))
    add(state, "a", toks, 0)
    add(state, "d", toks, 1)
    # A decode request in the step: its token may exist only on the GPU.
    mixed = host_batch_inputs(state, [("a", 0, 8, 50, True), ("d", 50, 1, 50, False)])
    assert state._ple_host_batch(mixed) is None
    # A chunk that runs past the tokens known at add_request.
    past = host_batch_inputs(state, [("a", 45, 8, 50, True)])
    assert state._ple_host_batch(past) is None
    # An unknown request (added before this state existed).
    unknown = host_batch_inputs(state, [("zz", 0, 8, 50, True)])
    assert state._ple_host_batch(unknown) is None
    state.remove_request("a")
    assert "a" not in state.ple_host_tokens
    # Gate off: upstream path, nothing kept.
    monkeypatch.setenv("VLLM_PLE_HOST_IDS", "0")
    off = state_for(monkeypatch, Model([build()]))
    assert off.ple_host_tokens is None


def test_decode_positions_of_a_mixed_step(table, monkeypatch):
    monkeypatch.setenv("VLLM_PLE_PREFETCH", "0")
    state = state_for(monkeypatch, Model([build()]))
    ib = host_batch_inputs(state, [("a", 0, 30, 50, True), ("d", 9, 2, 9, False),
                                   ("e", 9, 1, 9, False)])
    assert state._decode_token_positions(ib).tolist() == [30, 31, 32]
    only_prefill = host_batch_inputs(state, [("a", 0, 30, 50, True)])
    assert state._decode_token_positions(only_prefill) is None
