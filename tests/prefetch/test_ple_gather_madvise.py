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


def test_real_syscall_accepts_every_row_page(table_file):
    """The kernel accepts the advice for every row's pages (returned bytes).
    Residency afterwards is best-effort readahead, not a promise: it is not
    asserted (a loaded host left pages unread past a deadline)."""
    m = pp.ReadOnlyMapping(table_file)
    g = pp.GatherWillNeed(m.address, 320, max_rows=64, num_rows=(4 << 20) // 320)
    try:
        if g.advisor.use_fallback:
            pytest.skip(g.advisor.fallback_reason)
        rows = np.random.default_rng(3).integers(0, (4 << 20) // 320, 16)
        first = rows * 320 // 4096
        last = (rows * 320 + 319) // 4096
        assert g.advise_rows(rows) == int(((last - first + 1) * 4096).sum())
    finally:
        g.close()
        m.close()


def test_fallback_goes_through_the_mapping(table_file):
    """Without process_madvise: one madvise per row's page range, through the
    table mmap's own madvise() (no ctypes boxing); the same ranges and bytes
    as the ctypes loop it replaces."""
    import mmap as mmap_mod

    with open(table_file, "rb") as f:
        mapping = mmap_mod.mmap(f.fileno(), 0, access=mmap_mod.ACCESS_READ)
    base = int(np.frombuffer(mapping, dtype=np.uint8, count=1).ctypes.data)
    adv = pp.WillNeedAdvisor(syscall=recorder([]))
    adv.use_fallback = True
    g = pp.GatherWillNeed(base, 320, max_rows=64, num_rows=(4 << 20) // 320,
                          advisor=adv, mapping=mapping)
    calls = []
    real = mapping.madvise

    class Spy:
        def madvise(self, advice, start, length):
            calls.append((advice, start, length))
            return real(advice, start, length)

    g.mapping = Spy()
    rows = np.array([0, 12, 1000])  # row 12 straddles pages 0 and 1
    done = g.advise_rows(rows)
    assert calls == [(pp.MADV_WILLNEED, 0, 4096), (pp.MADV_WILLNEED, 0, 8192),
                     (pp.MADV_WILLNEED, 1000 * 320 // 4096 * 4096, 4096)]
    assert done == 4 * 4096 and adv.fallback_calls == 3
    # Without the mapping the ctypes loop gets the same ranges.
    g2 = pp.GatherWillNeed(base, 320, max_rows=64, num_rows=(4 << 20) // 320, advisor=adv)
    assert g2.advise_rows(rows) == 4 * 4096 and adv.fallback_calls == 6


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
    # ... except the decode tokens batched with a prefill chunk: their rows
    # were never prefetched, so exactly those are advised.
    mixed = torch.from_numpy(np.random.default_rng(1).integers(0, rows_total, (20, 16)))
    emb.stage_rows(mixed, np.array([3, 19]))
    assert len(seen) == 2 and len(seen[1][1]) == 32
    got_pages = {int(a) for a in seen[1][1][:, 0]}
    want_pages = {(table.ctypes.data + int(r) * 320) // 4096 * 4096
                  for r in mixed[[3, 19]].reshape(-1)}
    assert got_pages == want_pages
    assert torch.equal(
        emb.device_rows[:20].reshape(320, 160).view(torch.int16),
        torch.from_numpy(np.asarray(table)[mixed.reshape(-1).numpy()].copy()),
    )
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
