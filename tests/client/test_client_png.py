"""tinypng: the pure-Python PNG writer the tools plot with (no matplotlib on the serving host)."""

import struct
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tinypng  # noqa: E402


def test_png_roundtrip_pixels(tmp_path):
    c = tinypng.Canvas(20, 10)
    c.rect(2, 3, 5, 4, (255, 0, 0))
    c.line(0, 9, 19, 9, (0, 0, 255))
    c.text(10, 1, "7", (0, 128, 0))
    p = tmp_path / "x.png"
    c.save(str(p))
    w, h, rgb = tinypng.read_png(p.read_bytes())
    assert (w, h) == (20, 10)
    px = lambda x, y: tuple(rgb[3 * (y * w + x):3 * (y * w + x) + 3])  # noqa: E731
    assert px(2, 3) == px(5, 4) == (255, 0, 0) and px(6, 4) == (255, 255, 255)
    assert all(px(x, 9) == (0, 0, 255) for x in range(20))
    # "7": top row is 5 pixels of ink, then a single one at the right
    assert [px(10 + i, 1) for i in range(5)] == [(0, 128, 0)] * 5
    assert px(14, 2) == (0, 128, 0) and px(10, 2) == (255, 255, 255)
    # the file is a standard PNG: IHDR says 8-bit RGB, IDAT inflates to h rows of 1 + 3w bytes
    data = p.read_bytes()
    assert struct.unpack(">IIBB", data[16:26]) == (20, 10, 8, 2)
    n = struct.unpack(">I", data[33:37])[0]
    assert len(zlib.decompress(data[41:41 + n])) == 10 * (1 + 60)


def test_charts_draw_series(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYPNG_BACKEND", "tinypng")  # pixel checks: the pure-Python writer
    p = tmp_path / "l.png"
    tinypng.line_chart({"a": [(1, 10.0), (2, 20.0), (4, 40.0)], "b": [(1, 5.0), (4, None)]}, str(p),
                       title="t", xlabel="x", ylabel="y", log2_x=True)
    w, h, rgb = tinypng.read_png(p.read_bytes())
    colors = {tuple(rgb[i:i + 3]) for i in range(0, len(rgb), 3)}
    assert tinypng.PALETTE[0] in colors and tinypng.PALETTE[1] in colors
    p2 = tmp_path / "b.png"
    tinypng.bar_chart(["G1", "G2"], {"s": [10.0, -5.0]}, str(p2), title="c", ylabel="%")
    w, h, rgb = tinypng.read_png(p2.read_bytes())
    ink = sum(tuple(rgb[i:i + 3]) == tinypng.PALETTE[0] for i in range(0, len(rgb), 3))
    assert ink > 500  # two bars (and the legend swatch)


def test_nice_ticks():
    assert tinypng.nice_ticks(0, 97) == [0, 20, 40, 60, 80, 100]
    assert tinypng.nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]


def test_matplotlib_backend_when_installed(tmp_path, monkeypatch):
    """With matplotlib the same calls write a titled, labelled chart through it;
    TINYPNG_BACKEND=tinypng forces the pure-Python writer."""
    import pytest

    pytest.importorskip("matplotlib")
    p = tmp_path / "l.png"
    assert tinypng.line_chart({"a": [(1, 10.0), (2, 20.0)]}, str(p), title="t", xlabel="x", ylabel="y",
                              log2_x=True) == "matplotlib"
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert tinypng.bar_chart(["G1", "G2"], {"s": [10.0, None]}, str(tmp_path / "b.png")) == "matplotlib"
    import drive_probe

    assert drive_probe.write_plot(str(tmp_path / "d.png"), [0.0, 1.0], [0.1, 80.0], 50.0, "t") == "matplotlib"
    monkeypatch.setenv("TINYPNG_BACKEND", "tinypng")
    assert tinypng.line_chart({"a": [(1, 1.0)]}, str(p)) == "tinypng"
    tinypng.read_png(p.read_bytes())
