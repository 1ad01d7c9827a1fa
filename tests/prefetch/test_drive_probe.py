"""scripts/drive_probe.py: statistics, stall windows, PNG, and a short real run."""

import json
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


def test_png_marks_slow_reads_red():
    data = dp.plot([0.0, 1.0, 2.0], [0.1, 140.0, 0.2], stall_ms=50, w=300, h=200)
    w, h, raw = png_pixels(data)
    assert (w, h) == (300, 200)
    assert b"\xdc\x00\x00" in raw  # the 140 ms read (red)
    assert b"\x00\x46\xc8" in raw  # fast reads (blue)


def test_real_probe_json(tmp_path, capsys):
    f = tmp_path / "blob.bin"
    f.write_bytes(b"\x01" * (4096 * 64))
    out = tmp_path / "r.json"
    png = tmp_path / "r.png"
    args = [str(f), "--seconds", "5", "--max-reads", "300", "--json", str(out),
            "--png", str(png), "--no-progress"]
    try:
        dp.main(args)
    except SystemExit as e:  # filesystem without O_DIRECT
        if "O_DIRECT" not in str(e):
            raise
        dp.main(args + ["--buffered"])
    res = json.loads(out.read_text())
    assert res["reads"] == 300 and res["queue_depth"] == 1 and res["block_bytes"] == 4096
    assert 0 < res["p50_ms"] <= res["p99_ms"] <= res["p99_9_ms"] <= res["max_ms"]
    assert "--max-reads" in res["command"]
    png_pixels(png.read_bytes())
    tiny = tmp_path / "tiny"
    tiny.write_bytes(b"x")
    with pytest.raises(SystemExit, match="at least 4096"):
        dp.probe(str(tiny), 1)
