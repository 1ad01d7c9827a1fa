"""0160: decode-step gather madvise (GatherWillNeed) and its stage_rows hook."""

import ctypes
import logging
import os

import numpy as np
import pytest
import torch

from vllm.models.qwen4_exp.nvidia import ple_prefetch as pp


@pytest.fixture
def table_file(tmp_path):
    path = tmp_path / "table.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(4 << 20))
    pp.drop_file_cache(str(path))
    return str(path)


def recorder(seen):
    def record(pidfd, ptr, n, advice, flags):
        arr = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * n)).from_address(ptr))
        arr = arr.reshape(n, 2)
        seen.append((ptr, arr.copy(), advice))
        return int(arr[:, 1].sum()), 0

    return record


def test_gather_willneed_one_iovec_per_row(table_file):
    m = pp.ReadOnlyMapping(table_file)
    seen = []
    adv = pp.WillNeedAdvisor(syscall=recorder(seen))
    g = pp.GatherWillNeed(m.address, 320, max_rows=64, file_offset=4096, num_rows=13000, advisor=adv)
    rows = np.array([[0, 12, 11, 99], [12799, 5, 5, 100]])
    done = g.advise_rows(rows)
    ptr, iov, advice = seen[-1]
    assert advice == pp.MADV_WILLNEED and len(seen) == 1
    assert ptr == g.iov.ctypes.data  # the preallocated array, not a copy
    want = []
    for r in rows.reshape(-1):
        a = 4096 + r * 320
        first, last = a // 4096 * 4096, (a + 319) // 4096 * 4096
        want.append([m.address + first, last - first + 4096])
    assert iov.tolist() == want and done == sum(w[1] for w in want)
    g.advise_rows(rows[:1])
    assert seen[-1][0] == ptr and len(seen[-1][1]) == 4  # reused, 4 rows this step
    assert g.advise_rows(np.zeros(0, np.int64)) == 0 and len(seen) == 2
    # Real syscall, cached and uncached pages.
    real = pp.GatherWillNeed(m.address, 320, max_rows=64, num_rows=13000)
    try:
        if not real.advisor.use_fallback:
            assert real.advise_rows(rows) > 0
    finally:
        real.close()
        m.close()


def test_real_pages_become_resident(table_file):
    m = pp.ReadOnlyMapping(table_file)
    g = pp.GatherWillNeed(m.address, 320, max_rows=64, num_rows=(4 << 20) // 320)
    try:
        if g.advisor.use_fallback:
            pytest.skip(g.advisor.fallback_reason)
        if pp.resident_pages(m.address, m.size).sum() > 16:
            pytest.skip("this filesystem keeps the file cached after DONTNEED")
        rows = np.random.default_rng(3).integers(0, (4 << 20) // 320, 16)
        assert g.advise_rows(rows) >= 16 * 4096
        pages = pp.rows_to_pages(rows, 320)
        import time

        deadline = time.monotonic() + 5
        while not pp.resident_pages(m.address, m.size)[pages].all():
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        g.close()
        m.close()


def mmap_embedding(table, gather_willneed):
    """A Qwen4ExpPLEMmapEmbedding with only what stage_rows touches."""
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpPLEMmapEmbedding

    emb = Qwen4ExpPLEMmapEmbedding.__new__(Qwen4ExpPLEMmapEmbedding)
    torch.nn.Module.__init__(emb)
    emb.table = table
    emb.embedding_dim = table.shape[1]
    emb.num_ngram_heads = 16
    emb.host_rows = torch.empty(64 * 16, table.shape[1], dtype=torch.bfloat16)
    emb._host_rows_np = emb.host_rows.view(torch.int16).numpy()
    emb.device_rows = torch.zeros(64, 16, table.shape[1], dtype=torch.bfloat16)
    emb.gather_willneed = gather_willneed
    return emb


def test_stage_rows_advises_decode_steps_only(table_file, caplog):
    rows_total = (4 << 20) // 320
    table = np.memmap(table_file, dtype=np.int16, mode="r", shape=(rows_total, 160))
    seen = []
    probe = mmap_embedding(table, None)
    g = pp.make_gather_willneed(probe)
    g.advisor = pp.WillNeedAdvisor(syscall=recorder(seen))
    emb = mmap_embedding(table, g)
    assert g.max_rows == pp.GATHER_MADVISE_MAX_TOKENS * 16
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, rows_total, (4, 16)))
    emb.stage_rows(ids)
    assert len(seen) == 1 and len(seen[0][1]) == 64  # one syscall, one iovec per row
    assert seen[0][1][:, 0].min() >= table.ctypes.data // 4096 * 4096
    # The gather itself is unchanged: rows are the table's rows.
    want = torch.from_numpy(np.asarray(table)[ids.reshape(-1).numpy()].copy())
    got = emb.device_rows[:4].reshape(64, 160).view(torch.int16)
    assert torch.equal(got, want)
    # A prefill-sized step (> 16 tokens) is the prompt prefetcher's job.
    emb.stage_rows(torch.zeros(17, 16, dtype=torch.int64))
    assert len(seen) == 1
    # Gate off: no helper, same gather.
    off = mmap_embedding(table, None)
    off.stage_rows(ids)
    assert torch.equal(off.device_rows[:4].reshape(64, 160).view(torch.int16), want)
    # An error disables the helper once, the gather still runs.

    class Boom:
        def advise_rows(self, rows):
            raise RuntimeError("boom")

    bad = mmap_embedding(table, Boom())
    with caplog.at_level(logging.ERROR):
        bad.stage_rows(ids)
    assert bad.gather_willneed is None
    assert torch.equal(bad.device_rows[:4].reshape(64, 160).view(torch.int16), want)
    assert any("gather madvise disabled" in r.getMessage() for r in caplog.records)


def test_gather_gate_declared_in_envs(monkeypatch):
    import vllm.envs as envs

    monkeypatch.setenv("VLLM_PLE_GATHER_MADVISE", "0")
    assert envs.environment_variables["VLLM_PLE_GATHER_MADVISE"]() is False
    monkeypatch.delenv("VLLM_PLE_GATHER_MADVISE")
    assert envs.environment_variables["VLLM_PLE_GATHER_MADVISE"]() is True
