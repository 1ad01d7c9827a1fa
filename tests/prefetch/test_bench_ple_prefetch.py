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
                "--decode-steps", "5", "--fallback", "--repeats", "2",
                "--gather-fallback", "--host-ids", "--json", str(out)])
    res = json.loads(out.read_text())
    p = res["prompt"]
    assert set(p) == {"off", "prefetch", "fallback"}
    for arm in p.values():
        assert len(arm["runs"]) == 2 and arm["min_s"] <= arm["median_s"] <= arm["max_s"]
    # Arms alternate, and every run reads its own prompt.
    assert [r["position"] for r in p["off"]["runs"]] == [0, 2]
    seeds = [r["token_seed"] for arm in p.values() for r in arm["runs"]]
    assert len(set(seeds)) == len(seeds) == 6
    first = p["off"]["runs"][0]
    assert first["resident_before"] < 0.05  # the cache drop worked
    pre = p["prefetch"]["runs"][0]
    assert pre["pages_advised"] > 0 and pre["process_madvise_calls"] >= 1
    fb = p["fallback"]["runs"][0]
    assert fb["madvise_calls"] == fb["ranges"] > 0
    assert set(res["gather_fallback"]) == {"1tok", "4tok"}
    assert res["host_ids"]["chunk_tokens"] == 512 and res["host_ids"]["us_p50"] > 0
    assert {"off", "madvise"} <= set(res["decode"])
    assert res["decode"]["madvise"]["advise_rows_warm_us_p50_1tok"] > 0
    assert "--tokens 600" in res["command"] and not table.exists()
