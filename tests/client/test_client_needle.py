"""needle.py: scoring, pass/fail per request, preemption delta from /metrics."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import needle  # noqa: E402
import oai_client as oc  # noqa: E402
from fake_openai import NEEDLE_RE, FakeConfig, FakeServer, fake_tokens  # noqa: E402

KEY = "test-key"


def test_score():
    assert needle.score("amber-1234", "The passphrase is AMBER-1234.")
    assert needle.score("amber-1234", "**amber-1234**")
    assert not needle.score("amber-1234", "amber-12345")
    assert not needle.score("amber-1234", "xamber-1234")
    assert not needle.score("amber-1234", "amber 1234")
    assert not needle.score("amber-1234", "")


def test_prompts_have_one_needle_each_at_its_depth():
    n_words = 2000
    codes = set()
    for i in range(4):
        prompt, code, depth = needle.needle_prompt(7, i, 4, n_words)
        found = NEEDLE_RE.findall(prompt)
        assert found == [(str(i + 1), code)]
        pos = prompt.index("The secret passphrase") / len(prompt)
        assert abs(pos - depth) < 0.03
        assert prompt.rstrip().endswith("Answer with the passphrase only.")
        codes.add(code)
    assert len(codes) == 4
    assert needle.needle_prompt(7, 1, 4, n_words) == needle.needle_prompt(7, 1, 4, n_words)  # fixed seed


def test_four_concurrent_needles_pass(tmp_path):
    out = tmp_path / "needle.json"
    with FakeServer(FakeConfig(ttft=0.05, itl=0.001)) as srv:
        rc = needle.main(["--base-url", srv.base_url, "--api-key", KEY, "--requests", "4",
                          "--prompt-tokens", "4000", "--timeout", "20", "--json", str(out)])
        bodies = [b for p, b in srv.state.requests if p == "/v1/chat/completions"]
        max_active = srv.state.max_active
    assert rc == 0
    d = json.loads(out.read_text())
    assert (d["passed"], d["total"], d["errors"], d["preemptions"]) == (4, 4, 0, 0)
    assert max_active == 4
    assert len({b["messages"][0]["content"] for b in bodies}) == 4
    for b in bodies:
        assert 3900 <= len(fake_tokens(b["messages"][0]["content"])) <= 4150
        assert b["chat_template_kwargs"] == {"enable_thinking": False}


def test_wrong_answer_fails_and_preemptions_are_reported(capsys):
    cfg = FakeConfig(ttft=0.1, itl=0.001, needle_wrong={2}, preempt_above=2, preemptions=5)
    with FakeServer(cfg) as srv:
        c = oc.Client(srv.base_url, KEY, timeout=20)
        res = needle.run(c, "m", requests=4, prompt_tokens=1000, max_tokens=32, seed=0)
        rc = needle.main(["--base-url", srv.base_url, "--api-key", KEY, "--requests", "3",
                          "--prompt-tokens", "500", "--max-preemptions", "-1", "--timeout", "20"])
    assert [x["passed"] for x in res["requests"]] == [True, False, True, True]
    assert res["passed"] == 3
    # 4 requests against a server that preempts above 2 running: the 3rd and 4th to start
    # each count one; the counter started at 5, the tool reports the difference.
    assert res["preemptions"] == 2
    assert rc == 1  # room 2 wrong again
    assert "needle 2/3" in capsys.readouterr().out


def test_preemptions_fail_the_run_and_missing_metrics_is_na(capsys):
    with FakeServer(FakeConfig(ttft=0.1, itl=0.001, preempt_above=1)) as srv:
        rc = needle.main(["--base-url", srv.base_url, "--api-key", KEY, "--requests", "2",
                          "--prompt-tokens", "300", "--timeout", "20"])
    assert rc == 1 and "preemptions 1" in capsys.readouterr().out
    with FakeServer(FakeConfig(ttft=0.0, itl=0.001, metrics=False)) as srv:
        rc = needle.main(["--base-url", srv.base_url, "--api-key", KEY, "--requests", "2",
                          "--prompt-tokens", "300", "--timeout", "20"])
    assert rc == 0 and "preemptions n/a" in capsys.readouterr().out


def test_clip_cuts_at_a_word_and_wrong_model_is_found_first(capsys):
    text = "HTTP 500: " + "engine failure while gathering rows " * 5
    c = needle.clip(text, 60)
    assert len(c) <= 60 and c.endswith("...") and text.startswith(c[:-3])
    assert text[len(c) - 3] == " "  # cut where a word ended
    assert needle.clip("short\nanswer", 60) == "short answer"
    with FakeServer(FakeConfig(ttft=0.0, itl=0.001)) as srv:
        rc = needle.main(["--base-url", srv.base_url, "--api-key", KEY, "--model", "nope", "--requests", "1",
                          "--prompt-tokens", "100"])
        assert not any(p == "/v1/chat/completions" for p, _ in srv.state.requests)
    assert rc == 2 and "does not serve model 'nope'" in capsys.readouterr().err
