"""stress_structured.py: HTTP 500 and invalid-JSON counting next to streaming main requests."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import oai_client as oc  # noqa: E402
import stress_structured as ss  # noqa: E402
from fake_openai import FakeConfig, FakeServer  # noqa: E402

KEY = "test-key"


def run(cfg, n=12, conc=2, mains=1, max_main=30):
    with FakeServer(cfg) as srv:
        c = oc.Client(srv.base_url, KEY, timeout=20)
        res = ss.run(c, "m", side_requests=n, side_concurrency=conc, main_streams=mains, main_prompt_tokens=200,
                     main_max_tokens=50, side_max_tokens=256, max_main_requests=max_main)
        return res, srv.state


def test_clean_server_zero_of_n():
    res, st = run(FakeConfig(ttft=0.01, itl=0.002))
    assert res["side"]["failed"] == 0 and res["side"]["ok"] == 12
    assert res["main"]["total"] >= 1 and res["main"]["errors"] == 0
    sides = [b for p, b in st.requests if p == "/v1/chat/completions" and "response_format" in b]
    assert len(sides) == 12
    assert {b["response_format"]["json_schema"]["name"] for b in sides} == {"next_speaker", "suggestions"}
    # side requests ran while a main stream was in flight
    assert st.max_active >= 1


def test_500s_and_invalid_json_are_counted():
    res, _ = run(FakeConfig(ttft=0.01, itl=0.002, fail_500_every=3, invalid_json_every=5), n=15, conc=3)
    s = res["side"]
    # of the 15 schema requests, numbers 3,6,9,12,15 -> 500; 5,10 -> invalid JSON (15 is a 500 first)
    assert (s["http_500"], s["invalid_json"], s["ok"], s["failed"]) == (5, 2, 8, 7)


def test_main_exit_status_and_bounded_main_requests(tmp_path):
    out = tmp_path / "s.json"
    with FakeServer(FakeConfig(ttft=0.01, itl=0.0005, fail_500_every=4)) as srv:
        rc = ss.main(["--base-url", srv.base_url, "--api-key", KEY, "--side-requests", "8",
                      "--main-streams", "2", "--main-max-tokens", "5", "--max-main-requests", "3",
                      "--timeout", "20", "--json", str(out)])
    d = json.loads(out.read_text())
    assert rc == 1 and d["side"]["http_500"] == 2
    assert d["main"]["total"] <= 3 + 2  # the bound (each main thread may finish the one in flight)


def test_classify_schema_and_truncation():
    schema = ss.SCHEMAS[0][1]

    def answer(content, fr="stop"):
        return {"choices": [{"message": {"content": content}, "finish_reason": fr}]}

    assert ss.classify(200, answer('{"reasoning": "x", "next_speaker": "user"}'), schema)[0] == "ok"
    assert ss.classify(200, answer('{"reasoning": "x", "next_speaker": "me"}'), schema)[0] == "schema"
    assert ss.classify(200, answer('{"reasoning": "x"}'), schema)[0] == "schema"
    assert ss.classify(200, answer('{"reasoning": "x", "nex', "length"), schema)[0] == "truncated"
    assert ss.classify(200, answer('{"reasoning": "x", "nex'), schema)[0] == "invalid_json"
    assert ss.classify(500, None, schema)[0] == "http_500"
    assert ss.classify(0, None, schema)[0] == "http_other"
    assert oc.validate({"suggestions": []}, ss.SCHEMAS[1][1]) == ["$.suggestions: fewer than 1 items"]
