#!/usr/bin/env python3
""""Other kernels of the series": the README table of the kernels that the
upstream-baseline table (bench_upstream_baselines.py --table) does not cover,
built from the RECORDED device results in scripts/bench/results/ (nothing runs
here; stdlib only).

Per row: bytes read per call (from the kernel's shapes, formula in the row),
the latency measured on the H200, the achieved GB/s there, and a 3090
ESTIMATE = max(bytes / bandwidth, the H200 latency): 936 GB/s for reads from
VRAM, 25 GB/s (PCIe 4.0 x16, effective; an assumption, not a measurement) for
reads of host K/V over PCIe (UVA or the staging copy). A kernel is not faster
on the 3090 than on the H200, hence the latency floor.

  python3 scripts/bench/kernel_table.py                     # print the block
  python3 scripts/bench/kernel_table.py --check README.md   # exit 1 if stale
  python3 scripts/bench/kernel_table.py --update README.md  # rewrite the block
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
BEGIN, END = "<!-- kernel-table:begin -->", "<!-- kernel-table:end -->"
BW_VRAM = 936e9   # RTX 3090 GDDR6X
BW_PCIE = 25e9    # RTX 3090 PCIe 4.0 x16, effective (assumed)
KV_ROW = 2 * 256 * 2 * 2  # bytes per token row of one layer: kv_heads 2 x head_dim 256 x (K+V) x bf16 = 2 KiB
FILES = {
    "hc_prefill": "hc_prefill_h200.json",
    "staging": "qsa_staging_h200_run3.json",
    "row_cache": "qsa_row_cache_h200_run2.json",
    "ple": "ple_gather.json",
    "small": "small_kernels_h200.json",
}
# The write-up's 3090 figures for the QSA layer with 0250's row cache (one layer, decode).
WRITEUP_ROW_CACHE = {("host", None): "174 (all rows from host)", ("cached", 0.0): "177",
                     ("cached", 0.72): "78", ("cached", 1.0): "38"}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of the recorded JSONs")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--check", type=Path, metavar="README",
                   help="exit 1 if README's block between the kernel-table markers differs")
    g.add_argument("--update", type=Path, metavar="README", help="rewrite README's block in place")
    return ap.parse_args(argv)


def load(results: Path, key: str) -> dict:
    p = results / FILES[key]
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        sys.exit(f"{p} missing: it is a recorded device result; restore it from git")


def fmt_b(b) -> str:
    return f"{int(round(b)):,}"


def row(kernel, what, nbytes, formula, us, est_us, writeup="-"):
    gbs = nbytes / (us * 1e-6) / 1e9 if nbytes else 0
    b = fmt_b(nbytes) if nbytes else "-"
    g = (f"{gbs:.0f}" if gbs >= 1 else f"{gbs:.2f}") if nbytes else "-"
    e = est_us if isinstance(est_us, str) else f"{est_us:.1f}"
    return f"| {kernel} | {what} | {b} | {formula} | {us:.1f} | {g} | {e} | {writeup} |"


def hc_prefill_rows(d) -> list[str]:
    out = []
    for m in sorted(d["graph_us"], key=int):
        us = d["graph_us"][m]["gemm_best"]
        t = d["traffic"][m]["gemm"]
        est = max(t["roofline_3090_us"], us)
        out.append(row(f"HC prefill, {m} tok", "0400 INT8 `hc_prefill_down_silu` + `hc_prefill_up_gate_mix` "
                       "(+ `hc_combine_norm`), swept configs", t["bytes"], "INT8 W + bf16 act. (a)", us, est))
    return out


def staging_rows(d) -> list[str]:
    out = []
    topk = d["topk"]
    g = d["gather_48576_random_rows"]
    n = 48576
    b = n * KV_ROW
    us = g["triton_gather_ms"] * 1e3
    out.append(row("QSA `stage_selected_rows` gather", f"0220, {n:,} random host rows -> VRAM arena",
                   b, "rows x 2 KiB, PCIe (b)", us, max(b / BW_PCIE * 1e6, us)))
    for name, c in d["cases"].items():
        if c["ctx"] != 255024:
            continue
        r, pat, dist = c["rows"], c["pattern"], c["distinct_rows"]
        tag = f"{r} q-rows, ctx {c['ctx']:,}, {pat}"
        if pat == "random":
            req = r * topk * KV_ROW
            us = c["uva_ms"] * 1e3
            out.append(row("QSA attention over host K/V (UVA)", f"reads pinned host K/V directly, {tag}", req,
                           f"{r} x {topk:,} x 2 KiB, PCIe (c)", us, max(req / BW_PCIE * 1e6, us)))
            us = c["vram_ms"] * 1e3
            out.append(row("QSA attention, K/V in VRAM", f"reference, {tag}", req,
                           f"{r} x {topk:,} x 2 KiB, VRAM (d)", us, max(req / BW_VRAM * 1e6, us)))
        b = dist * KV_ROW
        us = c["staged_ms"] * 1e3
        parts = c["parts_needed_min"]
        out.append(row("QSA staged prefill (gather + attention)",
                       f"0220, {tag}, {dist:,} distinct rows, {parts} part{'s' if parts > 1 else ''}",
                       b, "distinct x 2 KiB, PCIe (e)", us, max(b / BW_PCIE * 1e6, us)))
    return out


def row_cache_rows(d) -> list[str]:
    s = d["shape"]
    kv_row = s["kv_heads"] * s["head_dim"] * 2 * 2
    assert kv_row == KV_ROW, kv_row
    topk = s["topk"]
    out = []
    for c in d["cases"]:
        r, ov, hit = c["rows"], c["overlap"], c["hit_rate"]
        req = r * topk * kv_row
        tag = f"{r} q-row{'s' if r > 1 else ''}"
        if ov == 0.0:
            us = c["host_us"]
            wu = WRITEUP_ROW_CACHE[("host", None)] if r == 1 else "-"
            out.append(row("QSA decode, host K/V (UVA)", f"0250 off, {tag}", req,
                           f"{r} x {topk:,} x 2 KiB, PCIe (c)", us, max(req / BW_PCIE * 1e6, us), wu))
        us = c["cached_us"]
        miss = req * (1 - hit)
        est = max(miss / BW_PCIE * 1e6 + (req - miss) / BW_VRAM * 1e6, us)
        wu = WRITEUP_ROW_CACHE.get(("cached", ov), "-") if r == 1 else "-"
        out.append(row("QSA decode, row cache", f"0250, {tag}, {ov:.0%} overlap, hit rate {hit:.1%}", req,
                       f"{r} x {topk:,} x 2 KiB; misses PCIe, hits VRAM (f)", us, est, wu))
    return out


def ple_rows(d) -> list[str]:
    run = d["runs"][0]
    rb = run["rows_per_token"] * run["row_bytes"]
    out = []
    for x in run["results"]:
        if x["tokens_per_step"] != 1:
            continue
        us = x["step_ms_p50"] * 1e3
        out.append(row(f"PLE gather ({x['cache']} page cache)", "CPU `np.take` from the mmap, 1 token, p50",
                       rb, f"{run['rows_per_token']} x {run['row_bytes']} B (g)", us,
                       "n/a (CPU, dev VM)"))
    return out


SMALL_WHAT = {
    "aligned_state_ids": ("0650 `get_aligned_state_indices_multi_group_kernel`",
                          "{groups} Mamba groups x {num_reqs} reqs x {state_slots} slots, one launch",
                          "ids + seq_lens + group ptrs (h)"),
    "ple_ngram_ids": ("0100 `_ple_ngram_ids_kernel`", "{tokens} tok, {reqs} reqs, {heads} heads",
                      "ids + context + hash tables (i)"),
    "int6_gemm_gate_up": ("0500 `_int6_planes_gemm_kernel`, shared gate_up",
                          "{M} tok, {K} -> {N}", "bf16 x + 6-bit W + scales (j)"),
    "int6_gemm_down": ("0500 `_int6_planes_gemm_kernel`, shared down", "{M} tok, {K} -> {N}",
                       "bf16 x + 6-bit W + scales (j)"),
}


def small_rows(d) -> list[str]:
    out = []
    for c in d["cases"]:
        kernel, what, formula = SMALL_WHAT[c["kernel"]]
        us, b = c["us"], c["bytes_read"]
        out.append(row(kernel, what.format(**c["shape"]), b, formula, us, max(b / BW_VRAM * 1e6, us)))
    return out


SMALL_SRC = "\n`results/{}` (0650, 0100, 0500; `bench_small_kernels.py`),"
SMALL_NOTES = """(h) Per call: 4 B seq_len per request + 8 B per group's block-table base +
4 B per gathered state id (groups x requests x slots); the ids written back
are not counted. Latency-bound: the 3090 figure is the H200 floor. (i) 4 B
input id per token + 4 B per query_start_loc entry + 8 B per request per
context token + the 8 B multipliers, head sizes and offsets; the 8 B ids
written per token and head are not counted. (j) M x K x 2 B activations +
N x K x 6/8 B bit planes + N x 2 B per-channel scales, weights cycled over
48 copies so they come from HBM, not L2; the bf16 output is not counted.
Timed as CUDA-graph replays of many launches.
"""


def block(results: Path) -> str:
    # the small-kernel rows appear once their device run is recorded
    has_small = (results / FILES["small"]).exists()
    hdr = ("| kernel | what | bytes/call | bytes from | H200 us | GB/s (H200) | 3090 est. us | write-up 3090 us |\n"
           "|---|---|---|---|---|---|---|---|")
    rows = (hc_prefill_rows(load(results, "hc_prefill")) + staging_rows(load(results, "staging"))
            + row_cache_rows(load(results, "row_cache")) + ple_rows(load(results, "ple"))
            + (small_rows(load(results, "small")) if has_small else []))
    f = FILES
    text = f"""{BEGIN}
