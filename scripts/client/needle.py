#!/usr/bin/env python3
"""Needle-in-a-haystack under load: N concurrent long requests, one needle each.

The reference (the write-up): 4 requests of 247,823 tokens held at once,
needle 4/4, preemption 0. Each request gets its own filler (no shared prefix, so the
server really holds N long contexts), one sentence

    The secret passphrase for room R is WORD-NNNN.

at its own depth ((i + 0.5) / N of the way in), and the question "What is the
secret passphrase for room R?" at the end. A request passes when its answer
contains WORD-NNNN (case and punctuation ignored). Preemptions are the change
of vllm:num_preemptions_total on the server's /metrics across the run (n/a
when the server has no /metrics).

All N requests are sent together and streamed (TTFT per request is reported);
each is bounded by --timeout. Exit status: 0 when every needle is found, no
request failed and preemptions <= --max-preemptions; 1 otherwise.

  python3 scripts/client/needle.py --requests 4 --prompt-tokens 247823 --json needle.json
"""

from __future__ import annotations

import argparse
import datetime
import random
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import oai_client as oc

CODE_WORDS = ("amber", "basalt", "cobalt", "delta", "ember", "fjord", "granite", "harbor",
              "indigo", "juniper", "krypton", "lagoon", "meteor", "nimbus", "onyx", "quartz")


def needle_code(seed: int, i: int) -> str:
    rng = random.Random(f"needle {seed} {i}")
    return f"{rng.choice(CODE_WORDS)}-{rng.randint(1000, 9999)}"


def needle_prompt(seed: int, i: int, n: int, n_words: int) -> tuple[str, str, float]:
    """(prompt, expected code, depth) for request i of n."""
    room = i + 1
    code = needle_code(seed, i)
    depth = (i + 0.5) / n
    words = oc.filler_words(oc.stable_int(f"needle filler {seed} {i}"), n_words)
    k = int(len(words) * depth)
    # Cut at a sentence end so the needle reads as its own sentence.
    while 0 < k < len(words) and not words[k - 1].endswith("."):
        k += 1
    needle = f"The secret passphrase for room {room} is {code}."
    body = " ".join(words[:k] + [needle] + words[k:])
    question = (f"What is the secret passphrase for room {room}? "
                "Answer with the passphrase only.")
    return f"{body}\n\n{question}", code, depth


def normalize(s: str) -> str:
    return re.sub(r"[^a-z0-9-]+", " ", s.lower())


def score(expected: str, answer: str) -> bool:
    """Found when the code appears as a whole token (amber-1234, not amber-12345)."""
    return re.search(rf"(?<![a-z0-9-]){re.escape(expected.lower())}(?![a-z0-9])", normalize(answer)) is not None


