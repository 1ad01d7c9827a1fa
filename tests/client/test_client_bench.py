"""bench_serving.py against the fake server: measured TTFT / ITL / tok/s match the delays."""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serving  # noqa: E402
import oai_client as oc  # noqa: E402
from fake_openai import FakeConfig, FakeServer, fake_tokens  # noqa: E402

KEY = "test-key"


def test_stream_timing_matches_server_delays():
    ttft, itl = 0.15, 0.02
    with FakeServer(FakeConfig(ttft=ttft, itl=itl)) as srv:
        c = oc.Client(srv.base_url, KEY, timeout=10)
        r = c.stream_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 25})
    assert r.ok, r.error
    assert r.n_tokens == 25 and len(r.chunk_times) == 25  # the role-only first chunk is not a token
    assert ttft - 0.002 <= r.ttft <= ttft + 0.06
    med = oc.median(r.itls)
    assert itl - 0.003 <= med <= itl + 0.008, med
    assert 1 / (itl + 0.008) <= r.decode_tok_s <= 1 / (itl - 0.003)


def test_bench_config_median_vs_mean_and_prefill(tmp_path):
    # 4 gaps of 8 ms then one of 40 ms, cyclic: median 8 ms, mean 14.4 ms.
    pattern = [0.008] * 4 + [0.040]
    cfg = FakeConfig(ttft=0.05, prefill_per_token=20e-6, itl=pattern)
    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    with FakeServer(cfg) as srv:
        rc = bench_serving.main(["--base-url", srv.base_url, "--api-key", KEY, "--concurrency", "1,3",
                                 "--prompt-tokens", "0,3000,6000", "--max-tokens", "11", "--timeout", "20",
                                 "--kv-capacity-tokens", "15000",
                                 "--json", str(out), "--plot", str(png)])
        reqs = list(srv.state.requests)
        max_active = srv.state.max_active
        sent_gaps = list(srv.state.sent_gaps)
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["command"][1] == "scripts/client/bench_serving.py"
    by = {(r["prompt_tokens"], r["concurrency"]): r for r in d["results"]}
    assert set(by) == {(0, 1), (0, 3), (3000, 1), (3000, 3), (6000, 1)}  # 3 x 6011 > 15000: skipped
    assert d["skipped_configs"] == ["6000 tokens x 3 streams"]
    for (p, conc), r in by.items():
        s = r["summary"]
        assert len(r["runs"]) == 3 and s["errors"] == 0 and s["requests"] == 3 * conc
        # Median 8 ms (4 of 5 gaps); an upper bound is checked against what
        # the server really sent, below, so machine load cannot fail it.
        assert s["itl_ms"]["median"] >= 7.5, s["itl_ms"]
        # The mean sees the 40 ms gaps; sleeps only overshoot, so 14.4 ms is a floor.
        assert s["itl_ms"]["mean"] >= 13.0 and s["itl_ms"]["mean"] > s["itl_ms"]["median"] + 3, s["itl_ms"]
        # 10 gaps per stream: 8 x 8 ms + 2 x 40 ms = 0.144 s -> 10 / 0.144 = 69.4 tok/s at most
        assert s["tok_s_per_stream_mean"] <= 70.5
        assert s["total_tok_s_mean"] > 0.8 * conc * 11 / (0.144 + 0.05 + 20e-6 * p + 0.1)
        expect_ttft = 0.05 + 20e-6 * s["prompt_tokens_server_median"]
        assert expect_ttft - 0.002 <= s["ttft_s"]["median"] <= expect_ttft + 0.06
    # Client-side ITL follows what the server really sent (its own clock),
    # whatever the load: the mean of every measured gap against the mean of
    # every gap sent (warm-ups included; same process, so the means agree;
    # a client-side stall only moves chunks, the mean gap of a stream is
    # (last - first) / n either way).
    client_ms = [x * 1e3 for r in d["results"] for run in r["runs"] for x in run["itl_s"]]
    sent_ms = [g * 1e3 for g in sent_gaps]
    assert len(sent_ms) == 10 * len([p for p, _ in reqs if p == "/v1/chat/completions"])
    c_mean, s_mean = sum(client_ms) / len(client_ms), sum(sent_ms) / len(sent_ms)
    assert s_mean >= 14.4 - 0.5
    assert abs(c_mean - s_mean) <= 0.15 * s_mean, (c_mean, s_mean)
    c_med, s_med = sorted(client_ms)[len(client_ms) // 2], sorted(sent_ms)[len(sent_ms) // 2]
    assert 7.5 <= s_med and abs(c_med - s_med) <= 2.0, (c_med, s_med)
    # /tokenize calibrated the 3000-token filler to within 1 %.
    assert abs(d["prompts"]["3000"]["tokens_measured"] - 3000) <= 30
    assert 2980 <= by[(3000, 1)]["summary"]["prompt_tokens_server_median"] <= 3100
    # The 3 streams really overlapped. (Not "== 3": a server handler counts
    # itself active until its last write returns, so on a loaded machine the
    # next round's request can arrive before the previous handler has left.)
    assert max_active >= 3
    chats = [b for p, b in reqs if p == "/v1/chat/completions"]
    assert len(chats) == (1 + 3) * ((1 + 3) * 2 + 1)  # (warm-up + 3 runs) x streams of every config
    assert all(b["ignore_eos"] and b["max_tokens"] == 11 and b["seed"] == 0 and b["stream"] for b in chats)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_warm_prompts_repeat_and_cold_prompts_never_do():
    with FakeServer(FakeConfig(ttft=0.0, itl=0.0)) as srv:
        c = oc.Client(srv.base_url, KEY, timeout=10)
        b = bench_serving.Bench(c, "m", max_tokens=2, use_tokenize=False, cold_salt="A")
        b.config(500, "warm", 2)
        b.config(500, "cold", 2)
        b2 = bench_serving.Bench(c, "m", max_tokens=2, use_tokenize=False, cold_salt="B")
        b2.config(500, "cold", 1)
        prompts = [body["messages"][0]["content"] for _, body in srv.state.requests]
    warm, cold, cold_b = prompts[:8], prompts[8:16], prompts[16:]
    assert len(set(warm)) == 2  # 2 streams, the same 2 prompts in warm-up and every run
    assert len(set(cold)) == 8  # every cold request unread
    assert not set(cold_b) & set(cold)  # another salt (the other A/B side): other prompts
    # about 500 tokens of filler each (estimate: 1.15 tokens per word)
    for p in warm + cold:
        assert 420 <= len(fake_tokens(p)) <= 650


def test_errors_are_counted_and_bad_key_is_explained(capsys):
    with FakeServer(FakeConfig(ttft=0.0, itl=0.0)) as srv:
        assert bench_serving.main(["--base-url", srv.base_url, "--api-key", "wrong"]) == 2
        assert "VLLM_API_KEY" in capsys.readouterr().err
        c = oc.Client(srv.base_url, KEY, timeout=5)
        # A server that answers 500 on chat: every request is an error in the summary.
        srv.cfg.fail_500_every = 1
        b = bench_serving.Bench(c, "m", max_tokens=2, use_tokenize=False, warmup=0, runs=1,
                                extra_body={"response_format": {"type": "json_schema",
                                                                "json_schema": {"schema": {"type": "object"}}}})
        r = b.config(0, "warm", 2)
    assert r["summary"]["errors"] == 2 and "HTTP 500" in r["runs"][0]["error_samples"][0]


def test_unreachable_server_fails_fast(capsys):
    # Port 9 on loopback: nothing listens there in the test environment.
    assert bench_serving.main(["--base-url", "http://127.0.0.1:9/v1", "--timeout", "3"]) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_stats_helpers():
    assert oc.median([3, 1, 2]) == 2 and oc.median([1, 2, 3, 4]) == 2.5
    assert oc.percentile(list(range(11)), 90) == 9.0
    assert oc.percentile([1.0, 2.0], 50) == 1.5
    assert bench_serving.int_list("0,8k,64K,250000") == [0, 8192, 65536, 250000]
    assert oc.parse_prometheus('a_total{x="1"} 2\na_total{x="2"} 3\n# c\nb 1e3\n') == {"a_total": 5.0, "b": 1000.0}


def test_broken_streams_are_errors_and_requests_are_bounded():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    with FakeServer(FakeConfig(ttft=0.0, itl=0.001, stream_error_after=3)) as srv:
        r = oc.Client(srv.base_url, KEY, timeout=5).stream_chat(body)
    assert not r.ok and "engine dead" in r.error and len(r.chunk_times) == 3
    with FakeServer(FakeConfig(ttft=0.0, itl=0.001, abort_after=4)) as srv:
        r = oc.Client(srv.base_url, KEY, timeout=5).stream_chat(body)
    assert not r.ok and len(r.chunk_times) == 4
    # a server that stalls: the request ends at the client's timeout, not when the server resumes
    with FakeServer(FakeConfig(ttft=0.0, itl=[0.001, 3.0])) as srv:
        t0 = time.monotonic()
        r = oc.Client(srv.base_url, KEY, timeout=0.5).stream_chat(body)
        assert time.monotonic() - t0 < 1.5
    assert not r.ok and "timed out" in r.error.lower()


def test_chart_keeps_prompt_lengths_apart_and_no_chart_without_data(tmp_path, monkeypatch):
    import tinypng

    got = {}

    def fake_line_chart(series, path, **kw):
        got.update(series)
        return "tinypng"

    monkeypatch.setattr(tinypng, "line_chart", fake_line_chart)
    summ = lambda v: {"tok_s_per_stream_mean": v, "total_tok_s_mean": v}  # noqa: E731
    results = [{"prompt_tokens": p, "prefix": "warm", "concurrency": 1, "summary": summ(10.0)}
               for p in (1100, 2000, 4000, 4096)]
    assert bench_serving.plot(results, str(tmp_path / "c.png")) == "tinypng"
    names = sorted(k.rsplit(" ", 2)[0] for k in got if k.endswith("per stream"))
    assert names == ["1,100 tok warm", "2,000 tok warm", "4,000 tok warm", "4,096 tok warm"]
    failed = [{"prompt_tokens": 0, "prefix": "warm", "concurrency": 1, "summary": summ(None)}]
    assert bench_serving.plot(failed, str(tmp_path / "d.png")) is None
    assert not (tmp_path / "d.png").exists()


SCHEMA_BODY = json.dumps({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}})


