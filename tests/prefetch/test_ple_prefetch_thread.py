"""PLEPromptPrefetcher lifecycle: O(1) engine-facing calls, cancel, no leaks."""

import logging
import os
import threading
import time

import numpy as np
import pytest

from vllm.models.qwen4_exp.nvidia import ple_prefetch as pp

V, EOS = 248_320, 248_044


def consts():
    rng = np.random.default_rng(0)
    m = rng.integers(1, 2**40, size=3) | 1
    S = np.full(16, 1_000_003, dtype=np.int64)
    O = np.arange(16, dtype=np.int64) * 1_000_003
    return pp.PLEHashConstants(m, S, O, EOS, 8)


def region():
    return pp.PLETableRegion(consts(), file_offset=0, row_bytes=320)


class GatedAdvisor:
    """Stands in for WillNeedAdvisor: records batches; can block the worker
    inside a 'syscall' until released (a full device queue)."""

    iov_max = pp.IOV_MAX

    def __init__(self, block=False, fail_first=False):
        self.release = threading.Event()
        if not block:
            self.release.set()
        self.entered = threading.Event()
        self.batches = []
        self.fail_first = fail_first
        self.closed = False

    def willneed(self, iov):
        self.entered.set()
        self.release.wait(10)
        if self.fail_first:
            self.fail_first = False
            raise RuntimeError("boom")
        self.batches.append(len(iov))
        return int(iov[:, 1].sum())

    def close(self):
        self.closed = True


def tokens(n, seed=1):
    return np.random.default_rng(seed).integers(0, V, size=n).tolist()


def test_prefetch_pages_equal_direct_computation():
    adv = GatedAdvisor()
    pf = pp.PLEPromptPrefetcher([region()], base_address=1 << 30, advisor=adv)
    try:
        toks = tokens(3000)
        assert pf.submit("a", toks, num_computed_tokens=500)
        assert pf.wait_idle()
        want_pages = 0
        for lo in range(500, 3000, 1024):
            rows = pp.request_row_ids(toks, lo, min(3000, lo + 1024), consts())
            want_pages += pp.rows_to_pages(rows, 320).size
        assert pf.stats.tokens == 2500 and pf.stats.pages == want_pages
        assert pf.stats.bytes_advised == want_pages * pp.PAGE_SIZE
        assert pf.stats.completed == 1 and pf.pending() == 0
        # Nothing to do: fully prefix-cached, empty, or prompt-embeds request.
        assert not pf.submit("b", toks, num_computed_tokens=3000)
        assert not pf.submit("c", [], 0) and not pf.submit("d", None, 0)
    finally:
        pf.close()


def test_engine_calls_return_while_worker_is_stuck():
    adv = GatedAdvisor(block=True)
    pf = pp.PLEPromptPrefetcher([region()], base_address=0, advisor=adv)
    try:
        pf.submit("stuck", tokens(2048), 0)
        assert adv.entered.wait(5)  # worker is inside the "syscall"
        big = tokens(262_144, seed=2)
        t0 = time.perf_counter()
        for i in range(100):
            assert pf.submit(f"r{i}", big, 0)  # O(1): no copy, no hashing here
            pf.cancel(f"r{i}")
        pf.cancel("never-seen")  # the runner does this for new ids
        dt = time.perf_counter() - t0
        assert dt < 1.0, dt  # 200 calls; the worker holds the only work
        assert pf.stats.tokens <= 2048
    finally:
        adv.release.set()
        pf.close()
    assert not pf.alive and adv.closed


def test_cancel_on_finish_stops_between_batches():
    adv = GatedAdvisor(block=True)
    pf = pp.PLEPromptPrefetcher([region()], base_address=0, advisor=adv, chunk_tokens=256)
    try:
        pf.submit("req", tokens(256 * 20), 0)
        assert adv.entered.wait(5)
        pf.cancel("req")  # finished or preempted while its prefetch runs
        assert pf.stats.cancelled == 1
        adv.release.set()
        assert pf.wait_idle()
        assert len(adv.batches) == 1  # the batch in flight, nothing after
        assert pf.stats.tokens == 256 and pf.stats.completed == 0
        assert pf.pending() == 0
    finally:
        pf.close()


