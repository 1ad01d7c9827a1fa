"""scripts/bench/kernel_table.py on CPU: the README's "Other kernels of the series"
block (between the kernel-table markers) is exactly what the script renders from
the committed results, --check catches a stale block, and every 3090 estimate is
floored by the H200 latency of its row (the rule the table states)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts/bench/kernel_table.py"
README = REPO / "README.md"


def _run(*args):
    return subprocess.run([sys.executable, "-S", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=30, cwd=REPO)


def test_help_on_bare_python():
    r = _run("--help")
    assert r.returncode == 0, r.stderr
    assert "--check" in r.stdout


def test_readme_block_is_up_to_date():
    r = _run("--check", str(README))
    assert r.returncode == 0, r.stderr + "\nfix: python3 scripts/bench/kernel_table.py --update README.md"
    out = _run()
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in README.read_text()


def test_check_catches_a_stale_block(tmp_path):
    stale = tmp_path / "README.md"
    stale.write_text(README.read_text().replace("| QSA decode, row cache |", "| QSA decode, row cache (old) |", 1))
    assert _run("--check", str(stale)).returncode == 1
    assert _run("--update", str(stale)).returncode == 0
    assert _run("--check", str(stale)).returncode == 0


def test_estimates_are_floored_and_row_cache_matches_json(tmp_path):
    out = _run().stdout
    rows = [ln.split(" | ") for ln in out.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert rows
    for c in rows:
        us, est = c[4], c[6]
        if est.startswith("n/a"):
            continue
        assert float(est) >= float(us) - 0.05, c
    # recompute the 72 % overlap, 1 query-row row from the recorded JSON
    d = json.loads((REPO / "scripts/bench/results/qsa_row_cache_h200_run2.json").read_text())
    case = next(c for c in d["cases"] if c["rows"] == 1 and c["overlap"] == 0.72)
    req = d["shape"]["topk"] * d["shape"]["kv_heads"] * d["shape"]["head_dim"] * 2 * 2
    est = max(req * (1 - case["hit_rate"]) / 25e9 * 1e6 + req * case["hit_rate"] / 936e9 * 1e6,
              case["cached_us"])
    row = next(c for c in rows if c[0] == "| QSA decode, row cache" and "1 q-row, 72%" in c[1])
    assert row[2] == f"{req:,}" and row[6] == f"{est:.1f}" and row[7].rstrip(" |") == "78"


def test_missing_results_name_the_fix(tmp_path):
    (tmp_path / "r").mkdir()
    for f in ("hc_prefill_h200.json", "qsa_staging_h200_run3.json", "qsa_row_cache_h200_run2.json"):
        shutil.copy(REPO / "scripts/bench/results" / f, tmp_path / "r" / f)  # ple_gather.json left out
    r = _run("--results", str(tmp_path / "r"))
    assert r.returncode != 0 and "restore it from git" in r.stderr


def test_small_kernel_rows_match_json():
    """Each bench_small_kernels.py case is one row: bytes from the shape's formula,
    H200 us and GB/s as recorded, 3090 estimate = max(bytes / 936 GB/s, us)."""
    p = REPO / "scripts/bench/results/small_kernels_h200.json"
    if not p.exists():
        import pytest
        pytest.skip("no recorded small-kernel device run yet")
    d = json.loads(p.read_text())
    rows = [ln.split(" | ") for ln in _run().stdout.splitlines() if ln.startswith("| 0")]
    assert len(rows) == len(d["cases"]) >= 10
    for c, r in zip(d["cases"], rows):
        s = c["shape"]
        want = {"aligned_state_ids": s.get("num_reqs", 0) * 4 + s.get("groups", 0) * 8
                + s.get("groups", 0) * s.get("num_reqs", 0) * s.get("state_slots", 0) * 4,
                "ple_ngram_ids": s.get("tokens", 0) * 4 + (s.get("reqs", 0) + 1) * 4
                + s.get("reqs", 0) * s.get("ngram_context", 0) * 8 + (s.get("ngram_context", 0) + 1) * 8
                + 2 * s.get("heads", 0) * 8}.get(c["kernel"])
        if want is None:  # INT6 GEMM
            want = s["M"] * s["K"] * 2 + s["N"] * s["K"] * 6 // 8 + s["N"] * 2
        assert c["bytes_read"] == want, c
        assert r[2] == f"{want:,}" and r[4] == f"{c['us']:.1f}", (r, c)
        assert r[6] == f"{max(want / 936e9 * 1e6, c['us']):.1f}", (r, c)
