#!/usr/bin/env python3
"""Benchmark the PLE page prefetch (ttft-01, 0150) and the decode gather
madvise (decode-06, 0160) on a synthetic table file.

Prompt (ttft-01): a --tokens prompt (default 42,000, the article's cold TTFT
case) is hashed into 16 rows per token and gathered in 512-token chunks with
np.take from an mmap (MADV_RANDOM), as the 0100 host gather does, after the
table's page cache was dropped (posix_fadvise DONTNEED). Arm "off": gather
only. Arm "prefetch": PLEPromptPrefetcher.submit(prompt) first (1024-token
chunks -> unique pages -> ranges -> process_madvise WILLNEED), then the same
gather. Arm "fallback" (--fallback): the prefetcher forced onto per-range
madvise, as without CAP_SYS_PTRACE. The hash uses synthetic constants sized
to the file (numpy, the same code as production); only the I/O pattern
matters here.

A/B method (the write-up's): each arm reads its own unread token stream
(a seed per arm and repeat, so no arm gathers pages another arm pulled in),
the arms alternate order from one repeat to the next (off first, then
prefetch first, ...), --repeats runs of each; the JSON has every run and the
median / min / max per arm, and the speedup is median(off) / median(prefetch).
An earlier version ran "off" first on the same prompt every time: arm order
alone moved the ratio by about 30 %.

Decode (decode-06): --decode-steps steps of 16 cold random rows (one token)
each: np.take alone vs GatherWillNeed.advise_rows + np.take, plus the cost
of advise_rows itself on cached rows (the overhead a warm step pays) and of
the generic unique/merge path for comparison (0.15 ms in the article).
--gather-fallback: advise_rows without process_madvise (as without
CAP_SYS_PTRACE), merged ranges through the table mmap's madvise() vs the old
per-row ctypes loop, 1 and 4 tokens, pages cached.
--host-ids: the host hash of one --chunk prefill chunk (0170: replaces the
kernel + blocking ids D2H per PLE layer for prefill-only steps).

    python scripts/bench/bench_ple_prefetch.py --table /data/ple_bench.bin --size-gib 8 \
        --json scripts/bench/results/ple_prefetch.json

Needs numpy (and tqdm for progress); loads ple_prefetch.py from the installed
(patched) vllm by file path, without importing torch or vllm.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import json
import mmap
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROW_BYTES = 320  # 160 bf16
HEADS, PER_NGRAM, VOCAB, EOS = 16, 8, 248_320, 248_044


def load_ple_prefetch(path: str | None):
    if path is None:
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("vllm not importable: pass --module PATH/TO/ple_prefetch.py")
        path = os.path.join(
            list(spec.submodule_search_locations)[0], "models", "qwen4_exp", "nvidia",
            "ple_prefetch.py",
        )
    if not os.path.isfile(path):
        raise SystemExit(
            f"{path} not found: apply the patch series (0150-ple-prefetch) or pass --module"
        )
    spec = importlib.util.spec_from_file_location("ple_prefetch", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ple_prefetch"] = mod
    spec.loader.exec_module(mod)
    return mod


def progress(iterable=None, **kw):
    try:
        from tqdm import tqdm

        return tqdm(iterable, leave=False, **kw)
    except ImportError:
        return iterable


def make_table(path: str, size: int) -> None:
    """Random bytes (not sparse: every page must come from the device)."""
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    block = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        bar = progress(total=size, unit="B", unit_scale=True, desc="writing table")
        left = size
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
            if bar is not None and hasattr(bar, "update"):
                bar.update(n)
        f.flush()
        os.fsync(f.fileno())
    if bar is not None and hasattr(bar, "close"):
        bar.close()


def synthetic_consts(pp, rows: int):
    rng = np.random.default_rng(1234)
    bound = ((1 << 63) - 1) // VOCAB // 2
    m = 2 * rng.integers(0, bound, size=3, dtype=np.int64) + 1
    size = rows // HEADS
    S = np.full(HEADS, size, dtype=np.int64) - np.arange(HEADS)  # distinct sizes
    O = np.concatenate([[0], np.cumsum(S)[:-1]]).astype(np.int64)
    return pp.PLEHashConstants(m, S, O, EOS, PER_NGRAM)


class Table:
    """The 0100 view: a read-only MADV_RANDOM mmap as int16 [rows, 160]."""

    def __init__(self, path: str):
        self.f = open(path, "rb")
        self.mm = mmap.mmap(self.f.fileno(), 0, access=mmap.ACCESS_READ)
        self.mm.madvise(mmap.MADV_RANDOM)
        self.rows = len(self.mm) // ROW_BYTES
        self.arr = np.frombuffer(self.mm, dtype=np.int16, count=self.rows * 160).reshape(
            self.rows, 160
        )
        self.address = self.arr.ctypes.data

    def close(self):
        del self.arr
        self.mm.close()
        self.f.close()


def cold(pp, path: str) -> float:
    """Drop the file's page cache; return the fraction still resident."""
    pp.drop_file_cache(path)
    t = Table(path)
    try:
        frac = float(pp.resident_pages(t.address, len(t.mm)).mean())
    finally:
        t.close()
    return frac


