#!/usr/bin/env python3
"""Structured-output stress: json_schema side requests next to streaming main requests.

Agent clients send, next to their main (streamed) chat request, short side
requests with `response_format: {"type": "json_schema", ...}` (next-speaker
check, suggestions; qwen-code's OpenAI path forces a respond_in_schema tool
call with tool_choice "required" instead, which scripts/client/qwen_code_replay.py
replays). With MTP + PP + async scheduling, upstream vLLM ends
such requests with HTTP 500 ("grammar rejected tokens", SPEC §8: 9 of 16
failed at 2 streams before mtp-03; 45/45 after). This tool reproduces that
load and counts, over N side requests:

  http_500       the server answered 500
  http_other     any other non-200 status, or no answer
  invalid_json   200, but the content does not parse as JSON
  schema         parses, but does not match the schema
  truncated      finish_reason "length" (raise --side-max-tokens)

Pass = 0 failures of N side requests and no failed main request. Main streams
(--main-streams, each re-sending until the side requests are done, at most
--max-main-requests in all) keep the batch mixed. Everything is bounded by
counts and --timeout.

  python3 scripts/client/stress_structured.py --side-requests 45 --side-concurrency 2 --json stress.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import oai_client as oc

# The two kinds of side request qwen-code sends (shapes, not its exact text).
SCHEMAS = [
    ("next_speaker", {
        "type": "object",
        "properties": {
            "reasoning": {"type": "string"},
            "next_speaker": {"type": "string", "enum": ["user", "model"]},
        },
        "required": ["reasoning", "next_speaker"],
    }, "Analyze the conversation above. Who should speak next, the user or the model? "
       "Answer as JSON with a short reasoning."),
    ("suggestions", {
        "type": "object",
        "properties": {"suggestions": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                       "maxItems": 3}},
        "required": ["suggestions"],
    }, "Suggest up to three short follow-up prompts the user might type next, as JSON."),
]


def side_body(model: str, i: int, seed: int, max_tokens: int, extra: dict | None) -> tuple[dict, dict]:
    name, schema, ask = SCHEMAS[i % len(SCHEMAS)]
    context = oc.filler_text(oc.stable_int(f"side {seed} {i}"), 120)
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "seed": seed + i,
            "messages": [{"role": "user", "content": f"Please summarize this note:\n\n{context}"},
                         {"role": "assistant", "content": "Here is a summary of the note."},
                         {"role": "user", "content": ask}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": name, "schema": schema, "strict": True}}}
    body.update(extra or {})
    return body, schema


def classify(status: int, data: dict | None, schema: dict) -> tuple[str, str]:
    """(outcome, detail): outcome in ok, http_500, http_other, invalid_json, schema, truncated."""
    if status == 500:
        return "http_500", ""
    if status != 200 or data is None:
        return "http_other", f"status {status}"
    try:
        choice = data["choices"][0]
        content = choice["message"].get("content") or ""
    except (KeyError, IndexError, TypeError):
        return "http_other", "no choices[0].message in the answer"
    try:
        obj = json.loads(content)
    except ValueError:
        if choice.get("finish_reason") == "length":
            return "truncated", content[-80:]
        return "invalid_json", content[:200]
    errs = oc.validate(obj, schema)
    if errs:
        return "schema", "; ".join(errs)[:200]
    return "ok", ""


def run(client: oc.Client, model: str, *, side_requests: int, side_concurrency: int, main_streams: int,
        main_prompt_tokens: int, main_max_tokens: int, side_max_tokens: int, max_main_requests: int,
        seed: int = 0, extra_body: dict | None = None, progress=None) -> dict:
    done = threading.Event()
    main_lock = threading.Lock()
    main_results: list[oc.StreamResult] = []
    n_words = oc.words_for_tokens(main_prompt_tokens, seed)[0]

    def main_loop(k: int):
        j = 0
        while not done.is_set():
            with main_lock:
                if len(main_results) >= max_main_requests:
                    return
            prompt = oc.prompt_text(oc.stable_int(f"main {seed} {k} {j}"), n_words)
            body = {"model": model, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": main_max_tokens, "ignore_eos": True, "temperature": 0.0, "seed": seed}
            body.update(extra_body or {})
            r = client.stream_chat(body)
            with main_lock:
                main_results.append(r)
            j += 1

    def side(i: int):
        body, schema = side_body(model, i, seed, side_max_tokens, extra_body)
        t0 = time.perf_counter()
        status, data, raw = client.post_json("/chat/completions", body)
        outcome, detail = classify(status, data, schema)
        if progress is not None:
            progress.update(1)
        return {"i": i, "schema": body["response_format"]["json_schema"]["name"], "status": status,
                "outcome": outcome, "detail": detail or (raw[:200] if outcome.startswith("http") else ""),
                "latency_s": time.perf_counter() - t0}

    mains = [threading.Thread(target=main_loop, args=(k,), daemon=True) for k in range(main_streams)]
    for t in mains:
        t.start()
    time.sleep(0.2 if main_streams else 0)  # let the main streams get into the batch first
    try:
        with ThreadPoolExecutor(max_workers=max(1, side_concurrency)) as ex:
            sides = list(ex.map(side, range(side_requests)))
    finally:
        done.set()
        for t in mains:
            t.join(timeout=client.timeout + 5)
    counts = {k: 0 for k in ("ok", "http_500", "http_other", "invalid_json", "schema", "truncated")}
    for s in sides:
        counts[s["outcome"]] += 1
    main_err = [r for r in main_results if not r.ok]
    return {"side": {"total": len(sides), **counts, "failed": len(sides) - counts["ok"]},
            "side_requests": sides,
            "main": {"total": len(main_results), "errors": len(main_err),
                     "error_samples": [f"HTTP {r.status}: {r.error[:200]}" for r in main_err[:3]],
                     "tok_s_per_stream_mean": oc.mean([r.decode_tok_s for r in main_results
                                                       if r.decode_tok_s is not None])}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    oc.add_common_args(ap)
    ap.add_argument("--side-requests", type=int, default=45, help="json_schema requests in all (default 45)")
    ap.add_argument("--side-concurrency", type=int, default=2, help="side requests in flight (default 2)")
    ap.add_argument("--side-max-tokens", type=int, default=512)
    ap.add_argument("--main-streams", type=int, default=1, help="streaming main requests in flight (default 1)")
    ap.add_argument("--main-prompt-tokens", type=int, default=2000)
    ap.add_argument("--main-max-tokens", type=int, default=512)
    ap.add_argument("--max-main-requests", type=int, default=200, help="bound on main requests (default 200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extra-body", type=oc.json_arg, default=None)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    client = oc.connect(args)
    if client is None:
        return 2
    try:
        from tqdm import tqdm
        bar = tqdm(total=args.side_requests, desc="side requests", file=sys.stderr)
    except ImportError:
        bar = None
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    res = run(client, args.model, side_requests=args.side_requests, side_concurrency=args.side_concurrency,
              main_streams=args.main_streams, main_prompt_tokens=args.main_prompt_tokens,
              main_max_tokens=args.main_max_tokens, side_max_tokens=args.side_max_tokens,
              max_main_requests=args.max_main_requests, seed=args.seed, extra_body=args.extra_body,
              progress=bar)
    if bar:
        bar.close()
    s, m = res["side"], res["main"]
    print(f"side json_schema requests: {s['ok']}/{s['total']} ok; HTTP 500: {s['http_500']}, other HTTP: "
          f"{s['http_other']}, invalid JSON: {s['invalid_json']}, schema mismatch: {s['schema']}, "
          f"truncated: {s['truncated']}")
    print(f"main streams: {m['total']} requests, {m['errors']} failed, "
          f"{oc.fmt(m['tok_s_per_stream_mean'])} tok/s per stream")
    for x in res["side_requests"]:
        if x["outcome"] != "ok":
            print(f"  side #{x['i']} ({x['schema']}): {x['outcome']} {x['detail'][:120]}")
    if args.json:
        oc.write_json(args.json, {"tool": "scripts/client/stress_structured.py", "started_at": started,
                                  "command": ["python3", "scripts/client/stress_structured.py"]
                                  + (sys.argv[1:] if argv is None else list(argv)),
                                  "base_url": args.base_url, "model": args.model, **res})
        print(f"wrote {args.json}")
    return 0 if s["failed"] == 0 and m["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
