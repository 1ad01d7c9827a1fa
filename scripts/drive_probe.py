#!/usr/bin/env python3
"""Random-read latency probe for the drive that holds the PLE table (SPEC §3.7).

Reads 4 KiB blocks at random 4 KiB-aligned offsets of FILE with O_DIRECT (no
page cache) at queue depth 1 for --seconds, like the PLE gather's page faults
do, and reports p50 / p99 / p99.9 / max, stall windows (time windows in which
*every* read was slower than --stall-ms) and a latency-over-time PNG.

Why: a DRAM-less QLC NVMe stalled every read at ~140 ms for seconds at a time
(max 970 ms) and stopped decode for 100-780 ms; a Crucial P310 had p50
0.106 ms, max 22 ms under the same probe. Pick the drive by the tail.

    python scripts/drive_probe.py /models/ple_table.bin --seconds 60 --png probe.png --json probe.json

Needs only the standard library (the PNG is written with zlib; no matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import random
import struct
import sys
import time
import zlib

BLOCK = 4096


def percentile(sorted_vals: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in [0, 100])."""
    if not sorted_vals:
        return float("nan")
    # 1e-9: 99.9 / 100 * 1000 is 999.0000000000001 in floating point.
    k = math.ceil(q / 100 * len(sorted_vals) - 1e-9) - 1
    k = max(0, min(len(sorted_vals) - 1, k))
    return sorted_vals[k]


def stall_windows(
    times_s: list[float], lat_ms: list[float], window_ms: float, stall_ms: float
) -> list[dict]:
    """Windows of ``window_ms`` (aligned to the probe start) in which every
    read (at least one) took longer than ``stall_ms``; adjacent stalled
    windows are merged into one span."""
    buckets: dict[int, list[float]] = {}
    for t, lat in zip(times_s, lat_ms):
        buckets.setdefault(int(t * 1000 // window_ms), []).append(lat)
    stalled = sorted(i for i, v in buckets.items() if v and min(v) > stall_ms)
    spans: list[dict] = []
    for i in stalled:
        v = buckets[i]
        if spans and spans[-1]["_last"] == i - 1:
            s = spans[-1]
            s["_last"] = i
            s["reads"] += len(v)
            s["max_ms"] = max(s["max_ms"], max(v))
            s["min_ms"] = min(s["min_ms"], min(v))
        else:
            spans.append(
                {"_first": i, "_last": i, "reads": len(v), "max_ms": max(v), "min_ms": min(v)}
            )
    out = []
    for s in spans:
        out.append(
            {
                "start_s": round(s["_first"] * window_ms / 1000, 3),
                "duration_s": round((s["_last"] - s["_first"] + 1) * window_ms / 1000, 3),
                "reads": s["reads"],
                "min_ms": round(s["min_ms"], 3),
                "max_ms": round(s["max_ms"], 3),
            }
        )
    return out


def summarize(lat_ms: list[float]) -> dict:
    s = sorted(lat_ms)
    n = len(s)
    return {
        "reads": n,
        "mean_ms": round(sum(s) / n, 4) if n else None,
        "p50_ms": round(percentile(s, 50), 4),
        "p90_ms": round(percentile(s, 90), 4),
        "p99_ms": round(percentile(s, 99), 4),
        "p99_9_ms": round(percentile(s, 99.9), 4),
        "max_ms": round(s[-1], 4) if n else None,
    }


# ---- a tiny PNG writer (RGB, zlib) ----
_FONT = {  # 3x5 glyphs, rows top to bottom, 3 bits each
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7),
    "3": (7, 1, 3, 1, 7), "4": (5, 5, 7, 1, 1), "5": (7, 4, 7, 1, 7),
    "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 2, 2), "8": (7, 5, 7, 5, 7),
    "9": (7, 5, 7, 1, 7), ".": (0, 0, 0, 0, 2), "m": (0, 0, 7, 7, 5),
    "s": (0, 3, 6, 1, 6), " ": (0, 0, 0, 0, 0), "u": (0, 0, 5, 5, 7),
}


class Canvas:
    def __init__(self, w: int, h: int, bg=(255, 255, 255)):
        self.w, self.h = w, h
        self.px = bytearray(bytes(bg) * (w * h))

    def set(self, x: int, y: int, rgb) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = (y * self.w + x) * 3
            self.px[i : i + 3] = bytes(rgb)

    def hline(self, y: int, x0: int, x1: int, rgb) -> None:
        for x in range(x0, x1):
            self.set(x, y, rgb)

    def vline(self, x: int, y0: int, y1: int, rgb) -> None:
        for y in range(y0, y1):
            self.set(x, y, rgb)

    def text(self, x: int, y: int, s: str, rgb=(0, 0, 0), scale: int = 2) -> None:
        for ch in s:
            glyph = _FONT.get(ch, _FONT[" "])
            for r, bits in enumerate(glyph):
                for c in range(3):
                    if bits >> (2 - c) & 1:
                        for dy in range(scale):
                            for dx in range(scale):
                                self.set(x + c * scale + dx, y + r * scale + dy, rgb)
            x += 4 * scale

    def png(self) -> bytes:
        raw = b"".join(
            b"\x00" + bytes(self.px[y * self.w * 3 : (y + 1) * self.w * 3]) for y in range(self.h)
        )

        def chunk(tag: bytes, data: bytes) -> bytes:
            return (
                struct.pack(">I", len(data))
                + tag
                + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)
            )

        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6))
            + chunk(b"IEND", b"")
        )


