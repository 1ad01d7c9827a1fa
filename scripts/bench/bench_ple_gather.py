#!/usr/bin/env python3
"""Host gather throughput of the mmap'd PLE table (patch 0100-ple-pp-mmap).

Measures exactly what the patch does per step on the host: np.take of
16 random rows per token (320 B each) from a read-only mmap of the table
file (MADV_RANDOM) into a reused buffer, for batch sizes given by --tokens,
from a warm page cache (file read once first) and cold (the mapping's pages
dropped with madvise(MADV_DONTNEED) and the file's page cache with
posix_fadvise(POSIX_FADV_DONTNEED)). Row ids are uniform, like the n-gram
hash. /proc/self/io read_bytes shows what storage delivered per row.

    python scripts/bench/bench_ple_gather.py --file /models/ple.bin --json
    python scripts/bench/bench_ple_gather.py --make-gib 2 --dir /var/tmp --json

Without --file a random table of --make-gib GiB is written (and removed).
The 95.37 GiB production file gives a different cold figure than a small
one only through the storage device, not the page math: each row is on its
own page either way.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import sys
import tempfile
import time

import numpy as np
from tqdm import tqdm

ROWS_PER_TOKEN = 16
ROW_ELEMS = 160  # bf16 values per row (viewed as int16)
ROW_BYTES = ROW_ELEMS * 2


def storage_read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return -1


def make_table(directory: str, gib: float) -> str:
    rows = int(gib * (1 << 30)) // ROW_BYTES
    fd, path = tempfile.mkstemp(prefix="ple_bench_", suffix=".bin", dir=directory)
    chunk_rows = (64 << 20) // ROW_BYTES
    rng = np.random.default_rng(0)
    with os.fdopen(fd, "wb") as f, tqdm(total=rows * ROW_BYTES, unit="B",
                                        unit_scale=True, desc="write table") as bar:
        left = rows
        while left:
            n = min(chunk_rows, left)
            data = rng.integers(-(1 << 15), 1 << 15, size=n * ROW_ELEMS,
                                dtype=np.int16)
            f.write(data.tobytes())
            bar.update(n * ROW_BYTES)
            left -= n
    return path


def drop_cache(path: str, table_map: mmap.mmap) -> None:
    # Mapped pages are skipped by FADV_DONTNEED: unmap ours first.
    table_map.madvise(mmap.MADV_DONTNEED)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_cache(path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass


def run_case(table: np.ndarray, tokens: int, steps: int, rng) -> dict:
    out = np.empty((tokens * ROWS_PER_TOKEN, ROW_ELEMS), dtype=np.int16)
    times = []
    before = storage_read_bytes()
    for _ in range(steps):
        ids = rng.integers(0, table.shape[0], size=tokens * ROWS_PER_TOKEN)
        start = time.perf_counter()
        np.take(table, ids, axis=0, out=out, mode="clip")
        times.append(time.perf_counter() - start)
    read = storage_read_bytes() - before
    times_ms = np.array(times) * 1e3
    rows = tokens * ROWS_PER_TOKEN * steps
    return {
        "tokens_per_step": tokens,
        "steps": steps,
        "rows_per_s": rows / float(np.sum(times)),
        "step_ms_p50": float(np.percentile(times_ms, 50)),
        "step_ms_p90": float(np.percentile(times_ms, 90)),
        "us_per_token": float(np.sum(times)) * 1e6 / (tokens * steps),
        "storage_bytes_per_row": read / rows if read >= 0 else None,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--file", help="existing table file (e.g. VLLM_PLE_MMAP_PATH)")
    parser.add_argument("--make-gib", type=float, default=2.0,
                        help="size of the random table made without --file")
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="where the random table is written")
    parser.add_argument("--tokens", default="1,4,512",
                        help="tokens per step, comma separated (16 rows each)")
    parser.add_argument("--steps", type=int, default=200,
                        help="steps per case (cold: keep rows*steps << file pages)")
    parser.add_argument("--cold-rows", type=int, default=50_000,
                        help="cap on rows per cold case, so few rows hit pages "
                        "an earlier step of the case already read")
    parser.add_argument("--no-madv-random", action="store_true",
                        help="keep kernel readahead (shows the read amplification)")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)

    made = args.file is None
    path = make_table(args.dir, args.make_gib) if made else args.file
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            table_map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if not args.no_madv_random:
            table_map.madvise(mmap.MADV_RANDOM)
        table = np.frombuffer(table_map, dtype=np.int16,
                              count=size // ROW_BYTES * ROW_ELEMS)
        table = table.reshape(-1, ROW_ELEMS)
        rng = np.random.default_rng(1)
        results = []
        token_counts = [int(t) for t in args.tokens.split(",")]
        warm_cache(path)
        for tokens in token_counts:
            results.append({"cache": "warm", **run_case(table, tokens, args.steps, rng)})
        for tokens in token_counts:
            steps = max(1, min(args.steps, args.cold_rows // (tokens * ROWS_PER_TOKEN)))
            drop_cache(path, table_map)
            results.append({"cache": "cold", **run_case(table, tokens, steps, rng)})
        del table
        table_map.close()
    finally:
        if made:
            os.unlink(path)

    report = {
        "bench": "ple_gather",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "file_bytes": size,
        "file_rows": size // ROW_BYTES,
        "rows_per_token": ROWS_PER_TOKEN,
        "row_bytes": ROW_BYTES,
        "madv_random": not args.no_madv_random,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in results:
            print(
                f"{r['cache']:4s} tokens={r['tokens_per_step']:4d}: "
                f"{r['rows_per_s']:.3g} rows/s, p50 {r['step_ms_p50']:.3f} ms, "
                f"p90 {r['step_ms_p90']:.3f} ms, {r['us_per_token']:.2f} us/token, "
                f"storage {r['storage_bytes_per_row']} B/row"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