def clip(text: str, n: int) -> str:
    """text on one line, cut at a word boundary within n characters ("..." marks a cut)."""
    text = " ".join(text.split())
    if len(text) <= n:
        return text
    cut = text[:n - 3]
    if " " in cut[n // 2:]:
        cut = cut[:cut.rindex(" ")]
    return cut.rstrip(" ,;:") + "..."


def run(client: oc.Client, model: str, *, requests: int, prompt_tokens: int, max_tokens: int, seed: int,
        use_tokenize: bool = True, extra_body: dict | None = None, log=print) -> dict:
    count = (lambda t: client.tokenize(model, t)) if use_tokenize else None
    n_words, measured = oc.words_for_tokens(prompt_tokens, seed, count)
    jobs = [needle_prompt(seed, i, requests, n_words) for i in range(requests)]
    pre0 = client.preemptions()
    barrier = threading.Barrier(requests)

    def one(job):
        prompt, _code, _depth = job
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0.0, "seed": seed}
        body.update(extra_body or {})
        try:
            barrier.wait(timeout=60)
        except threading.BrokenBarrierError:
            pass
        return client.stream_chat(body)

    log(f"sending {requests} requests of ~{prompt_tokens} tokens "
        f"({'measured' if measured is not None else 'estimated'} filler: {measured or round(n_words * oc.TOKENS_PER_WORD)})")
    done = threading.Event()
    finished = []

    def ticker():  # long prompts take minutes: say so (no tqdm needed)
        t0 = time.monotonic()
        while not done.wait(30):
            print(f"waiting: {len(finished)}/{requests} answered after {time.monotonic() - t0:.0f} s",
                  file=sys.stderr, flush=True)

    def tracked(job):
        r = one(job)
        finished.append(r)
        return r

    threading.Thread(target=ticker, daemon=True).start()
    try:
        with ThreadPoolExecutor(max_workers=requests) as ex:
            results = list(ex.map(tracked, jobs))
    finally:
        done.set()
    pre1 = client.preemptions()
    rows = []
    for i, ((_, code, depth), r) in enumerate(zip(jobs, results)):
        answer = r.text if r.text.strip() else r.reasoning
        rows.append({"room": i + 1, "depth": round(depth, 3), "expected": code, "ok": r.ok, "status": r.status,
                     "passed": bool(r.ok and score(code, answer)), "answer": answer[:300],
                     "ttft_s": r.ttft, "prompt_tokens_server": r.prompt_tokens, "error": r.error[:300]})
    preempt = None if pre0 is None or pre1 is None else pre1 - pre0
    return {"requests": rows, "passed": sum(x["passed"] for x in rows), "total": len(rows),
            "errors": sum(not x["ok"] for x in rows), "preemptions": preempt,
            "filler_words": n_words, "filler_tokens_measured": measured}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    oc.add_common_args(ap)
    ap.add_argument("--requests", type=int, default=4, help="concurrent requests, one needle each (default 4)")
    ap.add_argument("--prompt-tokens", type=int, default=247823, help="tokens per request (default 247823)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--thinking", choices=["off", "on", "default"], default="off",
                    help="chat_template_kwargs.enable_thinking (default off: the answer comes at once)")
    ap.add_argument("--max-preemptions", type=int, default=0,
                    help="fail when the server counted more preemptions than this (default 0; -1: never)")
    ap.add_argument("--no-tokenize", action="store_true")
    ap.add_argument("--extra-body", type=oc.json_arg, default=None)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if not 1 <= args.requests <= 64:
        ap.error("--requests must be 1..64")
    if args.json:
        import os

        d = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(d) or not os.access(d, os.W_OK):
            ap.error(f"--json {args.json}: directory {d} does not exist or is not writable")
    client = oc.connect(args)
    if client is None:
        return 2
    try:
        oc.check_model(client, args.model)
    except oc.ClientError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    extra = dict(args.extra_body or {})
    if args.thinking != "default":
        extra.setdefault("chat_template_kwargs", {})["enable_thinking"] = args.thinking == "on"
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    res = run(client, args.model, requests=args.requests, prompt_tokens=args.prompt_tokens,
              max_tokens=args.max_tokens, seed=args.seed, use_tokenize=not args.no_tokenize, extra_body=extra)
    print("| room | depth | expected | passed | TTFT s | prompt tokens | answer |")
    print("|---|---|---|---|---|---|---|")
    for x in res["requests"]:
        ans = clip(x["answer"], 60) if x["ok"] else clip(f"HTTP {x['status']}: {x['error']}", 100)
        print(f"| {x['room']} | {x['depth']} | {x['expected']} | {'PASS' if x['passed'] else 'FAIL'} | "
              f"{oc.fmt(x['ttft_s'], '.2f')} | {x['prompt_tokens_server'] or '-'} | {ans} |")
    pre = "n/a (no /metrics)" if res["preemptions"] is None else f"{res['preemptions']:g}"
    print(f"needle {res['passed']}/{res['total']}, errors {res['errors']}, preemptions {pre}")
    if args.json:
        oc.write_json(args.json, {"tool": "scripts/client/needle.py", "started_at": started,
                                  "command": ["python3", "scripts/client/needle.py"] + (sys.argv[1:] if argv is None else list(argv)),
                                  "base_url": args.base_url, "model": args.model, **res})
        print(f"wrote {args.json}")
    bad_pre = (args.max_preemptions >= 0 and res["preemptions"] is not None
               and res["preemptions"] > args.max_preemptions)
    return 0 if res["passed"] == res["total"] and not res["errors"] and not bad_pre else 1


if __name__ == "__main__":
    sys.exit(main())