def _fmt_ms(v: float) -> str:
    return f"{v:g}ms" if v >= 1 else f"{v * 1000:g}us"


def plot(times_s: list[float], lat_ms: list[float], stall_ms: float, w=1200, h=500) -> bytes:
    """Latency (log scale, one decade per gridline) over time, one dot per
    read; red dots are reads slower than stall_ms (dashed line)."""
    c = Canvas(w, h)
    left, right, top, bottom = 70, w - 10, 10, h - 30
    lo, hi = 0.01, 1000.0  # 10 us .. 1 s
    tmax = max(times_s[-1] if times_s else 1.0, 1e-3)

    def ypix(ms: float) -> int:
        ms = min(max(ms, lo), hi)
        f = (math.log10(ms) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
        return int(bottom - f * (bottom - top))

    for e in range(-2, 4):
        y = ypix(10.0**e)
        c.hline(y, left, right, (220, 220, 220))
        c.text(4, y - 5, _fmt_ms(10.0**e))
    y = ypix(stall_ms)
    for x in range(left, right, 6):
        c.hline(y, x, x + 3, (255, 150, 150))
    c.vline(left, top, bottom + 1, (0, 0, 0))
    c.hline(bottom, left, right, (0, 0, 0))
    for k in range(0, 11):
        x = left + int(k / 10 * (right - left))
        c.vline(x, bottom, bottom + 4, (0, 0, 0))
        c.text(x - 8, bottom + 8, f"{tmax * k / 10:.0f}s" if tmax >= 10 else f"{tmax * k / 10:.1f}s")
    for t, ms in zip(times_s, lat_ms):
        x = left + int(t / tmax * (right - left - 1))
        rgb = (220, 0, 0) if ms > stall_ms else (0, 70, 200)
        c.set(x, ypix(ms), rgb)
    return c.png()


def probe(path: str, seconds: float, *, max_reads: int | None = None, seed: int = 0,
          buffered: bool = False, progress: bool = True):
    """Run the probe; returns (times_s, lat_ms) per read."""
    size = os.path.getsize(path)
    blocks = size // BLOCK
    if blocks < 1:
        raise SystemExit(f"{path}: need a file of at least {BLOCK} bytes (it has {size})")
    flags = os.O_RDONLY | (0 if buffered else getattr(os, "O_DIRECT", 0))
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise SystemExit(
            f"{path}: cannot open with O_DIRECT ({e.strerror}). The file must be on the "
            "drive itself (not tmpfs/overlay without direct I/O); or pass --buffered "
            "(page cache dropped with posix_fadvise, less exact)."
        ) from e
    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT requires
    rng = random.Random(seed)
    times, lats = [], []
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=int(seconds), unit="s", desc="drive probe", leave=False)
        except ImportError:
            bar = None
    try:
        if buffered:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t_start = time.perf_counter()
        next_tick = 1.0
        while True:
            off = rng.randrange(blocks) * BLOCK
            t0 = time.perf_counter()
            n = os.preadv(fd, [buf], off)
            t1 = time.perf_counter()
            if n != BLOCK:
                raise SystemExit(f"short read at offset {off}: {n} bytes")
            if buffered:
                os.posix_fadvise(fd, off, BLOCK, os.POSIX_FADV_DONTNEED)
            times.append(t0 - t_start)
            lats.append((t1 - t0) * 1000)
            el = t1 - t_start
            if bar is not None and el >= next_tick:
                bar.update(int(el) - bar.n)
                next_tick = int(el) + 1
            if el >= seconds or (max_reads and len(lats) >= max_reads):
                break
    finally:
        if bar is not None:
            bar.close()
        os.close(fd)
        buf.close()
    return times, lats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help="a large file on the drive to test (e.g. the PLE table)")
    ap.add_argument("--seconds", type=float, default=30.0, help="probe duration (default 30)")
    ap.add_argument("--max-reads", type=int, default=None, help="stop after this many reads")
    ap.add_argument("--stall-ms", type=float, default=50.0,
                    help="a window is a stall when every read in it is slower than this (default 50)")
    ap.add_argument("--window-ms", type=float, default=500.0, help="stall window length (default 500)")
    ap.add_argument("--png", default=None, help="write a latency-over-time plot here")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                    help="write the result as JSON to PATH (or stdout without PATH)")
    ap.add_argument("--buffered", action="store_true",
                    help="no O_DIRECT: buffered reads with DONTNEED after each (filesystems "
                         "without direct I/O; less exact)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    argv = sys.argv[1:] if argv is None else list(argv)
    a = ap.parse_args(argv)

    times, lats = probe(a.file, a.seconds, max_reads=a.max_reads, seed=a.seed,
                        buffered=a.buffered, progress=not a.no_progress)
    res = {
        "file": os.path.abspath(a.file),
        "file_bytes": os.path.getsize(a.file),
        "mode": "buffered+DONTNEED" if a.buffered else "O_DIRECT",
        "block_bytes": BLOCK,
        "queue_depth": 1,
        "seconds": round(times[-1] if times else 0.0, 3),
        **summarize(lats),
        "stall_ms": a.stall_ms,
        "window_ms": a.window_ms,
        "stalls": stall_windows(times, lats, a.window_ms, a.stall_ms),
        "reads_over_stall_ms": sum(1 for v in lats if v > a.stall_ms),
        "command": " ".join(["python", "scripts/drive_probe.py", *argv]),
    }
    if a.png:
        with open(a.png, "wb") as f:
            f.write(plot(times, lats, a.stall_ms))
        res["png"] = os.path.abspath(a.png)
    print(
        f"{res['reads']} reads in {res['seconds']} s ({res['mode']}, 4 KiB, QD1): "
        f"p50 {res['p50_ms']} ms  p99 {res['p99_ms']} ms  p99.9 {res['p99_9_ms']} ms  "
        f"max {res['max_ms']} ms; {len(res['stalls'])} stall window(s) "
        f"(every read > {a.stall_ms} ms for >= {a.window_ms} ms)",
        file=sys.stderr,
    )
    for s in res["stalls"][:10]:
        print(f"  stall at {s['start_s']} s for {s['duration_s']} s: {s['reads']} reads, "
              f"{s['min_ms']}-{s['max_ms']} ms", file=sys.stderr)
    print("  reference (article §3.7): Crucial P310 p50 0.106 ms, max 22 ms; a DRAM-less QLC "
          "drive had seconds-long stalls at ~140 ms (max 970 ms): pick by p99.9/max.",
          file=sys.stderr)
    if a.json:
        text = json.dumps(res, indent=2)
        if a.json == "-":
            print(text)
        else:
            with open(a.json, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
