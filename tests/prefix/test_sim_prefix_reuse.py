"""scripts/bench/sim_prefix_reuse.py on a few turns: vLLM's real scheduler and
KV-cache manager with this series' groups (block 12,144; MTP 9,776) hit only
at block boundaries the previous turn's prefill reached (MTP: one block less),
and with prefix_match_unit at the previous prompt's end (floored to the unit)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
from vllm.v1 import kv_cache_interface as kvi  # noqa: E402

if not hasattr(kvi, "HostResidentFullAttentionSpec"):
    pytest.skip("0220-qsa-kv-offload not applied", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import sim_prefix_reuse as sim  # noqa: E402

TURNS = 7


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "sim.json"
    args = sim.parse_args(["--variants", "base,mtp,base_pmu", "--max-turns", str(TURNS), "--quiet",
                           "--json", str(out)])
    turns = sim.conversation(args)
    return {v: sim.run_variant(v, args, turns, log=lambda s: None) for v in ("base", "mtp", "base_pmu")}


def _prev(rows, k):
    return rows[k - 1]["prompt_tokens"]


def test_groups_are_the_series(runs):
    base, mtp = runs["base"]["config"], runs["mtp"]["config"]
    assert (base["block_size"], base["scheduler_block_size"], base["hash_block_size"]) == (12_144,) * 3
    assert (mtp["block_size"], mtp["hash_block_size"]) == (9_776, 9_776)
    assert base["num_groups"] == mtp["num_groups"] == 21  # 18 GDN + PLE + ring + QSA
    assert (base["num_blocks"], mtp["num_blocks"]) == (244, 170)
    assert base["group_kinds"] == ["CircularBufferSpec", "MLAAttentionSpec", "MambaSpec"]


def test_block_granular_hits(runs):
    for v, drop in (("base", 0), ("mtp", 1)):
        rows = runs[v]["turns"]
        bs = runs[v]["config"]["block_size"]
        assert rows[0]["cached_tokens"] == 0
        for k in range(1, len(rows)):
            r = rows[k]
            assert r["cached_tokens"] % bs == 0
            # the last boundary the previous prompt's prefill reached; with
            # EAGLE/MTP the trailing matched block is dropped
            want = max(_prev(rows, k) // bs - drop, 0) * bs
            assert r["cached_tokens"] == want, (v, k, r)
            assert r["prefilled_tokens"] == r["prompt_tokens"] - r["cached_tokens"]


def test_match_unit_hits_previous_prompt_end(runs):
    rows = runs["base_pmu"]["turns"]
    assert runs["base_pmu"]["config"]["hash_block_size"] == 16
    for k in range(1, len(rows)):
        assert rows[k]["cached_tokens"] == _prev(rows, k) // 16 * 16
        # what is re-prefilled is the previous turn's output (+ < 16 tokens)
        assert rows[k]["reprefilled_tokens"] < rows[k - 1]["output_tokens"] + 16
    mean = lambda v: sum(r["reprefilled_tokens"] for r in runs[v]["turns"][1:]) / (TURNS - 1)  # noqa: E731
    assert mean("base_pmu") < mean("base") < mean("mtp")


def test_concurrent_conversations():
    """Two conversations (subagents) in one scheduler: both advance every
    round, and every hit is still block-granular."""
    args = sim.parse_args(["--variants", "base", "--max-turns", "3", "--conversations", "2", "--quiet"])
    res = sim.run_variant("base", args, sim.conversation(args), log=lambda s: None)
    rows = res["turns"]
    assert sorted((r["conversation"], r["turn"]) for r in rows) == [(c, k) for c in (0, 1) for k in range(3)]
    assert all(r["cached_tokens"] % 12_144 == 0 for r in rows)
    assert res["summary"]["conversations"] == 2
