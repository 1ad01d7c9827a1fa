"""Smoke run of scripts/bench/bench_ple_prefetch.py on a tiny table (no timing asserts)."""

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "bench_ple_prefetch.py"


def test_bench_runs_and_writes_json(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_ple_prefetch", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    table = tmp_path / "t.bin"
    bench.main(["--table", str(table), "--size-gib", "0.02", "--tokens", "600",
                "--decode-steps", "5", "--fallback", "--json", str(out)])
    res = json.loads(out.read_text())
    p = res["prompt"]
    assert set(p) == {"off", "prefetch", "fallback"}
    assert p["off"]["resident_before"] < 0.05  # the cache drop worked
    assert p["prefetch"]["pages_advised"] > 0 and p["prefetch"]["process_madvise_calls"] >= 1
    assert p["fallback"]["madvise_calls"] == p["fallback"]["ranges"] > 0
    assert {"off", "madvise"} <= set(res["decode"])
    assert res["decode"]["madvise"]["advise_rows_warm_us_p50_1tok"] > 0
    assert "--tokens 600" in res["command"] and not table.exists()
