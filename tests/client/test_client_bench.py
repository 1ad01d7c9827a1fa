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
    assert d["command"][1] == "scripts/bench_serving.py"
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
