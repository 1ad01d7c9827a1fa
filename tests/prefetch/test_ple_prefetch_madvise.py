"""Pages, ranges, iovec batching, and real process_madvise / madvise calls."""

import ctypes
import errno
import logging
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from vllm.models.qwen4_exp.nvidia import ple_prefetch as pp

PAGE = pp.PAGE_SIZE


# ---- pure page arithmetic ----
def test_rows_to_pages_both_ends_and_unique():
    # 320 B rows: row 12 spans bytes 3840..4159 -> pages 0 and 1.
    assert pp.rows_to_pages(np.array([12]), 320, page_size=4096).tolist() == [0, 1]
    assert pp.rows_to_pages(np.array([0, 1, 11]), 320, page_size=4096).tolist() == [0]
    # Duplicates and order do not matter.
    rows = np.array([100, 3, 100, 3, 12])
    assert pp.rows_to_pages(rows, 320, page_size=4096).tolist() == [0, 1, 7]
    # file_offset shifts every byte (a later PLE layer's table).
    assert pp.rows_to_pages(np.array([0]), 320, file_offset=4000, page_size=4096).tolist() == [0, 1]
    # ETP: only rows of [row_start, row_start + num_rows) are this shard's.
    got = pp.rows_to_pages(np.array([5, 10, 20, 29, 30]), 4096, row_start=10, num_rows=20,
                           page_size=4096)
    assert got.tolist() == [0, 10, 19]
    assert pp.rows_to_pages(np.zeros(0, np.int64), 320).size == 0
    assert pp.rows_to_pages(np.array([3]), 320, row_start=10).size == 0


