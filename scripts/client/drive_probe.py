#!/usr/bin/env python3
"""Random-read latency probe for the drive that holds the PLE table (the write-up, 3.7).

Reads 4 KiB blocks at random 4 KiB-aligned offsets of FILE with O_DIRECT (no
page cache) at queue depth 1 for --seconds, like the PLE gather's page faults
do, and reports p50 / p99 / p99.9 / max, stall windows (time windows in which
*every* read was slower than --stall-ms), a latency-over-time PNG and the
equivalent fio command (drive reviews publish fio's figures).

It refuses files whose reads would not reach a drive (on tmpfs, sparse, or
fallocate'd without being written: such reads return in microseconds from
memory) unless --force, and flags any run whose p50 is faster than NVMe flash
can be (exit status 1).

Why: a DRAM-less QLC NVMe stalled every read at ~140 ms for seconds at a time
(max 970 ms) and stopped decode for 100-780 ms; a Crucial P310 had p50
0.106 ms, max 22 ms under the same probe. Pick the drive by the tail.

    python3 scripts/client/drive_probe.py /srv/nvme/ple_table.bin --seconds 60 --png probe.png --json probe.json

Needs only the standard library (the PNG uses matplotlib when it is installed,
else scripts/client/tinypng.py). Exit status: 0 ok, 1 figures flagged (not a
drive's), 130 interrupted (partial results printed and written).
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import random
import shlex
import struct
import sys
import time

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


def _fmt_ms(v: float) -> str:
    return f"{v:g} ms" if v >= 1 else f"{v * 1000:g} us"


def plot(times_s: list[float], lat_ms: list[float], stall_ms: float, w=1200, h=500,
         title: str = "4 KiB random reads, QD1") -> bytes:
    """Latency (log scale, one decade per gridline) over time, one dot per
    read; red dots are reads slower than stall_ms (dashed line). Pure Python
    (scripts/client/tinypng.py): title, axis names and a legend; the PNG's bytes."""
    import tinypng as tp

    c = tp.Canvas(w, h)
    left, right, top, bottom = 80, w - 40, 48, h - 42  # right margin: the last x label fits
    lo, hi = 0.001, 1000.0  # 1 us .. 1 s
    tmax = max(times_s[-1] if times_s else 1.0, 1e-3)
    blue, red, grid = (0, 70, 200), (220, 0, 0), (225, 225, 225)

    def ypix(ms: float) -> int:
        ms = min(max(ms, lo), hi)
        f = (math.log10(ms) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
        return int(bottom - f * (bottom - top))

    c.text(max(4, (w - tp.text_width(title, 2)) // 2), 6, title, tp.BLACK, 2)
    for e in range(-3, 4):
        y = ypix(10.0**e)
        c.line(left, y, right, y, grid)
        lab = _fmt_ms(10.0**e)
        c.text(left - 6 - tp.text_width(lab), y - 3, lab, tp.GREY)
    y = ypix(stall_ms)
    for x in range(left, right, 8):
        c.line(x, y, min(x + 4, right), y, (255, 150, 150))
    c.line(left, top, left, bottom, tp.BLACK)
    c.line(left, bottom, right, bottom, tp.BLACK)
    for k in range(0, 11):
        x = left + int(k / 10 * (right - left))
        c.line(x, bottom, x, bottom + 4, tp.BLACK)
        lab = f"{tmax * k / 10:.0f}" if tmax >= 10 else f"{tmax * k / 10:.1f}"
        c.text(x - tp.text_width(lab) // 2, bottom + 8, lab, tp.GREY)
    xlabel = "time since start (s)"
    c.text((left + right - tp.text_width(xlabel)) // 2, h - 14, xlabel)
    ylabel = "read latency (log)"
    c.text_vertical(6, (top + bottom + tp.text_width(ylabel)) // 2, ylabel)
    # legend, top right, inside the frame
    items = [(blue, f"read <= {_fmt_ms(stall_ms)}"), (red, f"read > {_fmt_ms(stall_ms)}"),
             ((255, 150, 150), "stall threshold")]
    lw = max(tp.text_width(t) for _, t in items) + 24
    lx, ly = right - lw - 4, top + 4
    c.rect(lx - 4, ly - 4, right - 2, ly + 12 * len(items), tp.WHITE)
    for i, (col, t) in enumerate(items):
        c.rect(lx, ly + 12 * i + 1, lx + 10, ly + 12 * i + 6, col)
        c.text(lx + 16, ly + 12 * i, t)
    for t, ms in zip(times_s, lat_ms):
        x = left + int(t / tmax * (right - left - 1))
        c.set(x, ypix(ms), red if ms > stall_ms else blue)
    return c.png()


def write_plot(path: str, times_s: list[float], lat_ms: list[float], stall_ms: float, title: str) -> str:
    """matplotlib where installed, else plot(); returns the backend used."""
    import tinypng as tp

    plt = tp.pyplot()
    if plt is None:
        with open(path, "wb") as f:
            f.write(plot(times_s, lat_ms, stall_ms, title=title))
        return "tinypng"
    fig, ax = plt.subplots(figsize=(12, 5), dpi=100)
    fast = [(t, v) for t, v in zip(times_s, lat_ms) if v <= stall_ms]
    slow = [(t, v) for t, v in zip(times_s, lat_ms) if v > stall_ms]
    ax.scatter([t for t, _ in fast], [v for _, v in fast], s=2, color="#0046c8",
               label=f"read <= {_fmt_ms(stall_ms)}")
    ax.scatter([t for t, _ in slow], [v for _, v in slow], s=4, color="#dc0000",
               label=f"read > {_fmt_ms(stall_ms)}")
    ax.axhline(stall_ms, color="#ff9696", linestyle="--", label="stall threshold")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("read latency (ms, log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return "matplotlib"


# Filesystems whose pages live in RAM: a read never reaches a drive.
MEMORY_FS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs", "shm"}
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "9p", "virtiofs", "fuse.sshfs", "ceph", "glusterfs"}
FS_IOC_FIEMAP = 0xC020660B
FIEMAP_EXTENT_UNWRITTEN = 0x800
# Below this p50 the reads did not come from NAND flash: a 4 KiB random read
# at QD1 takes about 50-100 us on NVMe flash (write-up: P310 p50 0.106 ms);
# memory-backed reads measured 1.6-2.5 us.
PLAUSIBLE_P50_MS = 0.02


def mount_of(path: str) -> dict:
    """{mount_point, fstype, source} of the mount holding path (from /proc/self/mountinfo)."""
    real = os.path.realpath(path)
    best = {"mount_point": "/", "fstype": "?", "source": "?"}
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    best_len = -1
    for ln in lines:
        left, _, right = ln.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 2:
            continue
        mp = fields[4].replace("\\040", " ")
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) >= best_len:
            best_len = len(mp)
            best = {"mount_point": mp, "fstype": rfields[0], "source": rfields[1]}
    return best


def block_device(path: str) -> dict:
    """The block device under path (sysfs): {name, model}; {} when not found."""
    st = os.stat(path)
    base = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    try:
        real = os.path.realpath(base)
    except OSError:
        return {}
    if not os.path.exists(real):
        return {}
    out = {"name": os.path.basename(real)}
    for d in (real, os.path.dirname(real)):  # a partition's model is its disk's
        try:
            with open(os.path.join(d, "device", "model")) as f:
                out["model"] = f.read().strip()
                break
        except OSError:
            continue
    return out


def unbacked_blocks(path: str, samples: int = 64, seed: int = 1) -> tuple[int, int, str]:
    """(sampled 4 KiB blocks with no written data behind them: holes or
    unwritten (fallocate'd) extents, samples, method). Reads of such blocks
    return zeros without touching the drive."""
    import fcntl

    size = os.path.getsize(path)
    blocks = size // BLOCK
    rng = random.Random(seed)
    offs = sorted({rng.randrange(blocks) * BLOCK for _ in range(samples)}) if blocks else []
    fd = os.open(path, os.O_RDONLY)
    try:
        bad, method = 0, "fiemap"
        for off in offs:
            buf = bytearray(struct.pack("=QQIIII", off, BLOCK, 0, 0, 1, 0) + bytes(56))
            try:
                fcntl.ioctl(fd, FS_IOC_FIEMAP, buf, True)
            except OSError:
                method = "seek_data"
                break
            (mapped,) = struct.unpack_from("=I", buf, 20)
            flags = struct.unpack_from("=I", buf, 32 + 40)[0]
            if mapped == 0 or flags & FIEMAP_EXTENT_UNWRITTEN:
                bad += 1
        if method == "seek_data":  # no FIEMAP (tmpfs, some FUSE): holes only
            bad = 0
            for off in offs:
                try:
                    if os.lseek(fd, off, os.SEEK_DATA) != off:
                        bad += 1
                except OSError:  # ENXIO: no data after off
                    bad += 1
        return bad, len(offs), method
    finally:
        os.close(fd)


def backing(path: str) -> tuple[dict, list[str]]:
    """What stands behind the file, and the reasons its reads would not
    measure a drive (empty when it looks like a file on a drive)."""
    info: dict = {"mount": mount_of(path), "device": block_device(path)}
    reasons = []
    fs = info["mount"]["fstype"]
    dev = info["device"].get("name", "")
    if fs in MEMORY_FS:
        reasons.append(f"it is on {fs} ({info['mount']['mount_point']}): its pages live in RAM")
    elif fs in NETWORK_FS or fs.startswith("fuse"):
        reasons.append(f"it is on a network/FUSE filesystem ({fs}): latency is the network's")
    if dev.startswith(("zram", "ram", "pmem")):
        reasons.append(f"its block device {dev} is memory-backed")
    st = os.stat(path)
    bad, n, method = unbacked_blocks(path)
    info["unbacked_samples"] = {"unbacked": bad, "sampled": n, "method": method}
    allocated = st.st_blocks * 512
    info["allocated_bytes"] = allocated
    if n and bad * 10 >= n:
        what = "holes or unwritten (fallocate'd) extents" if method == "fiemap" else "holes"
        reasons.append(f"{bad} of {n} sampled 4 KiB blocks are {what}: reads return zeros "
                       "without touching the drive (a sparse or preallocated file)")
    elif allocated < st.st_size // 2 and fs not in MEMORY_FS:
        reasons.append(f"only {allocated} of its {st.st_size} bytes are allocated (a sparse file)")
    return info, reasons


def fio_command(path: str, seconds: float, buffered: bool) -> str:
    """The fio job that measures what this probe measures (published drive
    reviews use fio; compare its clat percentiles, which fio prints in us)."""
    return (f"fio --name=ple-drive-probe --filename={shlex.quote(path)} --readonly --rw=randread "
            f"--bs=4k --iodepth=1 --numjobs=1 --ioengine=psync --direct={0 if buffered else 1} "
            f"--time_based --runtime={max(1, int(round(seconds)))} --norandommap --randrepeat=0 "
            "--percentile_list=50:90:99:99.9")


class _Progress:
    """tqdm when installed, else a line on stderr every 10 s (bare python3)."""

    def __init__(self, total_s: float, enabled: bool):
        self.total, self.bar, self.enabled, self.last = total_s, None, enabled, 0.0
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=int(total_s), unit="s", desc="drive probe", leave=False)
            except ImportError:
                print(f"drive probe: {total_s:g} s of reads ...", file=sys.stderr, flush=True)

    def update(self, elapsed: float, reads: int) -> None:
        if self.bar is not None:
            if int(elapsed) > self.bar.n:
                self.bar.update(int(elapsed) - self.bar.n)
        elif self.enabled and elapsed - self.last >= 10:
            self.last = elapsed
            print(f"drive probe: {elapsed:.0f}/{self.total:g} s, {reads} reads", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def probe(path: str, seconds: float, *, max_reads: int | None = None, seed: int = 0,
          buffered: bool = False, progress: bool = True):
    """Run the probe; returns (times_s, lat_ms, interrupted) per read. Ctrl-C
    ends it early and keeps the reads made so far."""
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
    bar = _Progress(seconds, progress)
    interrupted = False
    try:
        if buffered:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t_start = time.perf_counter()
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
            bar.update(el, len(lats))
            if el >= seconds or (max_reads and len(lats) >= max_reads):
                break
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
        os.close(fd)
        buf.close()
    return times, lats, interrupted


def _check_writable(path: str | None, what: str) -> None:
    if not path or path == "-":
        return
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise SystemExit(f"error: {what} {path}: directory {d} does not exist (create it first)")
    if not os.access(d, os.W_OK):
        raise SystemExit(f"error: {what} {path}: directory {d} is not writable")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help="a large file on the drive to test (e.g. the PLE table)")
    ap.add_argument("--seconds", type=float, default=30.0, help="probe duration (default 30)")
    ap.add_argument("--max-reads", type=int, default=None, help="stop after this many reads")
    ap.add_argument("--stall-ms", type=float, default=50.0,
                    help="a window is a stall when every read in it is slower than this (default 50)")
    ap.add_argument("--window-ms", type=float, default=500.0, help="stall window length (default 500)")
    ap.add_argument("--png", default=None, help="write a latency-over-time plot here (matplotlib if "
                                                "installed, else pure Python)")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                    help="write the result as JSON to PATH (or stdout without PATH; the summary then "
                         "goes to stderr)")
    ap.add_argument("--buffered", action="store_true",
                    help="no O_DIRECT: buffered reads with DONTNEED after each (filesystems "
                         "without direct I/O; less exact)")
    ap.add_argument("--force", action="store_true",
                    help="probe a file whose reads cannot reach a drive (tmpfs, sparse, "
                         "fallocate'd) anyway; the figures are then flagged, not a drive's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    argv = sys.argv[1:] if argv is None else list(argv)
    a = ap.parse_args(argv)
    if a.seconds <= 0:
        ap.error("--seconds must be > 0")
    if a.max_reads is not None and a.max_reads < 1:
        ap.error("--max-reads must be >= 1")
    if not os.path.exists(a.file):
        raise SystemExit(f"error: {a.file}: no such file. Give a large file on the drive to test, "
                         "e.g. the PLE table (PLE_TABLE in .env) once make_ple_table.py has written it")
    if not os.path.isfile(a.file):
        raise SystemExit(f"error: {a.file}: not a regular file (give a file on the drive, not a "
                         "directory or a device)")
    if not os.access(a.file, os.R_OK):
        raise SystemExit(f"error: {a.file}: not readable by this user (run with sudo, or chmod)")
    _check_writable(a.png, "--png")
    _check_writable(a.json, "--json")
    info, reasons = backing(a.file)
    if reasons and not a.force:
        raise SystemExit(
            f"error: {a.file} would not measure a drive: " + "; ".join(reasons) + ".\n"
            "Probe the PLE table itself once make_ple_table.py has written it, or a file of real "
            "data on that drive, e.g.\n"
            "  dd if=/dev/urandom of=/srv/nvme/probe.bin bs=1M count=8192 oflag=direct\n"
            "(--force probes it anyway; the figures are then flagged)")
    out = sys.stderr if a.json == "-" else sys.stdout

    times, lats, interrupted = probe(a.file, a.seconds, max_reads=a.max_reads, seed=a.seed,
                                     buffered=a.buffered, progress=not a.no_progress)
    if not lats:
        raise SystemExit("error: interrupted before the first read completed: nothing to report")
    res = {
        "file": os.path.abspath(a.file),
        "file_bytes": os.path.getsize(a.file),
        "mode": "buffered+DONTNEED" if a.buffered else "O_DIRECT",
        "block_bytes": BLOCK,
        "queue_depth": 1,
        "seconds": round(times[-1] if times else 0.0, 3),
        "interrupted": interrupted,
        **summarize(lats),
        "stall_ms": a.stall_ms,
        "window_ms": a.window_ms,
        "stalls": stall_windows(times, lats, a.window_ms, a.stall_ms),
        "reads_over_stall_ms": sum(1 for v in lats if v > a.stall_ms),
        "backing": info,
        "warnings": list(reasons),
        "fio_equivalent": fio_command(os.path.abspath(a.file), a.seconds, a.buffered),
        "command": " ".join(["python3", "scripts/client/drive_probe.py", *argv]),
    }
    if res["p50_ms"] < PLAUSIBLE_P50_MS:
        res["warnings"].append(
            f"p50 {res['p50_ms']} ms is faster than any NVMe flash read (about 0.05-0.1 ms at QD1): "
            "these reads came from memory (page cache, sparse/unwritten blocks or tmpfs), not the drive")
    dev = info["device"]
    where = (f"{dev.get('name', '?')}" + (f" ({dev['model']})" if dev.get("model") else "")
             + f", {info['mount']['fstype']} on {info['mount']['mount_point']}")
    if a.png:
        title = f"{os.path.basename(a.file)} on {dev.get('name', '?')}: 4 KiB random reads, QD1, {res['mode']}"
        if res["warnings"]:
            title += " (NOT A DRIVE)"
        res["png_backend"] = write_plot(a.png, times, lats, a.stall_ms, title)
        res["png"] = os.path.abspath(a.png)
    print(
        f"{res['reads']} reads in {res['seconds']} s ({res['mode']}, 4 KiB, QD1) of {a.file} on {where}"
        + (" [interrupted]" if interrupted else "") + ":\n"
        f"  p50 {res['p50_ms']} ms  p90 {res['p90_ms']} ms  p99 {res['p99_ms']} ms  "
        f"p99.9 {res['p99_9_ms']} ms  max {res['max_ms']} ms; {len(res['stalls'])} stall window(s) "
        f"(every read > {a.stall_ms} ms for >= {a.window_ms} ms)",
        file=out,
    )
    for s in res["stalls"][:10]:
        print(f"  stall at {s['start_s']} s for {s['duration_s']} s: {s['reads']} reads, "
              f"{s['min_ms']}-{s['max_ms']} ms", file=out)
    for w in res["warnings"]:
        print(f"  WARNING: not a drive's figures: {w}", file=out)
    print("  reference (the write-up, 3.7): Crucial P310 p50 0.106 ms, max 22 ms; a DRAM-less QLC "
          "drive had seconds-long stalls at ~140 ms (max 970 ms): pick by p99.9/max.", file=out)
    print(f"  the same measurement with fio (as drive reviews publish; compare its clat percentiles):\n"
          f"    {res['fio_equivalent']}", file=out)
    if a.png:
        print(f"wrote {a.png} ({res['png_backend']})", file=out)
    if a.json:
        text = json.dumps(res, indent=2)
        if a.json == "-":
            print(text)
        else:
            with open(a.json, "w") as f:
                f.write(text + "\n")
            print(f"wrote {a.json}", file=out)
    return 1 if res["warnings"] else (130 if interrupted else 0)


if __name__ == "__main__":
    sys.exit(main())
