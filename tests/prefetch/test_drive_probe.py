"""scripts/client/drive_probe.py: statistics, stall windows, PNG, a short real run, and the
refusal of files whose reads cannot reach a drive (sparse, fallocate'd, tmpfs)."""

import json
import os
import struct
import zlib

import pytest

import drive_probe as dp


def test_percentile_nearest_rank():
    v = sorted(float(i) for i in range(1, 1001))
    assert dp.percentile(v, 50) == 500 and dp.percentile(v, 99) == 990
    assert dp.percentile(v, 99.9) == 999 and dp.percentile(v, 100) == 1000
    assert dp.percentile([3.0], 99.9) == 3.0


def test_stall_windows_need_every_read_slow():
    # 0.0-0.5 s fast; 0.5-1.5 s every read 140 ms; 1.5-2.0 s one fast read
    # among slow ones (not a stall); 2.0-2.5 s slow again.
    times, lats = [], []
    t = 0.0
    while t < 2.5:
        slow = 0.5 <= t < 1.5 or 2.0 <= t < 2.5 or (1.5 <= t < 2.0 and abs(t - 1.7) > 0.01)
        times.append(t)
        lats.append(140.0 if slow else 0.1)
        t += 0.02
    spans = dp.stall_windows(times, lats, window_ms=500, stall_ms=50)
    assert [(s["start_s"], s["duration_s"]) for s in spans] == [(0.5, 1.0), (2.0, 0.5)]
    assert spans[0]["reads"] == 50 and spans[0]["max_ms"] == 140.0
    assert dp.stall_windows([0.1], [0.2], 500, 50) == []


def png_pixels(data):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        tag, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])
        assert crc == zlib.crc32(tag + body) & 0xFFFFFFFF
        chunks.setdefault(tag, b"")
        chunks[tag] += body
        pos += 12 + n
    w, h, depth, ctype = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    raw = zlib.decompress(chunks[b"IDAT"])
    assert len(raw) == h * (1 + 3 * w) and depth == 8 and ctype == 2
    return w, h, raw


def count_px(raw, w, rgb):
    rows = [raw[y * (1 + 3 * w) + 1:(y + 1) * (1 + 3 * w)] for y in range(len(raw) // (1 + 3 * w))]
    return sum(bytes(r[i:i + 3]) == bytes(rgb) for r in rows for i in range(0, len(r), 3))


def test_png_marks_slow_reads_red(monkeypatch):
    monkeypatch.setenv("TINYPNG_BACKEND", "tinypng")
    red, blue = (220, 0, 0), (0, 70, 200)
    data = dp.plot([0.0, 1.0, 2.0], [0.1, 140.0, 0.2], stall_ms=50, w=400, h=240)
    w, h, raw = png_pixels(data)
    assert (w, h) == (400, 240)
    # the legend swatches are red and blue too: the 140 ms read adds one red dot,
    # the two fast reads two blue ones
    base = png_pixels(dp.plot([0.0, 1.0, 2.0], [0.1, 0.1, 0.2], stall_ms=50, w=400, h=240))[2]
    assert count_px(raw, w, red) == count_px(base, w, red) + 1
    assert count_px(raw, w, blue) == count_px(base, w, blue) - 1


def test_real_probe_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TINYPNG_BACKEND", "tinypng")  # the PNG is checked pixel-level below
    f = tmp_path / "blob.bin"
    f.write_bytes(os.urandom(4096 * 64))
    out = tmp_path / "r.json"
    png = tmp_path / "r.png"
    args = [str(f), "--seconds", "5", "--max-reads", "300", "--json", str(out),
            "--png", str(png), "--no-progress"]
    try:
        rc = dp.main(args)
    except SystemExit as e:
        if "would not measure a drive" in str(e):  # tmp on tmpfs (some CI machines)
            args.append("--force")
        elif "O_DIRECT" not in str(e):  # filesystem without O_DIRECT
            raise
        else:
            args.append("--buffered")
        rc = dp.main(args)
    res = json.loads(out.read_text())
    assert res["reads"] == 300 and res["queue_depth"] == 1 and res["block_bytes"] == 4096
    assert 0 < res["p50_ms"] <= res["p99_ms"] <= res["p99_9_ms"] <= res["max_ms"]
    assert "--max-reads" in res["command"]
    # a 256 KiB file is in the drive's cache: the p50 check may flag it; then rc says so
    assert rc == (1 if res["warnings"] else 0)
    assert (res["p50_ms"] < dp.PLAUSIBLE_P50_MS) <= bool(res["warnings"])
    fio = res["fio_equivalent"].split()
    assert fio[0] == "fio" and {"--rw=randread", "--bs=4k", "--iodepth=1", "--readonly"} <= set(fio)
    assert f"--filename={f}" in fio and ("--direct=0" in fio) == ("--buffered" in args)
    summary = capsys.readouterr().out  # the summary goes to stdout
    assert "p50" in summary and "fio --name=" in summary
    png_pixels(png.read_bytes())
    tiny = tmp_path / "tiny"
    tiny.write_bytes(b"x")
    with pytest.raises(SystemExit, match="at least 4096"):
        dp.probe(str(tiny), 1)


def _probe_rc(args):
    try:
        return dp.main(args), ""
    except SystemExit as e:
        return e.code, str(e)


def test_files_that_are_not_on_a_drive_are_refused_or_flagged(tmp_path, capsys):
    sparse = tmp_path / "sparse.bin"
    with open(sparse, "wb") as f:
        f.truncate(4096 * 4096)  # 16 MiB of holes
    rc, msg = _probe_rc([str(sparse), "--seconds", "1", "--no-progress"])
    assert rc != 0 and "would not measure a drive" in msg and "--force" in msg
    out = tmp_path / "s.json"
    rc, _ = _probe_rc([str(sparse), "--seconds", "1", "--max-reads", "200", "--force", "--no-progress",
                       "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 1 and res["warnings"] and ("sampled 4 KiB blocks" in res["warnings"][0]
                                            or "tmpfs" in res["warnings"][0])
    assert "WARNING: not a drive's figures" in capsys.readouterr().out
    # fallocate'd, never written: unwritten extents where FIEMAP reports them
    pre = tmp_path / "pre.bin"
    fd = os.open(pre, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.posix_fallocate(fd, 0, 4096 * 4096)
    except OSError:
        pytest.skip("no fallocate on this filesystem")
    finally:
        os.close(fd)
    info, reasons = dp.backing(str(pre))
    if info["unbacked_samples"]["method"] == "fiemap" or info["mount"]["fstype"] in dp.MEMORY_FS:
        assert reasons, info


def test_tmpfs_is_refused():
    if dp.mount_of("/dev/shm")["fstype"] != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    p = f"/dev/shm/drive-probe-test-{os.getpid()}"
    with open(p, "wb") as f:
        f.write(os.urandom(4096 * 16))
    try:
        _, reasons = dp.backing(p)
    finally:
        os.unlink(p)
    assert any("tmpfs" in r for r in reasons)


def test_missing_file_and_bad_output_dir_are_messages(tmp_path):
    rc, msg = _probe_rc([str(tmp_path / "nope.bin")])
    assert rc != 0 and "no such file" in msg and "PLE_TABLE" in msg
    f = tmp_path / "blob.bin"
    f.write_bytes(os.urandom(4096 * 4))
    rc, msg = _probe_rc([str(f), "--json", str(tmp_path / "missing-dir" / "r.json")])
    assert rc != 0 and "does not exist" in msg  # found before the probe, not after
