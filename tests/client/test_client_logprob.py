"""logprob_ab.py: A vs A (noise) next to A vs B, over the same continuation only."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import logprob_ab as la  # noqa: E402
from fake_openai import FakeConfig, FakeServer  # noqa: E402

KEY = "test-key"


def test_same_server_is_within_noise_and_biased_server_is_not(tmp_path, capsys):
    a = FakeServer(FakeConfig(ttft=0.0, logprob_noise=0.002, noise_seed=1)).start()
    b_ok = FakeServer(FakeConfig(ttft=0.0, logprob_noise=0.002, noise_seed=2)).start()
    b_bad = FakeServer(FakeConfig(ttft=0.0, logprob_noise=0.002, noise_seed=3, logprob_bias=-0.05)).start()
    try:
        assert la.main(["run", "--a", a.base_url, "--b", b_ok.base_url, "--api-key", KEY, "--max-tokens", "40",
                        "--json", str(tmp_path / "ok.json")]) == 0
        ok = json.loads((tmp_path / "ok.json").read_text())
        assert la.main(["run", "--a", a.base_url, "--b", b_bad.base_url, "--api-key", KEY,
                        "--max-tokens", "40"]) == 1
        assert "DIFFERS beyond noise" in capsys.readouterr().out
        body = next(b for p, b in a.state.requests if p == "/v1/completions")
    finally:
        for s in (a, b_ok, b_bad):
            s.stop()
    aa, ab = ok["a_vs_a"], ok["a_vs_b"][0]
    # |N(0,s) - N(0,s)| has mean 2s/sqrt(pi) = 0.00226 for s = 0.002
    assert 0.0015 < aa["mean_abs_diff"] < 0.003 and 0.0015 < ab["mean_abs_diff"] < 0.003
    assert aa["tokens_compared"] == ab["tokens_compared"] == 8 * 40
    assert body["temperature"] == 0.0 and body["logprobs"] == 1 and body["return_tokens_as_token_ids"]


def test_record_compare_files_and_divergence(tmp_path):
    files = {}
    with FakeServer(FakeConfig(ttft=0.0)) as a:
        for name in ("a1", "a2"):
            files[name] = tmp_path / f"{name}.json"
            assert la.main(["record", "--base-url", a.base_url, "--api-key", KEY, "--max-tokens", "20",
                            "--out", str(files[name])]) == 0
    # the same server after a "gate flip" that changes the token chosen from position 5 on
    with FakeServer(FakeConfig(ttft=0.0, diverge_at=5, logprob_bias=-0.01)) as b:
        files["b"] = tmp_path / "b.json"
        assert la.main(["record", "--base-url", b.base_url, "--api-key", KEY, "--max-tokens", "20",
                        "--out", str(files["b"])]) == 0
    rec = json.loads(files["a1"].read_text())
    assert all(isinstance(t, int) for t in rec["prompts"][0]["tokens"])
    res = la.compare(*(json.loads(files[n].read_text()) for n in ("a1", "a2")),
                     [json.loads(files["b"].read_text())], tolerance=1.5, abs_tolerance=0.0)
    # deterministic server: A vs A is exactly 0; B differs by the bias on the 5 shared tokens
    assert res["a_vs_a"]["mean_abs_diff"] == 0.0 and res["a_vs_a"]["prompts_diverged"] == 0
    ab = res["a_vs_b"][0]
    assert ab["tokens_compared"] == 5 * 8 and ab["prompts_diverged"] == 8
    assert all(p["diverged_at"] == 5 for p in ab["per_prompt"])
    assert abs(ab["mean_abs_diff"] - 0.01) < 1e-9
    assert not res["within_noise"]
    # an absolute tolerance accepts it
    assert la.main(["compare", str(files["a1"]), str(files["a2"]), str(files["b"]), "--abs-tolerance", "0.02"]) == 0


def test_diff_unit():
    a = {"prompts": [{"prompt": "p", "tokens": [1, 2, 3], "logprobs": [-0.1, -0.2, -0.3]}]}
    b = {"prompts": [{"prompt": "p", "tokens": [1, 2, 4], "logprobs": [-0.1, -0.25, -9.0]}]}
    d = la.diff(a, b)
    assert d["tokens_compared"] == 2 and abs(d["mean_abs_diff"] - 0.025) < 1e-12
    assert d["per_prompt"][0]["diverged_at"] == 2


def test_compare_refuses_files_that_are_not_recordings(tmp_path, capsys):
    good = {"prompts": [{"prompt": "p", "tokens": [1], "logprobs": [-0.1]}]}
    (tmp_path / "a.json").write_text(json.dumps(good))
    (tmp_path / "bench.json").write_text(json.dumps({"tool": "scripts/client/bench_serving.py", "results": []}))
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bad.json").write_text(json.dumps({"prompts": [{"prompt": "p", "tokens": [1]}]}))
    for name in ("bench.json", "list.json", "bad.json", "missing.json"):
        rc = la.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "a.json"), str(tmp_path / name)])
        err = capsys.readouterr().err
        assert rc == 2 and name in err and "record --out" in err, (name, err)
    assert la.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 0