def test_readd_after_preemption_replaces_old_job():
    adv = GatedAdvisor(block=True)
    pf = pp.PLEPromptPrefetcher([region()], base_address=0, advisor=adv, chunk_tokens=256)
    try:
        pf.submit("busy", tokens(256), 0)
        assert adv.entered.wait(5)
        toks = tokens(256 * 4, seed=3)
        pf.submit("r", toks, 0)
        pf.submit("r", toks, 512)  # resumed: prefix already computed
        adv.release.set()
        assert pf.wait_idle()
        # "busy" 256 tokens + the re-added "r" from 512 only; old "r" skipped.
        assert pf.stats.tokens == 256 + 512
        assert pf.stats.completed == 2 and pf.pending() == 0
    finally:
        pf.close()


def test_bounded_queue_drops_instead_of_blocking():
    adv = GatedAdvisor(block=True)
    pf = pp.PLEPromptPrefetcher([region()], base_address=0, advisor=adv, max_pending=4)
    try:
        pf.submit("first", tokens(64), 0)
        assert adv.entered.wait(5)
        ok = [pf.submit(f"q{i}", tokens(64), 0) for i in range(10)]
        assert ok == [True] * 4 + [False] * 6 and pf.stats.dropped == 6
    finally:
        adv.release.set()
        pf.close()


def test_errors_are_logged_once_and_thread_survives(caplog):
    adv = GatedAdvisor(fail_first=True)
    pf = pp.PLEPromptPrefetcher([region()], base_address=0, advisor=adv)
    try:
        with caplog.at_level(logging.ERROR, logger=pp.logger.name):
            pf.submit("bad", tokens(100), 0)
            assert pf.wait_idle()
            pf.submit("bad2", [object()] * 10, 0)  # garbage tokens: numpy raises
            assert pf.wait_idle()
            pf.submit("good", tokens(100), 0)
            assert pf.wait_idle()
        assert pf.alive and pf.stats.failed == 2 and pf.stats.completed == 1
        assert sum("PLE page prefetch failed" in r.getMessage() for r in caplog.records) == 1
    finally:
        pf.close()


def test_no_leak_over_many_requests():
    adv = GatedAdvisor()
    threads_before = threading.active_count()
    pf = pp.PLEPromptPrefetcher([region()], base_address=0, advisor=adv, chunk_tokens=64)
    try:
        rng = np.random.default_rng(4)
        for i in range(2000):
            pf.submit(f"r{i}", tokens(int(rng.integers(1, 200)), seed=i), 0)
            if i % 3 == 0:
                pf.cancel(f"r{i}")
            if i % 97 == 0:
                pf.wait_idle()
        assert pf.wait_idle()
        assert pf.pending() == 0 and not pf._queue and not pf._jobs
        assert threading.active_count() == threads_before + 1
    finally:
        pf.close()
    assert threading.active_count() == threads_before
    # close() is idempotent and later submits are refused.
    pf.close()
    assert not pf.submit("late", tokens(10), 0)


def test_real_file_end_to_end(tmp_path):
    """Real mapping + real process_madvise: the prompt's pages end up cached."""
    c = consts()
    rows_total = int(c.offsets[-1] + c.sizes[-1])
    path = tmp_path / "t.bin"
    size = 64 << 20  # a small table: rows past num_rows are dropped
    with open(path, "wb") as f:
        f.truncate(size)
    pp.drop_file_cache(str(path))
    reg = pp.PLETableRegion(c, file_offset=0, row_bytes=320, row_start=0,
                            num_rows=size // 320)
    pf = pp.PLEPromptPrefetcher.for_file(str(path), [reg])
    try:
        toks = tokens(2000, seed=9)
        pf.submit("x", toks, 0)
        assert pf.wait_idle(30)
        per_chunk = [
            pp.rows_to_pages(pp.request_row_ids(toks, lo, min(2000, lo + 1024), c), 320,
                             num_rows=size // 320)
            for lo in range(0, 2000, 1024)
        ]
        pages = np.unique(np.concatenate(per_chunk))
        assert pf.stats.pages == sum(p.size for p in per_chunk) and pages.size > 0
        assert rows_total > size // 320  # some rows are outside: dropped, not wrapped
        deadline = time.monotonic() + 10
        while True:
            res = pp.resident_pages(pf._mapping.address, size)
            if res[pages].all() or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert res[pages].mean() > 0.99
        assert res.sum() < pages.size + 1024  # not the whole file
    finally:
        pf.close()
    assert pf._mapping.address == 0
    os.unlink(path)
