"""qwen_code_replay.py: qwen-code's request shapes, and HTTP errors, empty
completions and malformed tool calls counted, against a fake server that
answers with tool calls and reports cached tokens."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import qwen_code_replay as qr  # noqa: E402
from fake_qwen_code import QwenCodeConfig, QwenCodeServer  # noqa: E402

KEY = "test-key"


def replay(cfg, tmp_path, *extra):
    out = tmp_path / "r.json"
    with QwenCodeServer(cfg) as srv:
        rc = qr.main(["--base-url", srv.base_url, "--api-key", KEY, "--timeout", "20",
                      "--start-tokens", "600", "--system-tokens", "300", "--growth", "50,120",
                      "--json", str(out), *extra])
        reqs = [b for p, b in srv.state.requests if p == "/v1/chat/completions"]
        return rc, json.loads(out.read_text()), reqs, srv.state


def test_request_shapes_and_clean_run(tmp_path):
    rc, d, reqs, st = replay(QwenCodeConfig(ttft=0.05, itl=0.001), tmp_path,
                             "--conversations", "2", "--turns", "4", "--side-every", "2")
    assert rc == 0
    a, s = d["agent_turns"], d["side_queries"]
    assert (a["total"], a["failed"], a["with_tool_calls"]) == (8, 0, 8)
    assert (s["total"], s["failed"]) == (4, 0)
    names = [t["function"]["name"] for t in qr.TOOLS]
    agent = [b for b in reqs if b.get("stream")]
    assert len(agent) == 8
    for b in agent:  # tools on every turn, auto (left out), usage in the stream
        assert [t["function"]["name"] for t in b["tools"]] == names
        assert "tool_choice" not in b and b["stream_options"] == {"include_usage": True}
    req = [b for b in reqs if b.get("tool_choice") == "required"]
    js = [b for b in reqs if "response_format" in b]
    assert len(req) == 2 and len(js) == 2  # side queries alternate
    for b in req + js:
        assert b["chat_template_kwargs"] == {"enable_thinking": False} and b["stream"] is False
    for b in req:
        assert [t["function"]["name"] for t in b["tools"]] == ["respond_in_schema"]
    assert st.max_active >= 2  # the two conversations ran at once
    # the tool results went back as role "tool" answering the returned call ids
    last = max(agent, key=lambda b: len(b["messages"]))
    tool_msgs = [m for m in last["messages"] if m["role"] == "tool"]
    call_ids = [c["id"] for m in last["messages"] if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    assert tool_msgs and [m["tool_call_id"] for m in tool_msgs] == call_ids


def test_cached_tokens_and_reprefill_per_turn(tmp_path):
    rc, d, _, _ = replay(QwenCodeConfig(ttft=0.01, itl=0.001, block=16), tmp_path,
                         "--conversations", "1", "--turns", "5", "--side-every", "0")
    turns = d["turns"]
    assert rc == 0 and [t["turn"] for t in turns] == list(range(5))
    assert turns[0]["cached_tokens"] == 0 and "reprefill_est" not in turns[0]
    for prev, t in zip(turns, turns[1:]):
        # the previous prompt is a prefix of this one: cached = it, floored to the block
        assert t["cached_tokens"] == prev["prompt_tokens"] // 16 * 16
        assert t["reprefill_est"] == prev["prompt_tokens"] + prev["completion_tokens"] - t["cached_tokens"]
        assert t["ttft_s"] is not None
    assert d["agent_turns"]["cached_tokens_reported"] is True
    assert 0 < d["agent_turns"]["cached_fraction_mean"] < 1


def test_failures_are_counted(tmp_path):
    cfg = QwenCodeConfig(ttft=0.01, itl=0.001, http500_every=7, empty_every=5, malformed_every=3,
                         bad_schema_every=4)
    rc, d, _, _ = replay(cfg, tmp_path, "--conversations", "1", "--turns", "9", "--side-every", "0")
    o = d["agent_turns"]["outcomes"]
    # tool requests 1..7: 3,6 malformed; 4 schema-invalid; 5 empty; 7 -> HTTP 500 ends the conversation
    assert rc == 1
    assert (o.get("malformed_tool_call"), o.get("empty"), o.get("http_error"), o.get("ok")) == (3, 1, 1, 2)
    assert d["agent_turns"]["total"] == 7


def test_side_query_failures(tmp_path):
    cfg = QwenCodeConfig(ttft=0.01, itl=0.001, empty_every=2)
    rc, d, _, _ = replay(cfg, tmp_path, "--conversations", "1", "--turns", "4", "--side-every", "1",
                         "--no-json-schema")
    s = d["side_queries"]
    # tool requests alternate agent turn / side query: every side query (even k) is empty
    assert rc == 1 and s["total"] == 4 and s["outcomes"] == {"empty": 4}


def test_no_cached_tokens_says_which_flag(tmp_path, capsys):
    rc, d, _, _ = replay(QwenCodeConfig(ttft=0.01, itl=0.001, report_cached=False), tmp_path,
                         "--conversations", "1", "--turns", "2", "--side-every", "0")
    assert rc == 0 and d["agent_turns"]["cached_tokens_reported"] is False
    assert "--enable-prompt-tokens-details" in capsys.readouterr().out


def test_check_tool_calls():
    tools = qr.TOOLS

    def call(name, args):
        return {"function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}

    assert qr.check_tool_calls([call("read_file", {"absolute_path": "/a", "limit": 5})], tools) == []
    assert qr.check_tool_calls([call("read_file", {"limit": 5})], tools) == [
        "read_file: $: missing required 'absolute_path'"]
    assert qr.check_tool_calls([call("read_file", {"absolute_path": "/a", "limit": "5"})], tools) == [
        "read_file: $.limit: expected integer, got str"]
    assert qr.check_tool_calls([call("nope", {})], tools) == ["unknown tool 'nope'"]
    assert qr.check_tool_calls([call("edit", '{"file_path": ')], tools)[0].startswith("edit: arguments not JSON")
    assert qr.check_tool_calls([call("todo_write", {"todos": [{"id": "1", "content": "x", "status": "done"}]})],
                               tools) == ["todo_write: $.todos[0].status: 'done' not in "
                                          "['pending', 'in_progress', 'completed']"]
