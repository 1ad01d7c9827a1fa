#!/usr/bin/env python3
"""Replay qwen-code's request shapes against the server and check the answers.

qwen-code (QwenLM/qwen-code, OpenAI-compatible provider) talks like this, and
this tool does the same, with synthetic text:
  agent turns   streamed, `stream_options: {include_usage: true}`, the full
                tool list on every turn, no tool_choice (vLLM: "auto"); the
                conversation grows by the model's reply and a tool result
                each turn, so every turn re-sends a longer prefix.
  side queries  (generateJson) non-streamed, one `respond_in_schema` tool whose
                parameters are the schema, `tool_choice: "required"`,
                `chat_template_kwargs: {enable_thinking: false}` (what it sends
                to non-DashScope servers for qwen* models).
  json_schema   `response_format: {type: json_schema}` requests (other clients,
                older qwen-code), as scripts/client/stress_structured.py sends them.
  subagents     --conversations N agent conversations run at once, sharing the
                system prompt and tool list (a shared prefix), like qwen-code's
                concurrent subagents.

It counts, and fails on (exit 1): HTTP errors (incl. errors inside a 200
stream), empty completions (no content and no tool call), malformed tool calls
(a name not in the request's tools, arguments that are not a JSON object or do
not validate against that tool's schema), side queries without a valid
respond_in_schema call, json_schema answers that do not validate.

Per turn it reports TTFT (client-side) and the prefix reuse the server
reports in usage.prompt_tokens_details.cached_tokens (compose passes
--enable-prompt-tokens-details; without it the column is "-"). "reprefill" is
prev prompt + prev completion - cached: what the server had computed for this
conversation and computed again (approximate: it assumes the chat template
re-renders the history as it was generated).

The check to run after turning MTP on (compose/mtp.yaml):
  python3 scripts/client/qwen_code_replay.py --conversations 2 --turns 12 --json replay.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import oai_client as oc

# A qwen-code-like tool set (names and parameter shapes of its core tools).
TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Reads and returns the content of a specified file.",
        "parameters": {"type": "object", "properties": {
            "absolute_path": {"type": "string", "description": "The absolute path to the file to read."},
            "offset": {"type": "integer", "description": "0-based line number to start reading from."},
            "limit": {"type": "integer", "description": "Maximum number of lines to read."}},
            "required": ["absolute_path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Writes content to a specified file.",
        "parameters": {"type": "object", "properties": {
            "file_path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["file_path", "content"]}}},
    {"type": "function", "function": {
        "name": "edit", "description": "Replaces text within a file.",
        "parameters": {"type": "object", "properties": {
            "file_path": {"type": "string"}, "old_string": {"type": "string"},
            "new_string": {"type": "string"}, "replace_all": {"type": "boolean"}},
            "required": ["file_path", "old_string", "new_string"]}}},
    {"type": "function", "function": {
        "name": "run_shell_command", "description": "Executes a shell command.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string"}, "description": {"type": "string"},
            "directory": {"type": "string"}, "is_background": {"type": "boolean"}},
            "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "grep_search", "description": "Searches for a regular expression in files.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"}, "path": {"type": "string"}, "glob": {"type": "string"},
            "limit": {"type": "integer"}},
            "required": ["pattern"]}}},
    {"type": "function", "function": {
        "name": "list_directory", "description": "Lists the names of files in a directory.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "ignore": {"type": "array", "items": {"type": "string"}}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "todo_write", "description": "Creates and manages a task list.",
        "parameters": {"type": "object", "properties": {
            "todos": {"type": "array", "items": {"type": "object", "properties": {
                "id": {"type": "string"}, "content": {"type": "string"},
                "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]}},
                "required": ["id", "content", "status"]}}},
            "required": ["todos"]}}},
]

# generateJson side queries: the schema becomes respond_in_schema's parameters.
SIDE_SCHEMAS = [
    ("next_speaker", {"type": "object", "properties": {
        "reasoning": {"type": "string"},
        "next_speaker": {"type": "string", "enum": ["user", "model"]}},
        "required": ["reasoning", "next_speaker"]},
     "Analyze the conversation above. Who should speak next, the user or the model? "
     "Call respond_in_schema with a short reasoning."),
    ("suggestions", {"type": "object", "properties": {
        "suggestions": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}},
        "required": ["suggestions"]},
     "Suggest up to three short follow-up prompts the user might type next. Call respond_in_schema."),
]

SYSTEM_HEAD = ("You are Qwen Code, an interactive CLI agent for software engineering tasks. "
               "Use the available tools to read, search and edit files and to run commands. ")
TASK = ("Investigate the repository below, find why the test suite fails and fix it. "
        "Read the files you need with the tools; do not guess.")


def respond_tool(schema: dict) -> dict:
    return {"type": "function", "function": {"name": "respond_in_schema",
                                             "description": "Provide the response in provided schema",
                                             "parameters": schema}}


def check_tool_calls(calls: list, tools: list) -> list[str]:
    """Problems with the returned tool calls: unknown name, arguments that are
    not a JSON object, or do not validate against the tool's schema."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    errs = []
    for c in calls:
        fn = c.get("function") or {}
        name = fn.get("name") or ""
        if name not in schemas:
            errs.append(f"unknown tool {name!r}")
            continue
        try:
            args = json.loads(fn.get("arguments") or "")
        except ValueError:
            errs.append(f"{name}: arguments not JSON: {(fn.get('arguments') or '')[:80]!r}")
            continue
        if not isinstance(args, dict):
            errs.append(f"{name}: arguments not an object")
            continue
        errs.extend(f"{name}: {e}" for e in oc.validate(args, schemas[name]))
    return errs