def test_rows_to_pages_matches_bruteforce():
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 50_000, size=(64, 16))
    want = sorted({(r * 320) // 4096 for r in rows.flat} | {(r * 320 + 319) // 4096 for r in rows.flat})
    assert pp.rows_to_pages(rows, 320, page_size=4096).tolist() == want


def test_pages_to_ranges_edges():
    s, n = pp.pages_to_ranges(np.zeros(0, np.int64))
    assert s.size == 0 and n.size == 0
    s, n = pp.pages_to_ranges(np.array([7]))
    assert s.tolist() == [7] and n.tolist() == [1]
    s, n = pp.pages_to_ranges(np.arange(5, 1029))
    assert s.tolist() == [5] and n.tolist() == [1024]
    s, n = pp.pages_to_ranges(np.array([0, 1, 2, 4, 6, 7, 100]))
    assert s.tolist() == [0, 4, 6, 100] and n.tolist() == [3, 1, 2, 1]
    # Round trip: ranges cover exactly the pages.
    pages = np.unique(np.random.default_rng(1).integers(0, 3000, 2000))
    s, n = pp.pages_to_ranges(pages)
    back = np.concatenate([np.arange(a, a + k) for a, k in zip(s, n)])
    np.testing.assert_array_equal(back, pages)


def test_iovecs_and_batches():
    iov = pp.ranges_to_iovecs(1 << 40, np.array([0, 3]), np.array([2, 1]), page_size=4096)
    assert iov.dtype == np.uint64 and iov.shape == (2, 2)
    assert iov.tolist() == [[1 << 40, 8192], [(1 << 40) + 3 * 4096, 4096]]
    assert iov.strides == (16, 8)  # struct iovec layout
    for n, want in [(0, []), (1, [1]), (1024, [1024]), (1025, [1024, 1]), (2049, [1024, 1024, 1])]:
        big = pp.ranges_to_iovecs(0, np.arange(n), np.ones(n, np.int64))
        sizes = [len(b) for b in pp.iovec_batches(big)]
        assert sizes == want
        if n:
            assert all(b.flags.c_contiguous for b in pp.iovec_batches(big))
    assert [len(b) for b in pp.iovec_batches(np.zeros((5, 2), np.uint64), 2)] == [2, 2, 1]
    with pytest.raises(ValueError):
        list(pp.iovec_batches(np.zeros((1, 2), np.uint64), 0))


# ---- real syscalls on a real mapped file ----
@pytest.fixture
def table_file(tmp_path):
    path = tmp_path / "table.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(4 << 20))  # 1024 pages
    pp.drop_file_cache(str(path))
    return str(path)


def wait_resident(mapping, pages, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        res = pp.resident_pages(mapping.address, mapping.size)
        if res[pages].all() or time.monotonic() > deadline:
            return res


def test_process_madvise_reads_pages_of_a_real_mapping(table_file):
    m = pp.ReadOnlyMapping(table_file)
    adv = pp.WillNeedAdvisor()
    try:
        if adv.use_fallback:
            pytest.skip(f"process_madvise unavailable here: {adv.fallback_reason}")
        before = pp.resident_pages(m.address, m.size)
        if before.sum() > 16:
            pytest.skip("this filesystem keeps the file cached after DONTNEED")
        pages = np.array([3, 4, 5, 100, 101, 500, 1000])
        s, n = pp.pages_to_ranges(pages)
        iov = pp.ranges_to_iovecs(m.address, s, n)
        assert adv.willneed(iov) == pages.size * PAGE
        assert adv.calls == 1 and adv.fallback_calls == 0
        res = wait_resident(m, pages)
        assert res[pages].all()
        # MADV_WILLNEED reads what was asked, not the whole file.
        assert res.sum() < 200
    finally:
        adv.close()
        m.close()


def test_bad_range_is_skipped_not_raised(table_file):
    m = pp.ReadOnlyMapping(table_file)
    adv = pp.WillNeedAdvisor()
    try:
        if adv.use_fallback:
            pytest.skip(adv.fallback_reason)
        iov = np.array(
            [[m.address, PAGE], [PAGE, PAGE], [m.address + 9 * PAGE, 2 * PAGE]],
            dtype=np.uint64,
        )
        # Second range (address 4096, below mmap_min_addr) is unmapped (ENOMEM): the first and third still count.
        assert adv.willneed(iov) == 3 * PAGE
        assert not adv.use_fallback
        with pytest.raises(ValueError):
            adv.willneed(np.zeros((pp.IOV_MAX + 1, 2), np.uint64))
    finally:
        adv.close()
        m.close()


def test_forced_eperm_falls_back_to_madvise_and_logs_once(table_file, caplog, monkeypatch):
    monkeypatch.setattr(pp.WillNeedAdvisor, "_fallback_logged", False)
    calls = []

    def refuse(pidfd, ptr, n, advice, flags):
        calls.append(n)
        return -1, errno.EPERM

    m = pp.ReadOnlyMapping(table_file)
    try:
        with caplog.at_level(logging.WARNING, logger=pp.logger.name):
            advisors = [pp.WillNeedAdvisor(syscall=refuse) for _ in range(2)]
            pages = np.array([10, 11, 12, 50])
            s, n = pp.pages_to_ranges(pages)
            iov = pp.ranges_to_iovecs(m.address, s, n)
            for adv in advisors:
                assert adv.willneed(iov) == pages.size * PAGE
                assert adv.use_fallback and adv.fallback_calls == 2
                assert adv.willneed(iov) == pages.size * PAGE  # stays on fallback
                assert adv.fallback_calls == 4
        assert calls == [2, 2]  # one refused process_madvise per advisor, then never again
        lines = [r.getMessage() for r in caplog.records if pp.FALLBACK_LOG_LINE in r.getMessage()]
        assert len(lines) == 1, lines
        assert "EPERM" in lines[0]
        assert wait_resident(m, pages)[pages].all()  # the fallback really advised
        for adv in advisors:
            adv.close()
    finally:
        m.close()


def test_eperm_reason_names_capability(monkeypatch):
    monkeypatch.setattr(pp, "_effective_caps", lambda: 0)
    monkeypatch.setattr(pp, "_kernel_version", lambda: (6, 8))
    msg = pp.explain_process_madvise_error(errno.EPERM)
    assert "CAP_SYS_PTRACE" in msg and "CAP_SYS_NICE" in msg
    monkeypatch.setattr(pp, "_kernel_version", lambda: (6, 13))
    msg = pp.explain_process_madvise_error(errno.EPERM)
    assert "CAP_SYS_PTRACE" in msg and "CAP_SYS_NICE" not in msg
    monkeypatch.setattr(pp, "_effective_caps", lambda: (1 << 19) | (1 << 23))
    assert "seccomp" in pp.explain_process_madvise_error(errno.EPERM)
    assert "ENOSYS" in pp.explain_process_madvise_error(errno.ENOSYS)


SECCOMP_CHILD = textwrap.dedent(
    """
    import ctypes, importlib.util, logging, struct, sys
    import numpy as np
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = importlib.util.spec_from_file_location("ple_prefetch", sys.argv[1])
    pp = importlib.util.module_from_spec(spec); sys.modules["ple_prefetch"] = pp
    spec.loader.exec_module(pp)
    # BPF: load seccomp_data.nr; process_madvise -> ERRNO(EPERM), else ALLOW.
    nr = pp._SYSCALLS[__import__("platform").machine()][1]
    prog = [(0x20, 0, 0, 0), (0x15, 0, 1, nr), (0x06, 0, 0, 0x00050000 | 1),
            (0x06, 0, 0, 0x7FFF0000)]
    buf = b"".join(struct.pack("HBBI", *f) for f in prog)
    filt = ctypes.create_string_buffer(buf)
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    p = Prog(len(prog), ctypes.addressof(filt))
    libc = ctypes.CDLL(None, use_errno=True)
    # PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP SECCOMP_MODE_FILTER
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(p), 0, 0) != 0:
        print("NOSECCOMP", ctypes.get_errno())
        sys.exit(0)
    m = pp.ReadOnlyMapping(sys.argv[2])
    adv = pp.WillNeedAdvisor()
    iov = pp.ranges_to_iovecs(m.address, np.array([0, 8]), np.array([2, 3]))
    got = [adv.willneed(iov), adv.willneed(iov)]
    print("RESULT", got, adv.calls, adv.fallback_calls, adv.use_fallback)
    """
)


def test_seccomp_eperm_takes_fallback(table_file, tmp_path):
    """A real seccomp filter answering EPERM (as the container default
    profile does without CAP_SYS_PTRACE): fallback taken, logged once."""
    script = tmp_path / "child.py"
    script.write_text(SECCOMP_CHILD)
    out = subprocess.run(
        [sys.executable, str(script), pp.__file__, table_file],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    if "NOSECCOMP" in out.stdout:
        pytest.skip(f"cannot install a seccomp filter here: {out.stdout}")
    assert f"RESULT [{5 * PAGE}, {5 * PAGE}] 1 4 True" in out.stdout, out.stdout
    log = out.stderr
    assert log.count(pp.FALLBACK_LOG_LINE) == 1, log
    assert "EPERM" in log


def test_pidfd_reopened_after_fork(table_file):
    """A forked child (pid changed) advises its own mm, never its parent's."""
    m = pp.ReadOnlyMapping(table_file)
    adv = pp.WillNeedAdvisor()
    try:
        if adv.use_fallback:
            pytest.skip(adv.fallback_reason)
        adv._pid = -1  # as seen from a child after fork()
        iov = pp.ranges_to_iovecs(m.address, np.array([2]), np.array([1]))
        assert adv.willneed(iov) == PAGE
        assert adv._pid == os.getpid() and adv.pidfd >= 0 and adv.calls == 1
    finally:
        adv.close()
        m.close()