def gather_prompt(pp, t: Table, tokens, consts, chunk: int) -> float:
    out = np.empty((chunk * HEADS, 160), dtype=np.int16)
    t0 = time.perf_counter()
    for lo in progress(range(0, len(tokens), chunk), desc="gather", unit="chunk"):
        hi = min(len(tokens), lo + chunk)
        ids = pp.request_row_ids(tokens, lo, hi, consts).reshape(-1)
        np.take(t.arr, ids, axis=0, out=out[: ids.size], mode="clip")
    return time.perf_counter() - t0


def prompt_arm(pp, path, tokens, consts, chunk, mode):
    resident = cold(pp, path)
    t = Table(path)
    pf = None
    try:
        res = {"resident_before": round(resident, 5)}
        t0 = time.perf_counter()
        if mode != "off":
            region = pp.PLETableRegion(consts, file_offset=t.address, row_bytes=ROW_BYTES,
                                       num_rows=t.rows)
            adv = pp.WillNeedAdvisor()
            if mode == "fallback":
                adv._fall_back(errno.EPERM)  # EPERM, as without CAP_SYS_PTRACE
            pf = pp.PLEPromptPrefetcher([region], 0, advisor=adv)
            pf.submit("bench", tokens, 0)
        res["gather_s"] = round(gather_prompt(pp, t, tokens, consts, chunk), 3)
        res["total_s"] = round(time.perf_counter() - t0, 3)
        res["tok_per_s"] = round(len(tokens) / res["total_s"], 1)
        if pf is not None:
            pf.wait_idle(600)
            st = pf.stats
            res.update(
                prefetch_thread_busy_s=round(st.busy_s, 3),
                prefetch_thread_cpu_s=round(st.cpu_s, 3),
                pages_advised=st.pages,
                ranges=st.ranges,
                process_madvise_calls=pf.advisor.calls,
                madvise_calls=pf.advisor.fallback_calls,
            )
        res["resident_after"] = round(float(pp.resident_pages(t.address, len(t.mm)).mean()), 5)
        return res
    finally:
        if pf is not None:
            pf.close()
        t.close()


