"""Charts for the client tools: matplotlib where installed, else a tiny PNG plotter in pure Python.

The tools must run on a serving host without matplotlib, so every chart has a
fallback drawn here: an RGB canvas, lines, filled rectangles, a 5x7 bitmap
font (upper case, digits and common punctuation; lower case is drawn in
capitals) and two chart helpers, `line_chart` and `bar_chart`. Output is an
8-bit RGB PNG. Both backends draw a title, axis labels and a legend.
`pyplot()` gives matplotlib (Agg) or None; TINYPNG_BACKEND=tinypng forces the
fallback (TINYPNG_BACKEND=matplotlib insists on matplotlib).
"""

from __future__ import annotations

import math
import os
import struct
import zlib

# 5x7 glyphs, rows top to bottom, '1' = ink.
_FONT_ROWS = {
    " ": "00000|00000|00000|00000|00000|00000|00000",
    "0": "01110|10001|10011|10101|11001|10001|01110",
    "1": "00100|01100|00100|00100|00100|00100|01110",
    "2": "01110|10001|00001|00010|00100|01000|11111",
    "3": "11111|00010|00100|00010|00001|10001|01110",
    "4": "00010|00110|01010|10010|11111|00010|00010",
    "5": "11111|10000|11110|00001|00001|10001|01110",
    "6": "00110|01000|10000|11110|10001|10001|01110",
    "7": "11111|00001|00010|00100|01000|01000|01000",
    "8": "01110|10001|10001|01110|10001|10001|01110",
    "9": "01110|10001|10001|01111|00001|00010|01100",
    "A": "01110|10001|10001|11111|10001|10001|10001",
    "B": "11110|10001|10001|11110|10001|10001|11110",
    "C": "01110|10001|10000|10000|10000|10001|01110",
    "D": "11100|10010|10001|10001|10001|10010|11100",
    "E": "11111|10000|10000|11110|10000|10000|11111",
    "F": "11111|10000|10000|11110|10000|10000|10000",
    "G": "01110|10001|10000|10111|10001|10001|01111",
    "H": "10001|10001|10001|11111|10001|10001|10001",
    "I": "01110|00100|00100|00100|00100|00100|01110",
    "J": "00111|00010|00010|00010|00010|10010|01100",
    "K": "10001|10010|10100|11000|10100|10010|10001",
    "L": "10000|10000|10000|10000|10000|10000|11111",
    "M": "10001|11011|10101|10101|10001|10001|10001",
    "N": "10001|10001|11001|10101|10011|10001|10001",
    "O": "01110|10001|10001|10001|10001|10001|01110",
    "P": "11110|10001|10001|11110|10000|10000|10000",
    "Q": "01110|10001|10001|10001|10101|10010|01101",
    "R": "11110|10001|10001|11110|10100|10010|10001",
    "S": "01111|10000|10000|01110|00001|00001|11110",
    "T": "11111|00100|00100|00100|00100|00100|00100",
    "U": "10001|10001|10001|10001|10001|10001|01110",
    "V": "10001|10001|10001|10001|10001|01010|00100",
    "W": "10001|10001|10001|10101|10101|10101|01010",
    "X": "10001|10001|01010|00100|01010|10001|10001",
    "Y": "10001|10001|10001|01010|00100|00100|00100",
    "Z": "11111|00001|00010|00100|01000|10000|11111",
    ".": "00000|00000|00000|00000|00000|01100|01100",
    ",": "00000|00000|00000|00000|01100|00100|01000",
    ":": "00000|01100|01100|00000|01100|01100|00000",
    "-": "00000|00000|00000|11111|00000|00000|00000",
    "_": "00000|00000|00000|00000|00000|00000|11111",
    "+": "00000|00100|00100|11111|00100|00100|00000",
    "=": "00000|00000|11111|00000|11111|00000|00000",
    "/": "00001|00010|00010|00100|01000|01000|10000",
    "%": "11000|11001|00010|00100|01000|10011|00011",
    "(": "00010|00100|01000|01000|01000|00100|00010",
    ")": "01000|00100|00010|00010|00010|00100|01000",
    "[": "01110|01000|01000|01000|01000|01000|01110",
    "]": "01110|00010|00010|00010|00010|00010|01110",
    "<": "00010|00100|01000|10000|01000|00100|00010",
    ">": "01000|00100|00010|00001|00010|00100|01000",
    "*": "00000|00100|10101|01110|10101|00100|00000",
    "#": "01010|01010|11111|01010|11111|01010|01010",
    "'": "00100|00100|01000|00000|00000|00000|00000",
    "!": "00100|00100|00100|00100|00100|00000|00100",
    "?": "01110|10001|00001|00010|00100|00000|00100",
    "|": "00100|00100|00100|00100|00100|00100|00100",
    "~": "00000|00000|01000|10101|00010|00000|00000",
}
_UNKNOWN = "11111|10001|10001|10001|10001|10001|11111"
GLYPH_W, GLYPH_H = 5, 7

PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
BLACK, WHITE, GREY, LIGHT = (0, 0, 0), (255, 255, 255), (120, 120, 120), (225, 225, 225)


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (not installed, or TINYPNG_BACKEND=tinypng)."""
    want = os.environ.get("TINYPNG_BACKEND", "auto")
    if want == "tinypng":
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if want == "matplotlib":
            raise
        return None
    return plt


def glyph(ch: str) -> list[str]:
    return _FONT_ROWS.get(ch.upper(), _FONT_ROWS.get(ch, _UNKNOWN)).split("|")


class Canvas:
    def __init__(self, width: int, height: int, bg=WHITE):
        self.w, self.h = width, height
        self.px = bytearray(bytes(bg) * (width * height))

    def set(self, x: int, y: int, c) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i:i + 3] = bytes(c)

    def get(self, x: int, y: int) -> tuple:
        i = 3 * (y * self.w + x)
        return tuple(self.px[i:i + 3])

    def rect(self, x0: int, y0: int, x1: int, y1: int, c) -> None:
        """Filled, inclusive corners."""
        x0, x1 = sorted((int(x0), int(x1)))
        y0, y1 = sorted((int(y0), int(y1)))
        x0, x1 = max(0, x0), min(self.w - 1, x1)
        row = bytes(c) * (x1 - x0 + 1)
        for y in range(max(0, y0), min(self.h - 1, y1) + 1):
            i = 3 * (y * self.w + x0)
            self.px[i:i + len(row)] = row

    def line(self, x0, y0, x1, y1, c, width: int = 1) -> None:
        x0, y0, x1, y1 = int(round(x0)), int(round(y0)), int(round(x1)), int(round(y1))
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        r = width // 2
        for _ in range(dx - dy + 1):  # bounded: one step per pixel of the longer axis
            if r:
                self.rect(x0 - r, y0 - r, x0 + r, y0 + r, c)
            else:
                self.set(x0, y0, c)
            if x0 == x1 and y0 == y1:
                break
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, c=BLACK, scale: int = 1) -> None:
        for k, ch in enumerate(s):
            rows = glyph(ch)
            ox = x + k * (GLYPH_W + 1) * scale
            for ry, row in enumerate(rows):
                for rx, bit in enumerate(row):
                    if bit == "1":
                        self.rect(ox + rx * scale, y + ry * scale,
                                  ox + rx * scale + scale - 1, y + ry * scale + scale - 1, c)

    def text_vertical(self, x: int, y: int, s: str, c=BLACK) -> None:
        """Bottom-to-top text (y is the bottom)."""
        for k, ch in enumerate(s):
            for ry, row in enumerate(glyph(ch)):
                for rx, bit in enumerate(row):
                    if bit == "1":
                        self.set(x + ry, y - k * (GLYPH_W + 1) - rx, c)

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[3 * y * self.w: 3 * (y + 1) * self.w]) for y in range(self.h))

        def chunk(tag: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

        return (b"\x89PNG\r\n\x1a\n"
                + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9))
                + chunk(b"IEND", b""))

    def save(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(self.png())


def text_width(s: str, scale: int = 1) -> int:
    return len(s) * (GLYPH_W + 1) * scale


def read_png(data: bytes) -> tuple[int, int, bytes]:
    """Decode what Canvas.png() writes (8-bit RGB, filter 0): (w, h, rgb bytes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    w = h = 0
    while pos < len(data):
        n, = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        crc, = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(tag + body) & 0xFFFFFFFF, f"bad CRC in {tag!r}"
        if tag == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert (depth, ctype) == (8, 2), "only 8-bit RGB"
        elif tag == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = 3 * w + 1
    assert all(raw[y * stride] == 0 for y in range(h)), "only filter type 0"
    return w, h, b"".join(raw[y * stride + 1:(y + 1) * stride] for y in range(h))


# --------------------------------------------------------------------------
# Charts
# --------------------------------------------------------------------------


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if not math.isfinite(lo) or not math.isfinite(hi):
        return [0.0, 1.0]
    if hi <= lo:
        hi = lo + (abs(lo) if lo else 1.0)
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks, t = [], start
    for _ in range(100):
        ticks.append(round(t, 10))
        if t >= hi - 1e-12:
            break
        t += step
    return ticks


def _tick_label(v: float) -> str:
    if abs(v) >= 1000 and v == int(v):
        return f"{int(v / 1000)}K" if v % 1000 == 0 else f"{v / 1000:.1f}K"
    if v == int(v):
        return str(int(v))
    return f"{v:.3g}"


class _Frame:
    def __init__(self, width, height, title, xlabel, ylabel, ylo, yhi, legend_rows=0, bottom_margin=45):
        self.c = Canvas(width, height)
        self.left, self.right = 70, width - 20
        self.top = 30 + 12 * legend_rows
        self.bottom = height - bottom_margin
        self.yt = nice_ticks(ylo, yhi)
        self.ylo, self.yhi = self.yt[0], self.yt[-1]
        c = self.c
        c.text(max(4, (width - text_width(title, 2)) // 2), 6, title, BLACK, 2)
        for t in self.yt:
            y = self.ymap(t)
            c.line(self.left, y, self.right, y, LIGHT)
            lab = _tick_label(t)
            c.text(self.left - 6 - text_width(lab), y - 3, lab, GREY)
        c.line(self.left, self.top, self.left, self.bottom, BLACK)
        c.line(self.left, self.bottom, self.right, self.bottom, BLACK)
        c.text((self.left + self.right - text_width(xlabel)) // 2, height - 14, xlabel)
        c.text_vertical(6, (self.top + self.bottom + text_width(ylabel)) // 2, ylabel)

    def ymap(self, v: float) -> float:
        span = (self.yhi - self.ylo) or 1.0
        return self.bottom - (v - self.ylo) / span * (self.bottom - self.top)


def line_chart(series: dict[str, list[tuple[float, float]]], path: str, title: str = "",
               xlabel: str = "", ylabel: str = "", width: int = 720, height: int = 420,
               log2_x: bool = False) -> None:
    """One polyline per series; x positions are the union of all xs (categorical if log2_x).
    Returns the backend used ("matplotlib" or "tinypng")."""
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(width / 100, height / 100), dpi=100)
        xs_all = sorted({x for s in series.values() for x, y in s if y is not None})
        for name, s in series.items():
            s = sorted((x, y) for x, y in s if y is not None)
            if s:
                ax.plot([x for x, _ in s], [y for _, y in s], marker="o", label=name)
        if log2_x and xs_all and min(xs_all) > 0:
            ax.set_xscale("log", base=2)
        if xs_all:
            ax.set_xticks(xs_all)
            ax.set_xticklabels([_tick_label(x) for x in xs_all])
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        if series:
            ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return "matplotlib"
    pts = [(x, y) for s in series.values() for x, y in s if y is not None]
    ys = [y for _, y in pts] or [0.0, 1.0]
    xs = sorted({x for x, _ in pts}) or [0.0, 1.0]
    fr = _Frame(width, height, title, xlabel, ylabel, min(0.0, min(ys)), max(ys) * 1.05 or 1.0,
                legend_rows=(len(series) + 2) // 3)
    c = fr.c

    def xmap(x):
        if log2_x or len(xs) == 1:
            i = xs.index(x)
            return fr.left + (i + 0.5) / len(xs) * (fr.right - fr.left)
        return fr.left + 10 + (x - xs[0]) / ((xs[-1] - xs[0]) or 1) * (fr.right - fr.left - 20)

    for x in xs:
        lab = _tick_label(x)
        c.text(int(xmap(x)) - text_width(lab) // 2, fr.bottom + 6, lab, GREY)
    for k, (name, s) in enumerate(series.items()):
        col = PALETTE[k % len(PALETTE)]
        s = sorted((x, y) for x, y in s if y is not None)
        for (x0, y0), (x1, y1) in zip(s, s[1:]):
            c.line(xmap(x0), fr.ymap(y0), xmap(x1), fr.ymap(y1), col, width=3)
        for x, y in s:
            c.rect(xmap(x) - 3, fr.ymap(y) - 3, xmap(x) + 3, fr.ymap(y) + 3, col)
        lx = fr.left + (k % 3) * ((fr.right - fr.left) // 3)
        ly = 26 + 12 * (k // 3)
        c.rect(lx, ly + 1, lx + 10, ly + 6, col)
        c.text(lx + 14, ly, name[:30])
    c.save(path)
    return "tinypng"


def bar_chart(groups: list[str], series: dict[str, list[float | None]], path: str, title: str = "",
              ylabel: str = "", width: int = 0, height: int = 520) -> None:
    """Grouped bars: groups along x, one bar per series in each group (values may be negative).
    Returns the backend used ("matplotlib" or "tinypng")."""
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(max(6.4, 1.2 + 0.5 * len(groups) * max(1, len(series))), height / 100),
                               dpi=100)
        n = max(1, len(series))
        bw = 0.8 / n
        for k, (name, s) in enumerate(series.items()):
            xs = [g + (k - (n - 1) / 2) * bw for g in range(len(groups))]
            ax.bar([x for x, v in zip(xs, s) if v is not None], [v for v in s if v is not None], bw, label=name)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups, rotation=60, ha="right")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
        if series:
            ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return "matplotlib"
    vals = [v for s in series.values() for v in s if v is not None] or [0.0]
    width = width or max(480, 90 + len(groups) * (18 * max(1, len(series)) + 30))
    lo, hi = min(0.0, min(vals)), max(0.0, max(vals))
    pad = 0.05 * ((hi - lo) or 1.0)
    label_chars = 20
    fr = _Frame(width, height, title, "", ylabel, lo - (pad if lo < 0 else 0), hi + pad,
                legend_rows=(len(series) + 2) // 3, bottom_margin=10 + label_chars * (GLYPH_W + 1))
    c = fr.c
    gw = (fr.right - fr.left) / max(1, len(groups))
    bw = max(3, int(gw * 0.8 / max(1, len(series))))
    y0 = fr.ymap(0.0)
    c.line(fr.left, y0, fr.right, y0, BLACK)
    for g, name in enumerate(groups):
        gx = fr.left + g * gw + gw * 0.1
        for k, s in enumerate(series.values()):
            v = s[g] if g < len(s) else None
            if v is None:
                continue
            x = int(gx + k * bw)
            c.rect(x, fr.ymap(v), x + bw - 2, y0, PALETTE[k % len(PALETTE)])
        # Group labels run vertically under the axis (gate names are long).
        label = name[:label_chars]
        c.text_vertical(int(fr.left + g * gw + gw / 2) - 3, fr.bottom + 4 + text_width(label), label)
    for k, name in enumerate(series):
        lx = fr.left + (k % 3) * ((fr.right - fr.left) // 3)
        ly = 26 + 12 * (k // 3)
        c.rect(lx, ly + 1, lx + 10, ly + 6, PALETTE[k % len(PALETTE)])
        c.text(lx + 14, ly, name[:30])
    c.save(path)
    return "tinypng"