def test_all_failed_round_stops_the_run_and_keeps_json(tmp_path, capsys):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    with FakeServer(FakeConfig(ttft=0.0, itl=0.0, fail_500_every=1)) as srv:
        rc = bench_serving.main(["--base-url", srv.base_url, "--api-key", KEY, "--concurrency", "2,4",
                                 "--prompt-tokens", "0", "--max-tokens", "4", "--no-tokenize", "--timeout", "10",
                                 "--extra-body", SCHEMA_BODY, "--json", str(out), "--plot", str(png)])
        n_chat = sum(p == "/v1/chat/completions" for p, _ in srv.state.requests)
    err = capsys.readouterr().err
    assert rc == 1 and n_chat == 2  # the warm-up round of the first configuration only
    assert "all 2 requests failed" in err and "HTTP 500" in err and "--keep-going" in err
    assert "no chart" in err and not png.exists()
    d = json.loads(out.read_text())
    assert d["complete"] is False and "all 2 requests failed" in d["stopped"] and d["results"] == []


def test_argument_and_server_errors_are_messages_before_the_run(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        bench_serving.main(["--concurrency", "0"])
    assert e.value.code == 2 and ">= 1" in capsys.readouterr().err
    with FakeServer(FakeConfig(ttft=0.0, itl=0.0)) as srv:
        base = ["--base-url", srv.base_url, "--api-key", KEY, "--concurrency", "1", "--prompt-tokens", "0",
                "--max-tokens", "4", "--no-tokenize"]
        assert bench_serving.main(base + ["--model", "qwen-typo"]) == 2
        err = capsys.readouterr().err
        assert "does not serve model 'qwen-typo'" in err and "qwen3.8-flash-next" in err
        assert bench_serving.main(base + ["--json", str(tmp_path / "nodir" / "b.json")]) == 2
        assert "does not exist" in capsys.readouterr().err
        assert not any(p == "/v1/chat/completions" for p, _ in srv.state.requests)


def test_ctrl_c_keeps_finished_configurations(tmp_path, monkeypatch, capsys):
    out = tmp_path / "b.json"
    real = bench_serving.Bench.config
    calls = []

    def config(self, p, m, c):
        calls.append(c)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, p, m, c)

    monkeypatch.setattr(bench_serving.Bench, "config", config)
    with FakeServer(FakeConfig(ttft=0.0, itl=0.001)) as srv:
        rc = bench_serving.main(["--base-url", srv.base_url, "--api-key", KEY, "--concurrency", "1,2,4",
                                 "--prompt-tokens", "0", "--max-tokens", "4", "--no-tokenize", "--runs", "1",
                                 "--json", str(out)])
    assert rc == 130
    d = json.loads(out.read_text())
    assert [r["concurrency"] for r in d["results"]] == [1] and d["complete"] is False
    assert "interrupted" in d["stopped"]
    assert "| 0 | warm | 1 |" in capsys.readouterr().out  # the table of what was measured