def filler(seed: str, n_tokens: int) -> str:
    return oc.filler_text(oc.stable_int(seed), max(1, oc.words_for_tokens(n_tokens)[0]))


class Replay:
    def __init__(self, client: oc.Client, args):
        self.c, self.a = client, args
        self.lock = threading.Lock()
        self.turns: list[dict] = []
        self.sides: list[dict] = []
        self.system = SYSTEM_HEAD + "\n\n" + filler(f"system {args.seed}", args.system_tokens)

    def _extra(self, body: dict) -> dict:
        body.update(self.a.extra_body or {})
        return body

    # -- requests ------------------------------------------------------------

    def agent_turn(self, messages: list) -> oc.StreamResult:
        body = self._extra({"model": self.a.model, "messages": messages, "tools": TOOLS,
                            "max_tokens": self.a.max_tokens, "temperature": self.a.temperature,
                            "stream": True, "stream_options": {"include_usage": True}})
        return self.c.stream_chat(body)

    def side_query(self, conv: int, k: int, messages: list) -> dict:
        kind = "tool_required" if (k // self.a.side_every) % 2 == 0 or not self.a.json_schema else "json_schema"
        name, schema, ask = SIDE_SCHEMAS[k % len(SIDE_SCHEMAS)]
        msgs = messages + [{"role": "user", "content": ask}]
        if kind == "tool_required":
            tools = [respond_tool(schema)]
            body = {"model": self.a.model, "messages": msgs, "tools": tools, "tool_choice": "required",
                    "max_tokens": self.a.side_max_tokens, "temperature": 0, "top_p": 1, "stream": False,
                    "chat_template_kwargs": {"enable_thinking": False}}
        else:
            tools = []
            body = {"model": self.a.model, "messages": msgs, "max_tokens": self.a.side_max_tokens,
                    "temperature": 0, "stream": False,
                    "chat_template_kwargs": {"enable_thinking": False},
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": name, "schema": schema, "strict": True}}}
        t0 = time.perf_counter()
        status, data, raw = self.c.post_json("/chat/completions", self._extra(body))
        rec = {"conversation": conv, "turn": k, "kind": kind, "schema": name, "status": status,
               "latency_s": round(time.perf_counter() - t0, 3), "outcome": "ok", "detail": ""}
        usage = (data or {}).get("usage") if isinstance(data, dict) else None
        rec["prompt_tokens"] = (usage or {}).get("prompt_tokens")
        rec["cached_tokens"] = oc.cached_tokens_of(usage)
        if status != 200 or not isinstance(data, dict) or not data.get("choices"):
            rec["outcome"], rec["detail"] = "http_error", f"HTTP {status}: {raw[:200]}"
            return rec
        msg = data["choices"][0].get("message") or {}
        if kind == "json_schema":
            outcome, detail = classify_json(data, schema)
            rec["outcome"], rec["detail"] = outcome, detail
            return rec
        calls = msg.get("tool_calls") or []
        mine = [c for c in calls if (c.get("function") or {}).get("name") == "respond_in_schema"]
        if not mine:
            empty = not (msg.get("content") or "").strip()
            rec["outcome"] = "empty" if empty else "no_tool_call"
            rec["detail"] = (msg.get("content") or "")[:200]
            return rec
        errs = check_tool_calls(mine, tools)
        if errs:
            rec["outcome"], rec["detail"] = "malformed_tool_call", "; ".join(errs)[:300]
        return rec

    # -- one conversation ------------------------------------------------------

    def conversation(self, conv: int) -> None:
        rng = random.Random(f"replay {self.a.seed} {conv}")
        gmin, gmax = self.a.growth
        user = TASK + "\n\n" + filler(f"task {self.a.seed} {conv}",
                                      max(1, self.a.start_tokens - self.a.system_tokens))
        messages = [{"role": "system", "content": self.system}, {"role": "user", "content": user}]
        prev = None
        for k in range(self.a.turns):
            r = self.agent_turn(messages)
            calls = r.tool_calls
            rec = {"conversation": conv, "turn": k, "status": r.status, "ok": r.ok,
                   "ttft_s": None if r.ttft is None else round(r.ttft, 3),
                   "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                   "completion_tokens": r.completion_tokens, "finish_reason": r.finish_reason,
                   "tool_calls": [c["function"]["name"] for c in calls], "outcome": "ok", "detail": ""}
            if prev and rec["cached_tokens"] is not None and prev["prompt_tokens"] is not None:
                done_before = prev["prompt_tokens"] + (prev["completion_tokens"] or 0)
                rec["reprefill_est"] = max(done_before - rec["cached_tokens"], 0)
            if not r.ok:
                rec["outcome"], rec["detail"] = "http_error", f"HTTP {r.status}: {r.error[:200]}"
            elif not r.text.strip() and not calls:
                rec["outcome"] = "empty"
                rec["detail"] = f"finish_reason {r.finish_reason}, reasoning {len(r.reasoning)} chars"
            else:
                errs = check_tool_calls(calls, TOOLS)
                if errs:
                    rec["outcome"], rec["detail"] = "malformed_tool_call", "; ".join(errs)[:300]
            with self.lock:
                self.turns.append(rec)
            if self.a.verbose:
                print(fmt_turn(rec), file=sys.stderr)
            if rec["outcome"] == "http_error":
                break  # the conversation cannot go on without the answer
            prev = rec
            # The assistant message as qwen-code sends it back, then the tool results.
            growth = rng.randint(gmin, gmax)
            assistant = {"role": "assistant", "content": r.text or ""}
            if calls:
                ids = [c.get("id") or f"call_{conv}_{k}_{i}" for i, c in enumerate(calls)]
                assistant["tool_calls"] = [{"id": i, "type": "function", "function": c["function"]}
                                           for i, c in zip(ids, calls)]
                messages.append(assistant)
                for i, c in zip(ids, calls):
                    messages.append({"role": "tool", "tool_call_id": i,
                                     "content": filler(f"tool {self.a.seed} {conv} {k} {i}",
                                                       growth // len(calls))})
            else:
                messages.append(assistant)
                messages.append({"role": "user", "content": "Continue. Here is more output:\n\n"
                                 + filler(f"user {self.a.seed} {conv} {k}", growth)})
            if self.a.side_every and (k + 1) % self.a.side_every == 0:
                side = self.side_query(conv, k, messages)
                with self.lock:
                    self.sides.append(side)
                if self.a.verbose:
                    print(f"  side {side['kind']:13s} conv {conv} turn {k}: {side['outcome']} "
                          f"{side['detail'][:100]}", file=sys.stderr)

    def run(self) -> dict:
        with ThreadPoolExecutor(max_workers=max(1, self.a.conversations)) as ex:
            list(ex.map(self.conversation, range(self.a.conversations)))
        return summarize(self.turns, self.sides)


def classify_json(data: dict, schema: dict) -> tuple[str, str]:
    try:
        msg = data["choices"][0]["message"]
        content = msg.get("content") or ""
    except (KeyError, IndexError, TypeError):
        return "http_error", "no choices[0].message"
    if not content.strip():
        return "empty", ""
    try:
        obj = json.loads(content)
    except ValueError:
        return "invalid_json", content[:200]
    errs = oc.validate(obj, schema)
    return ("schema", "; ".join(errs)[:200]) if errs else ("ok", "")


def summarize(turns: list[dict], sides: list[dict]) -> dict:
    turns = sorted(turns, key=lambda r: (r["conversation"], r["turn"]))
    sides = sorted(sides, key=lambda r: (r["conversation"], r["turn"]))

    def count(recs):
        out: dict[str, int] = {}
        for r in recs:
            out[r["outcome"]] = out.get(r["outcome"], 0) + 1
        return out

    later = [r for r in turns if r["turn"] > 0 and r["ok"]]
    cached = [r for r in later if r["cached_tokens"] is not None]
    return {
        "agent_turns": {"total": len(turns), "outcomes": count(turns),
                        "failed": sum(r["outcome"] != "ok" for r in turns),
                        "with_tool_calls": sum(bool(r["tool_calls"]) for r in turns),
                        "ttft_s": oc.summarize([r["ttft_s"] for r in later]),
                        "first_turn_ttft_s": oc.summarize([r["ttft_s"] for r in turns if r["turn"] == 0]),
                        "cached_tokens_reported": len(cached) > 0,
                        "cached_fraction_mean": oc.mean([r["cached_tokens"] / r["prompt_tokens"]
                                                         for r in cached if r["prompt_tokens"]]),
                        "uncached_tokens": oc.summarize([r["prompt_tokens"] - r["cached_tokens"] for r in cached]),
                        "reprefill_est": oc.summarize([r.get("reprefill_est") for r in cached])},
        "side_queries": {"total": len(sides), "outcomes": count(sides),
                         "failed": sum(r["outcome"] != "ok" for r in sides)},
        "turns": turns, "side_requests": sides,
    }


def fmt_turn(r: dict) -> str:
    cached = "-" if r["cached_tokens"] is None else f"{r['cached_tokens']:,}"
    prompt = "-" if r["prompt_tokens"] is None else f"{r['prompt_tokens']:,}"
    ttft = "-" if r["ttft_s"] is None else f"{r['ttft_s']:.2f}"
    rp = r.get("reprefill_est")
    return (f"conv {r['conversation']} turn {r['turn']:3d}: prompt {prompt:>8s} cached {cached:>8s} "
            f"reprefill {'-' if rp is None else format(rp, ','):>7s} TTFT {ttft:>6s} s  "
            f"{','.join(r['tool_calls']) or '(text)':24s} {r['outcome']} {r['detail'][:80]}")


def pair(s: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in s.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError("give MIN,MAX, e.g. 1000,4000") from e
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError("need 0 < MIN <= MAX")
    return a, b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    oc.add_common_args(ap)
    ap.add_argument("--conversations", type=int, default=2, help="concurrent agent conversations (default 2)")
    ap.add_argument("--turns", type=int, default=12, help="agent turns per conversation (default 12)")
    ap.add_argument("--start-tokens", type=int, default=10_000,
                    help="first prompt: system prompt + task (default 10000)")
    ap.add_argument("--system-tokens", type=int, default=6_000,
                    help="shared system prompt, the prefix all conversations have in common (default 6000)")
    ap.add_argument("--growth", type=pair, default=(1000, 4000),
                    help="MIN,MAX tokens of tool output added per turn (default 1000,4000)")
    ap.add_argument("--max-tokens", type=int, default=1024, help="per agent turn (default 1024)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--side-every", type=int, default=3,
                    help="a side query after every N-th turn of each conversation, 0 = none (default 3)")
    ap.add_argument("--side-max-tokens", type=int, default=512)
    ap.add_argument("--no-json-schema", dest="json_schema", action="store_false",
                    help="side queries only as tool_choice required (default: alternate with json_schema)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extra-body", type=oc.json_arg, default=None, help="JSON merged into every request")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--verbose", "-v", action="store_true", help="print every turn as it ends")
    args = ap.parse_args(argv)
    if args.system_tokens >= args.start_tokens:
        ap.error("--system-tokens must be below --start-tokens")
    client = oc.connect(args)
    if client is None:
        return 2
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rep = Replay(client, args)
    try:
        res = rep.run()
    except KeyboardInterrupt:
        print("interrupted: reporting the turns done so far", file=sys.stderr)
        res = summarize(rep.turns, rep.sides)
    a, s = res["agent_turns"], res["side_queries"]
    for r in res["turns"]:
        print(fmt_turn(r))
    for r in res["side_requests"]:
        if r["outcome"] != "ok":
            print(f"side {r['kind']} conv {r['conversation']} turn {r['turn']}: {r['outcome']} {r['detail'][:120]}")
    print(f"agent turns: {a['total'] - a['failed']}/{a['total']} ok, {a['with_tool_calls']} with tool calls; "
          f"failures {json.dumps({k: v for k, v in a['outcomes'].items() if k != 'ok'})}")
    print(f"side queries: {s['total'] - s['failed']}/{s['total']} ok; "
          f"failures {json.dumps({k: v for k, v in s['outcomes'].items() if k != 'ok'})}")
    t, u, rp = a["ttft_s"], a["uncached_tokens"], a["reprefill_est"]
    print(f"turns after the first: TTFT median {oc.fmt(t['median'], '.2f')} s, p90 {oc.fmt(t['p90'], '.2f')} s; "
          + (f"uncached tokens median {oc.fmt(u['median'], ',.0f')}, re-prefilled median {oc.fmt(rp['median'], ',.0f')} "
             f"max {oc.fmt(rp['max'], ',.0f')}, cached {oc.fmt(100 * (a['cached_fraction_mean'] or 0), '.1f')} % of the prompt"
             if a["cached_tokens_reported"] else
             "no cached_tokens in usage (start the server with --enable-prompt-tokens-details)"))
    if args.json:
        oc.write_json(args.json, {"tool": "scripts/client/qwen_code_replay.py", "started_at": started,
                                  "command": ["python3", "scripts/client/qwen_code_replay.py"]
                                  + (sys.argv[1:] if argv is None else list(argv)),
                                  "base_url": args.base_url, "model": args.model, **res})
        print(f"wrote {args.json}")
    return 0 if a["failed"] == 0 and s["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
