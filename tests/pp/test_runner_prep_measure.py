"""decode-03 inputs: scripts/bench/measure_runner_prep.py (the V2 runner's
real input preparation per PP rank, on CPU) at a tiny size, its JSON layout,
and the 3-rank harness fed with it (bench_deferred_recv.py --prep-from).
Structure only: timings on a shared 2-core host are not asserted."""

import json
import os
import subprocess
import sys

import pytest

from bench import bench_deferred_recv as bdr
from bench.pp_pipeline_harness import (
    WORLD,
    HarnessConfig,
    events_by_step,
    rank_prep_ms,
    run_pipeline,
)
from conftest import REPO

SCRIPT = REPO / "scripts" / "bench" / "measure_runner_prep.py"
PIECES = {"batch_state", "prepare_inputs", "block_tables", "attn_metadata",
          "ngram_context"}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("prep") / "runner_prep.json"
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the script runs no kernel (counted only)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "4", "--warmup", "1",
         "--num-reqs", "1,2", "--context", "30000", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads(out.read_text()), proc.stderr


def test_json_layout(measured):
    _, data, stderr = measured
    assert data["bench"] == "runner_prep"
    assert set(data["pieces"]) == PIECES
    cfg = data["config"]
    assert cfg["pp"] == 3 and cfg["layer_split"] == "16,16,16"
    assert cfg["block_size"] == 12_144  # the 0220 derivation (tests/qsa)
    assert cfg["num_kv_cache_groups"] == 21  # 18 GDN + PLE + ring + QSA
    assert [r["rank"] for r in data["ranks"]] == [0, 1, 2]
    for r in data["ranks"]:
        assert "GDNAttentionMetadataBuilder" in r["builders"]
        assert "QSAMetadataBuilder" in r["builders"]
        # the PLE layer (ple_layer_ids [1]) lives on rank 0 only
        assert ("PleShortConvAttentionMetadataBuilder" in r["builders"]) == (r["rank"] == 0)
        assert [c["num_reqs"] for c in r["cases"]] == [1, 2]
        for c in r["cases"]:
            assert set(c["pieces"]) == PIECES
            for stat in (c["total"], *c["pieces"].values()):
                assert set(stat) == {"median_ms", "p90_ms", "mean_ms"}
                assert stat["median_ms"] >= 0
            assert c["sum_of_piece_medians_ms"] > 0
            assert isinstance(c["launches_per_step"], int)
    assert "rank 2 reqs 2: total median" in stderr
    assert {"real", "emulated", "not_run", "kernels_not_run", "host"} <= set(data)


def test_prep_from_reads_each_rank(measured):
    path, data, _ = measured
    per_rank, src = bdr.prep_from(str(path), 2, "median")
    want = [next(c for c in r["cases"] if c["num_reqs"] == 2)["total"]["median_ms"]
            for r in data["ranks"]]
    assert per_rank == want and src["num_reqs"] == 2
    sums, _ = bdr.prep_from(str(path), 1, "piece-medians")
    assert sums == [r["cases"][0]["sum_of_piece_medians_ms"] for r in data["ranks"]]
    with pytest.raises(SystemExit, match="--num-reqs 3"):
        bdr.prep_from(str(path), 3, "median")


def test_harness_sleeps_each_ranks_prep():
    cfg = HarnessConfig(deferred=True, steps=4, rank_prep_ms=(1.0, 40.0, 2.0),
                        prep_ms=99.0, trace_steps=4, timeout_s=60)
    assert [rank_prep_ms(cfg, r) for r in range(WORLD)] == [1.0, 40.0, 2.0]
    res = run_pipeline(cfg)
    for step in range(cfg.steps):
        ev = events_by_step(res[1])[step]
        assert ev["prep_end"] - ev["prep_start"] >= 0.040
        ev = events_by_step(res[2])[step]
        assert ev["prep_end"] - ev["prep_start"] < 0.040 + 0.5  # not 99 ms x 5