def decode_bench(pp, path, steps: int, seed: int = 7):
    rng = np.random.default_rng(seed)
    res = {}
    out = np.empty((HEADS, 160), dtype=np.int16)
    for arm in ("off", "madvise"):
        cold(pp, path)
        t = Table(path)
        g = pp.GatherWillNeed(t.address, ROW_BYTES, max_rows=4 * HEADS, num_rows=t.rows)
        try:
            lat, adv_us = [], []
            for _ in progress(range(steps), desc=f"decode {arm}", unit="step"):
                rows = rng.integers(0, t.rows, HEADS)
                t0 = time.perf_counter()
                if arm == "madvise":
                    g.advise_rows(rows)
                    adv_us.append((time.perf_counter() - t0) * 1e6)
                np.take(t.arr, rows, axis=0, out=out)
                lat.append((time.perf_counter() - t0) * 1e3)
            lat.sort()
            r = {
                "mean_ms": round(float(np.mean(lat)), 4),
                "p50_ms": round(lat[len(lat) // 2], 4),
                "p90_ms": round(lat[int(len(lat) * 0.9)], 4),
                "p99_ms": round(lat[int(len(lat) * 0.99)], 4),
            }
            if adv_us:
                r["advise_rows_cold_us_p50"] = round(float(np.median(adv_us)), 1)
            if arm == "madvise":
                # Warm overhead: the same 16 rows again, pages now cached.
                rows = rng.integers(0, t.rows, HEADS)
                np.take(t.arr, rows, axis=0, out=out)
                warm, warm4 = [], []
                rows4 = rng.integers(0, t.rows, 4 * HEADS)
                np.take(t.arr, rows4, axis=0)
                for _ in range(2000):
                    t0 = time.perf_counter()
                    g.advise_rows(rows)
                    t1 = time.perf_counter()
                    g.advise_rows(rows4)
                    t2 = time.perf_counter()
                    warm.append((t1 - t0) * 1e6)
                    warm4.append((t2 - t1) * 1e6)
                r["advise_rows_warm_us_p50_1tok"] = round(float(np.median(warm)), 1)
                r["advise_rows_warm_us_p99_1tok"] = round(float(np.percentile(warm, 99)), 1)
                r["advise_rows_warm_us_p50_4tok"] = round(float(np.median(warm4)), 1)
                # The generic path (unique + merge + new iovec) for comparison.
                adv = pp.WillNeedAdvisor()
                gen = []
                for _ in range(2000):
                    t0 = time.perf_counter()
                    pages = pp.rows_to_pages(rows, ROW_BYTES, t.address)
                    s, n = pp.pages_to_ranges(pages)
                    adv.willneed(pp.ranges_to_iovecs(0, s, n))
                    gen.append((time.perf_counter() - t0) * 1e6)
                adv.close()
                r["generic_path_warm_us_p50_1tok"] = round(float(np.median(gen)), 1)
                r["process_madvise"] = not g.advisor.use_fallback
            res[arm] = r
        finally:
            g.close()
            t.close()
    return res


def summarize(runs: list[float]) -> dict:
    return {
        "runs_s": runs,
        "median_s": round(float(np.median(runs)), 3),
        "min_s": round(min(runs), 3),
        "max_s": round(max(runs), 3),
    }


def prompt_bench(pp, path, n_tokens, consts, chunk, modes, repeats, seed=42):
    """Every arm on its own unread prompt, arms alternated, ``repeats`` times."""
    runs = {m: [] for m in modes}
    detail = {m: [] for m in modes}
    for r in range(repeats):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        for mode in order:
            stream = seed + 1000 * r + modes.index(mode)
            tokens = np.random.default_rng(stream).integers(0, VOCAB, n_tokens).tolist()
            res = prompt_arm(pp, path, tokens, consts, chunk, mode)
            res.update(repeat=r, position=order.index(mode), token_seed=stream)
            print(f"prompt {mode} (repeat {r + 1}/{repeats}, #{order.index(mode) + 1}): "
                  f"{res['total_s']} s", file=sys.stderr)
            runs[mode].append(res["total_s"])
            detail[mode].append(res)
    return {m: {**summarize(runs[m]), "runs": detail[m]} for m in modes}


def gather_fallback_bench(pp, path, seed=9):
    """advise_rows on the fallback path, warm pages: the old ctypes loop over
    every row vs merged ranges through the mmap's own madvise()."""
    t = Table(path)
    rng = np.random.default_rng(seed)
    out = {}
    try:
        for tokens in (1, 4):
            rows = rng.integers(0, t.rows, tokens * HEADS)
            np.take(t.arr, rows, axis=0)  # warm
            adv = pp.WillNeedAdvisor()
            adv.use_fallback = True
            g = pp.GatherWillNeed(t.address, ROW_BYTES, max_rows=4 * HEADS,
                                  num_rows=t.rows, advisor=adv, mapping=t.mm)
            start = (t.address + rows * ROW_BYTES) // 4096 * 4096
            end = (t.address + rows * ROW_BYTES + ROW_BYTES - 1) // 4096 * 4096 + 4096
            per_row = np.stack([start, end - start], 1).astype(np.uint64)
            old, new = [], []
            for _ in range(2000):
                t0 = time.perf_counter()
                adv._madvise_each(per_row)
                t1 = time.perf_counter()
                g.advise_rows(rows)
                t2 = time.perf_counter()
                old.append((t1 - t0) * 1e6)
                new.append((t2 - t1) * 1e6)
            out[f"{tokens}tok"] = {
                "rows": int(rows.size),
                "per_row_ctypes_us_p50": round(float(np.median(old)), 1),
                "merged_mmap_us_p50": round(float(np.median(new)), 1),
            }
            g.mapping = None
    finally:
        t.close()
    return out


def host_ids_bench(pp, consts, chunk, seed=11):
    """0170: host hash of one prefill chunk of ``chunk`` tokens (one layer)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, chunk + 2).tolist()
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        pp.request_row_ids(tokens, 2, chunk + 2, consts)
        times.append((time.perf_counter() - t0) * 1e6)
    return {"chunk_tokens": chunk, "us_p50": round(float(np.median(times)), 1),
            "us_p90": round(float(np.percentile(times, 90)), 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", default="ple_bench_table.bin",
                    help="synthetic table file, created if missing or of another size")
    ap.add_argument("--size-gib", type=float, default=8.0,
                    help="table size (default 8 GiB; the real one is 95.37 GiB)")
    ap.add_argument("--tokens", type=int, default=42_000, help="prompt length (default 42000)")
    ap.add_argument("--chunk", type=int, default=512,
                    help="prefill chunk of the gather (--max-num-batched-tokens, default 512)")
    ap.add_argument("--decode-steps", type=int, default=300)
    ap.add_argument("--fallback", action="store_true",
                    help="also run the prefetch forced onto per-range madvise")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each prompt arm, order alternated (default 3)")
    ap.add_argument("--gather-fallback", action="store_true",
                    help="time advise_rows on the per-range madvise fallback")
    ap.add_argument("--host-ids", action="store_true",
                    help="time the host hash of one prefill chunk (0170)")
    ap.add_argument("--skip-prompt", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the table file afterwards")
    ap.add_argument("--module", default=None, help="path of ple_prefetch.py (default: from vllm)")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                    help="write results as JSON to PATH (stdout without PATH)")
    argv = sys.argv[1:] if argv is None else list(argv)
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")

    pp = load_ple_prefetch(a.module)
    size = int(a.size_gib * (1 << 30)) // ROW_BYTES * ROW_BYTES
    t0 = time.perf_counter()
    make_table(a.table, size)
    res = {
        "command": " ".join(["python", "scripts/bench/bench_ple_prefetch.py", *argv]),
        "module": pp.__file__,
        "host": {"kernel": platform.release(), "cpus": os.cpu_count()},
        "table_bytes": size,
        "table_rows": size // ROW_BYTES,
        "table_write_s": round(time.perf_counter() - t0, 1),
        "tokens": a.tokens,
        "chunk": a.chunk,
    }
    consts = synthetic_consts(pp, size // ROW_BYTES)
    try:
        if not a.skip_prompt:
            modes = ["off", "prefetch"] + (["fallback"] if a.fallback else [])
            arms = prompt_bench(pp, a.table, a.tokens, consts, a.chunk, modes, a.repeats)
            res["prompt"] = arms
            res["repeats"] = a.repeats
            res["prompt_speedup"] = round(
                arms["off"]["median_s"] / arms["prefetch"]["median_s"], 2
            )
        if a.gather_fallback:
            res["gather_fallback"] = gather_fallback_bench(pp, a.table)
        if a.host_ids:
            res["host_ids"] = host_ids_bench(pp, consts, a.chunk)
        if not a.skip_decode:
            res["decode"] = decode_bench(pp, a.table, a.decode_steps)
            d = res["decode"]
            res["decode_p90_speedup"] = round(d["off"]["p90_ms"] / d["madvise"]["p90_ms"], 2)
            res["decode_mean_speedup"] = round(d["off"]["mean_ms"] / d["madvise"]["mean_ms"], 2)
    finally:
        if not a.keep and os.path.exists(a.table):
            os.unlink(a.table)
    summary = []
    if "prompt" in res:
        p = res["prompt"]
        def span(arm):
            q = p[arm]
            return f"{q['median_s']} s (min {q['min_s']}, max {q['max_s']})"

        summary.append(
            f"cold {a.tokens}-token prompt gather, median of {a.repeats} alternated runs on "
            f"unread prompts: off {span('off')}, prefetch {span('prefetch')} "
            f"({res['prompt_speedup']}x)"
            + (f", per-range fallback {span('fallback')}" if "fallback" in p else "")
        )
    if "gather_fallback" in res:
        g = res["gather_fallback"]
        summary.append(
            "fallback advise_rows (warm): "
            + ", ".join(f"{k} {v['per_row_ctypes_us_p50']} -> {v['merged_mmap_us_p50']} us"
                        for k, v in g.items())
        )
    if "host_ids" in res:
        h = res["host_ids"]
        summary.append(f"host hash of a {h['chunk_tokens']}-token chunk: p50 {h['us_p50']} us "
                       f"per PLE layer")
    if "decode" in res:
        d = res["decode"]
        summary.append(
            f"decode 16 cold rows/step: p90 {d['off']['p90_ms']} -> {d['madvise']['p90_ms']} ms "
            f"({res['decode_p90_speedup']}x), mean {d['off']['mean_ms']} -> "
            f"{d['madvise']['mean_ms']} ms; advise_rows warm "
            f"{d['madvise']['advise_rows_warm_us_p50_1tok']} us/step (generic path "
            f"{d['madvise']['generic_path_warm_us_p50_1tok']} us)"
        )
    for line in summary:
        print(line, file=sys.stderr)
    res["summary"] = summary
    if a.json:
        text = json.dumps(res, indent=2)
        if a.json == "-":
            print(text)
        else:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
