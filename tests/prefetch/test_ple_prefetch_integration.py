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


def test_add_request_makes_kernel_rows_resident(table, monkeypatch):
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
        pp.drop_file_cache(table)
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
        pages = pp.rows_to_pages(rows, LAYOUT.row_bytes)
        base = emb.table.ctypes.data
        assert base % pp.PAGE_SIZE == 0  # one layer: the table starts the file
        deadline = time.monotonic() + 10
        while True:
            res = pp.resident_pages(base, LAYOUT.file_size)
            if res[pages].all() or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert res[pages].all()
        assert res.sum() <= pages.size + 8  # only those pages (+ startup probe)
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