<!-- generated by scripts/bench/kernel_table.py (--update README.md); tests/moe/test_kernel_table.py checks it -->
**Other kernels of the series**, from recorded runs (no new measurement):
`results/{f['hc_prefill']}` (0400 prefill), `results/{f['staging']}` (0220),
`results/{f['row_cache']}` (0250), `results/{f['ple']}` (PLE, CPU);""" + (
        SMALL_SRC.format(f["small"]) if has_small else "") + f""" the
commands are in the JSONs. Every 3090 figure here is an ESTIMATE =
max(bytes / bandwidth, the H200 latency), with 936 GB/s for VRAM reads and
25 GB/s (PCIe 4.0 x16 effective, assumed) for host K/V read over PCIe; only
the write-up's column was measured on a 3090.

{hdr}
""" + "\n".join(rows) + """

(a) Minimum DRAM bytes of the two INT8 GEMMs as `bench_hc_prefill.py`
records them (activations + INT8 `down`/`up` weights + the low-rank
intermediate + the block input); `hc_combine_norm`'s bytes are not
counted though its time is, so GB/s is a lower bound. The estimate uses the
recorded 3090 roofline, max(bytes / 936 GB/s, FLOPs / 71 TFLOPS), floored by
the H200 time. (b) 2 KiB per token row = 2 KV heads x 256 x (K + V) x bf16,
one layer. (c) Every query row reads its 2,051 selected rows (2,048 top-k +
3) from pinned host memory through UVA. (d) Requested bytes; repeated rows
are served by L2, so GB/s can exceed HBM's. (e) Only the distinct selected
rows cross PCIe (then attention reads the VRAM arena); random 512 rows at
255k context need 6 arena parts. (f) Misses (1 - hit rate) cross PCIe,
hits come from the VRAM row cache: estimate = misses / 25 GB/s + hits /
936 GB/s, floored by the H200 time; the write-up measured 174 us with every
row from host, 78 us at 72 % overlap, 38 us at 100 % and 177 us at 0 % on
the 3090. (g) 16 rows of 320 B per token, on the 2-core dev VM (not the
target host): warm = page cache, cold = that disk's random-read latency.
""" + (SMALL_NOTES if has_small else "") + END
    return text


def splice(readme: str, new: str) -> str:
    if readme.count(BEGIN) != 1 or readme.count(END) != 1:
        sys.exit(f"README needs exactly one {BEGIN} ... {END} pair (inside '### Kernel figures')")
    a = readme.index(BEGIN)
    z = readme.index(END) + len(END)
    return readme[:a] + new + readme[z:]


def main(argv=None) -> int:
    a = parse(argv)
    new = block(a.results)
    if a.check:
        cur = a.check.read_text()
        if splice(cur, new) != cur:
            print(f"{a.check}: kernel table is stale; run python3 scripts/bench/kernel_table.py "
                  f"--update {a.check}", file=sys.stderr)
            return 1
        print(f"{a.check}: kernel table up to date")
        return 0
    if a.update:
        a.update.write_text(splice(a.update.read_text(), new))
        print(f"{a.update}: kernel table written")
        return 0
    print(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