def test_vllm_bench_fields_cached_tokens_and_progress_without_tqdm(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_serving, "tqdm", None)  # a bare python3
    out = tmp_path / "b.json"
    with FakeServer(FakeConfig(ttft=0.05, itl=0.01, report_cached=True)) as srv:
        rc = bench_serving.main(["--base-url", srv.base_url, "--api-key", KEY, "--concurrency", "2",
                                 "--prompt-tokens", "500", "--max-tokens", "6", "--no-tokenize", "--runs", "2",
                                 "--prefix", "both", "--json", str(out)])
    assert rc == 0
    cap = capsys.readouterr()
    assert "requests" in cap.err and "configuration 1/2" in cap.err and "run 2/2" in cap.err
    assert "cached %" in cap.out
    d = json.loads(out.read_text())
    warm, cold = d["results"]
    for r in (warm, cold):
        assert r["completed"] == 4 and r["failed"] == 0 and r["max_concurrency"] == 2
        assert r["num_prompts"] == 4 and r["total_output_tokens"] == 4 * 6
        assert len(r["ttfts"]) == len(r["input_lens"]) == len(r["output_lens"]) == len(r["itls"]) == 4
        for m in ("ttft", "tpot", "itl", "e2el"):
            for k in ("mean", "median", "std", "p50", "p90", "p99"):
                assert isinstance(r[f"{k}_{m}_ms"], float), (k, m)
        assert r["p50_ttft_ms"] <= r["p90_ttft_ms"] <= r["p99_ttft_ms"]
        assert r["median_ttft_ms"] >= 50 - 2 and r["median_e2el_ms"] > r["median_ttft_ms"]
        # TPOT = (E2E - TTFT) / (tokens - 1): at least the 10 ms between tokens
        assert r["median_tpot_ms"] >= 9.5
        assert r["output_throughput"] == r["total_output_tokens"] / r["duration"]
    # warm: every measured prompt was sent before (the warm-up) -> its blocks are cached;
    # cold: never sent before -> 0
    assert warm["summary"]["prefix_reuse_median"] > 0.8 and cold["summary"]["prefix_reuse_median"] == 0
    assert all(c > 0 for run in warm["runs"] for c in run["cached_tokens"])


def test_default_base_url_follows_port_and_host_bind(tmp_path, monkeypatch):
    env = tmp_path / ".env"
    env.write_text("# comment\nMODEL_DIR=/m\nPORT=8123\nHOST_BIND='192.168.1.5'\nKEY=a b # note\n")
    assert oc.dotenv_value("PORT", str(env)) == "8123" and oc.dotenv_value("HOST_BIND", str(env)) == "192.168.1.5"
    assert oc.dotenv_value("KEY", str(env)) == "a b" and oc.dotenv_value("NOPE", str(env)) is None
    monkeypatch.setenv("PORT", "8124")
    monkeypatch.setenv("HOST_BIND", "0.0.0.0")
    assert oc.env_base_url() == "http://127.0.0.1:8124/v1"
    monkeypatch.setenv("HOST_BIND", "10.0.0.7")
    assert oc.env_base_url() == "http://10.0.0.7:8124/v1"
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    import argparse

    ap = argparse.ArgumentParser()
    oc.add_common_args(ap)
    assert ap.parse_args([]).base_url == "http://10.0.0.7:8124/v1"
