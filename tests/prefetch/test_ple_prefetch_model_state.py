"""0150 glue: Qwen4ExpModelState add_request/remove_request feed the prefetcher;
make_prompt_prefetcher reads a host-gathered layer (0100 mmap table view)."""

import logging
import threading

import numpy as np
import pytest
import torch

from vllm.models.qwen4_exp.nvidia import ple_prefetch as pp
from vllm.models.qwen4_exp.nvidia.model_state import Qwen4ExpModelState
from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding as N
from vllm.v1.core.sched.output import NewRequestData

V, EOS = 248_320, 248_044


class FakeMmapEmbedding:
    host_gathered = True
    num_ngram_heads = 16

    def __init__(self, table):
        self.table = table


class FakeNGramModule(torch.nn.Module):
    """The attributes of Qwen4ExpNGramEmbedding the prefetcher reads."""

    def __init__(self, table, dense_id=0):
        super().__init__()
        m = N._make_layer_multipliers(ngram_size=3, unigram_vocab_size=V, seed=1234,
                                      ple_dense_layer_id=dense_id)
        S, O, _ = N._make_vocab_layout(ngram_vocab_size_base=20_000_000, ngram_heads=16,
                                       ple_dense_layer_id=dense_id)
        self.register_buffer("layer_multipliers", torch.tensor(m))
        self.register_buffer("ngram_heads_vocab_sizes", torch.tensor(S))
        self.register_buffer("ngram_heads_offsets", torch.tensor(O))
        self.eos_token_id, self.heads_per_ngram = EOS, 8
        self.ngram_embedding = FakeMmapEmbedding(table)


@pytest.fixture
def table(tmp_path):
    # Small stand-in table: 1M rows x 160 bf16 as int16 (the 0100 view).
    path = tmp_path / "ple.bin"
    with open(path, "wb") as f:
        f.truncate(1_000_000 * 320)
    return np.memmap(path, dtype=np.int16, mode="r", shape=(1_000_000, 160))


def new_req(req_id, tokens, num_computed=0):
    return NewRequestData(
        req_id=req_id, prompt_token_ids=tokens, mm_features=[], sampling_params=None,
        pooling_params=None, block_ids=([],), num_computed_tokens=num_computed,
        lora_request=None, prefill_token_ids=tokens,
    )


def bare_state(prefetcher):
    """A Qwen4ExpModelState without __init__: only what add/remove touch."""
    st = object.__new__(Qwen4ExpModelState)
    st.rope_state = None
    st.prompt_embeds_state = None
    st.num_accepted_tokens_gpu = torch.zeros(8, dtype=torch.int32)
    st._align_mode = False
    st.ple_prefetcher = prefetcher
    return st


def test_make_prompt_prefetcher_uses_loaded_buffers_and_table_view(table):
    mod = FakeNGramModule(table)
    mod.layer_multipliers[1] = 12345  # as if the checkpoint overwrote it
    pf = pp.make_prompt_prefetcher([mod])
    try:
        (reg,) = pf.regions
        assert reg.consts.multipliers[1] == 12345
        assert reg.file_offset == table.ctypes.data and reg.row_bytes == 320
        assert reg.num_rows == 1_000_000 and pf.base_address == 0
        toks = np.random.default_rng(0).integers(0, V, 1500).tolist()
        pf.submit("r", toks, 0)
        assert pf.wait_idle(30) and pf.stats.completed == 1
        assert pf.stats.pages > 0 and pf.stats.bytes_advised > 0
    finally:
        pf.close()


def test_add_and_remove_request_drive_the_prefetcher(table):
    class Rec(pp.WillNeedAdvisor):
        def __init__(self):
            super().__init__()
            self.gate = threading.Event()

        def willneed(self, iov):
            self.gate.wait(10)
            return super().willneed(iov)

    adv = Rec()
    pf = pp.PLEPromptPrefetcher([pp.table_region(FakeNGramModule(table))], 0, advisor=adv,
                                chunk_tokens=256)
    st = bare_state(pf)
    try:
        toks = np.random.default_rng(1).integers(0, V, 4096).tolist()
        st.add_request(0, new_req("a", toks, num_computed=1024))
        st.add_request(1, new_req("b", toks[:300]))
        assert int(st.num_accepted_tokens_gpu[0]) == 1  # the parent ran too
        st.remove_request("b")  # finished/preempted before its turn
        st.remove_request("never-added")
        adv.gate.set()
        assert pf.wait_idle(30)
        assert pf.stats.tokens == 4096 - 1024 and pf.stats.cancelled == 1
        assert pf.pending() == 0
    finally:
        pf.close()


def test_hooks_never_raise_and_off_is_inert(table, caplog):
    class Broken:
        def submit(self, *a):
            raise RuntimeError("boom")

        def cancel(self, *a):
            pass

    st = bare_state(Broken())
    with caplog.at_level(logging.WARNING):
        st.add_request(0, new_req("x", [1, 2, 3]))
        st.add_request(1, new_req("x2", [1, 2, 3]))
    st.remove_request("x")
    assert sum("prefetch submit failed" in r.getMessage() for r in caplog.records) == 1
    off = bare_state(None)  # VLLM_PLE_PREFETCH=0 or no mmap table on this rank
    off.add_request(0, new_req("y", [1, 2, 3]))
    off.remove_request("y")


def test_gate_declared_in_envs(monkeypatch):
    import vllm.envs as envs

    assert "VLLM_PLE_PREFETCH" in envs.environment_variables
    monkeypatch.setenv("VLLM_PLE_PREFETCH", "0")
    assert envs.environment_variables["VLLM_PLE_PREFETCH"]() is False
    monkeypatch.delenv("VLLM_PLE_PREFETCH")
    assert envs.environment_variables["VLLM_PLE_PREFETCH"]() is True


def test_real_mmap_embedding_is_host_gathered():
    """Contract with 0100: the class the model state collects."""
    from vllm.models.qwen4_exp.nvidia import ngram_embedding as ne

    assert ne.Qwen4ExpPLEMmapEmbedding.host_gathered is True
    assert callable(ne.Qwen4ExpPLEMmapEmbedding.stage_rows)
