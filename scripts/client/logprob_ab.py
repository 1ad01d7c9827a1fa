#!/usr/bin/env python3
"""Logprob A/B: does a patch change what the model computes beyond run-to-run noise?

The reference's quality check for a patch (the write-up, 3.3: HC and MoE fusion): the same fixed
prompts, greedy, against the server before (A) and after (B) the change;
compare the per-token logprobs of the same continuation. Report the mean
absolute difference A vs B next to A vs A (two runs of the unchanged server:
the noise floor). The reference saw 0.001995 (old vs new) vs 0.002010 (old vs
old): the patch is within noise.

"The same continuation": tokens are compared position by position while both
runs chose the same token id; from the first position where they differ the
continuations are no longer the same text, so the rest of that prompt is left
out (its position is reported as `diverged_at`).

Uses /v1/completions (raw prompt, no chat template) with temperature 0, a
fixed seed, logprobs=1 and return_tokens_as_token_ids (vLLM).

Subcommands
  record  --base-url URL --out A1.json       one run of every prompt
  compare A1.json A2.json B.json [B2.json]   A1 vs A2 (noise) and A1 vs each B
  run     --a URL --b URL                    two servers at once: record A
                                             twice and B once, then compare
One server and a gate flip: `record` twice, flip the gate (scripts/client/ab.py
prints the compose commands), `record` once more, `compare`.

Exit status of compare/run: 0 when A vs B <= --tolerance x (A vs A) (or
<= --abs-tolerance), 1 otherwise, 2 on usage/connection errors.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import oai_client as oc

# Fixed prompts: prose, code, a list and arithmetic, so the continuation
# exercises different parts of the vocabulary. Keep them fixed: results are
# only comparable with the same prompts.
PROMPTS = [
    "The history of the printing press begins in",
    "def quicksort(xs):\n    \"\"\"Sort a list of integers.\"\"\"\n",
    "Q: What is 17 multiplied by 23?\nA:",
    "A short list of things to check before a long hike:\n1.",
    "In a distributed system, pipeline parallelism splits the layers of a model across",
    "SELECT name, COUNT(*) FROM orders WHERE",
    "Translate to French: 'The weather is nice today.'\nFrench:",
    "Once upon a time, in a village at the edge of a forest,",
]


def token_id(tok: str):
    return int(tok.split(":", 1)[1]) if tok.startswith("token_id:") else tok


def record(client: oc.Client, model: str, prompts: list[str], max_tokens: int, seed: int,
           label: str = "") -> dict:
    out = []
    for i, p in enumerate(prompts):
        body = {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "seed": seed,
                "logprobs": 1, "return_tokens_as_token_ids": True}
        status, data, raw = client.post_json("/completions", body)
        if status != 200 or not data:
            raise oc.ClientError(f"prompt {i}: {client.url('/completions')} answered {status}: {raw[:300]}")
        lp = (data["choices"][0].get("logprobs") or {})
        toks, lps = lp.get("tokens"), lp.get("token_logprobs")
        if not toks or lps is None:
            raise oc.ClientError(f"prompt {i}: the answer has no logprobs (does the server support "
                                 "logprobs on /v1/completions? vLLM: --max-logprobs >= 1)")
        out.append({"prompt": p, "tokens": [token_id(t) for t in toks], "logprobs": lps})
    return {"tool": "scripts/client/logprob_ab.py record", "base_url": client.base_url, "model": model, "label": label,
            "seed": seed, "max_tokens": max_tokens,
            "recorded_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "prompts": out}


def diff(a: dict, b: dict) -> dict:
    """Mean |logprob_a - logprob_b| over positions where both chose the same token."""
    diffs: list[float] = []
    per_prompt = []
    bmap = {x["prompt"]: x for x in b["prompts"]}
    for x in a["prompts"]:
        y = bmap.get(x["prompt"])
        if y is None:
            continue
        n, diverged = 0, None
        for i, (ta, tb) in enumerate(zip(x["tokens"], y["tokens"])):
            if ta != tb:
                diverged = i
                break
            la, lb = x["logprobs"][i], y["logprobs"][i]
            if la is None or lb is None:
                continue
            diffs.append(abs(la - lb))
            n += 1
        if diverged is None and len(x["tokens"]) != len(y["tokens"]):
            diverged = min(len(x["tokens"]), len(y["tokens"]))
        per_prompt.append({"prompt": x["prompt"][:40], "compared": n, "diverged_at": diverged})
    if not per_prompt:
        raise oc.ClientError("the two recordings share no prompt: record both with the same prompts")
    return {"mean_abs_diff": oc.mean(diffs), "max_abs_diff": max(diffs) if diffs else None,
            "tokens_compared": len(diffs), "prompts": len(per_prompt),
            "prompts_diverged": sum(p["diverged_at"] is not None for p in per_prompt), "per_prompt": per_prompt}


def compare(a1: dict, a2: dict, bs: list[dict], tolerance: float, abs_tolerance: float) -> dict:
    aa = diff(a1, a2)
    ab = [diff(a1, b) for b in bs]
    noise = aa["mean_abs_diff"] or 0.0
    verdicts = []
    for d in ab:
        m = d["mean_abs_diff"]
        ok = m is not None and (m <= tolerance * noise or m <= abs_tolerance)
        verdicts.append(ok)
    return {"a_vs_a": aa, "a_vs_b": ab, "tolerance": tolerance, "abs_tolerance": abs_tolerance,
            "within_noise": all(verdicts), "verdicts": verdicts,
            "reference": {"a_vs_b": 0.001995, "a_vs_a": 0.002010}}


def print_report(res: dict, names: list[str]) -> None:
    def line(name, d):
        return (f"| {name} | {oc.fmt(d['mean_abs_diff'], '.6f')} | {oc.fmt(d['max_abs_diff'], '.6f')} | "
                f"{d['tokens_compared']} | {d['prompts_diverged']}/{d['prompts']} |")

    print("| pair | mean abs diff | max abs diff | tokens compared | prompts diverged |")
    print("|---|---|---|---|---|")
    print(line("A vs A (noise)", res["a_vs_a"]))
    for n, d in zip(names, res["a_vs_b"]):
        print(line(f"A vs {n}", d))
    print("reference: A vs B 0.001995, A vs A 0.002010")
    for n, ok in zip(names, res["verdicts"]):
        print(f"{n}: {'within noise' if ok else 'DIFFERS beyond noise'} "
              f"(tolerance {res['tolerance']} x A-vs-A or <= {res['abs_tolerance']})")


def load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise oc.ClientError(f"{path}: {e} (make it with `logprob_ab.py record --out {path}`)") from e


def load_recording(path: str) -> dict:
    """A file `record` wrote, checked: a message (not a traceback) for anything else."""
    d = load(path)
    hint = f"make one with `logprob_ab.py record --out {path}`"
    if not isinstance(d, dict) or not isinstance(d.get("prompts"), list):
        what = "a JSON " + type(d).__name__ if not isinstance(d, dict) else f"a JSON object with keys {sorted(d)[:6]}"
        raise oc.ClientError(f"{path} is not a logprob_ab.py recording (it is {what}, with no 'prompts' list); {hint}")
    for i, x in enumerate(d["prompts"]):
        ok = (isinstance(x, dict) and isinstance(x.get("prompt"), str) and isinstance(x.get("tokens"), list)
              and isinstance(x.get("logprobs"), list) and len(x["tokens"]) == len(x["logprobs"]))
        if not ok:
            raise oc.ClientError(f"{path}: prompt entry {i} is not a recording's (needs prompt, and tokens and "
                                 f"logprobs lists of one length); {hint}")
    return d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def gen_args(p):
        p.add_argument("--max-tokens", type=int, default=64, help="continuation length per prompt (default 64)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--prompts-file", help="JSON list of prompt strings (default: the 8 built-in prompts)")

    def cmp_args(p):
        p.add_argument("--tolerance", type=float, default=1.5,
                       help="A vs B may be this many times A vs A (default %(default)s)")
        p.add_argument("--abs-tolerance", type=float, default=0.0,
                       help="or at most this mean abs diff (default 0: a deterministic server must match)")
        p.add_argument("--json", metavar="PATH")

    r = sub.add_parser("record", help="record one run of the prompts")
    oc.add_common_args(r)
    gen_args(r)
    r.add_argument("--label", default="")
    r.add_argument("--out", required=True)
    c = sub.add_parser("compare", help="compare recordings: A1 A2 B [B...]")
    c.add_argument("a1")
    c.add_argument("a2")
    c.add_argument("b", nargs="+")
    cmp_args(c)
    rn = sub.add_parser("run", help="two servers: record A twice, B once, compare")
    rn.add_argument("--a", required=True, help="base URL of A (e.g. http://127.0.0.1:8000/v1)")
    rn.add_argument("--b", required=True, help="base URL of B")
    rn.add_argument("--api-key", default=None)
    rn.add_argument("--model", default=os.environ.get("OPENAI_MODEL", oc.DEFAULT_MODEL),
                    help="served model name (default: $OPENAI_MODEL or %(default)s)")
    rn.add_argument("--timeout", type=float, default=600.0)
    gen_args(rn)
    cmp_args(rn)
    args = ap.parse_args(argv)
    try:
        if args.cmd in ("record", "run"):
            prompts = PROMPTS
            if args.prompts_file:
                prompts = load(args.prompts_file)
                if not (isinstance(prompts, list) and all(isinstance(p, str) for p in prompts)):
                    raise oc.ClientError(f"{args.prompts_file}: must be a JSON list of strings")
        if args.cmd == "record":
            client = oc.Client(args.base_url, oc.api_key_from(args), timeout=args.timeout)
            oc.check_server(client)
            oc.check_model(client, args.model)
            rec = record(client, args.model, prompts, args.max_tokens, args.seed, args.label)
            oc.write_json(args.out, rec)
            print(f"wrote {args.out} ({len(rec['prompts'])} prompts x {args.max_tokens} tokens)")
            return 0
        if args.cmd == "compare":
            a1, a2 = load_recording(args.a1), load_recording(args.a2)
            bs, names = [load_recording(b) for b in args.b], args.b
        else:
            key = oc.api_key_from(args)
            ca = oc.Client(args.a, key, timeout=args.timeout)
            cb = oc.Client(args.b, key, timeout=args.timeout)
            oc.check_server(ca, "A server")
            oc.check_server(cb, "B server")
            oc.check_model(ca, args.model)
            oc.check_model(cb, args.model)
            a1 = record(ca, args.model, prompts, args.max_tokens, args.seed, "A1")
            a2 = record(ca, args.model, prompts, args.max_tokens, args.seed, "A2")
            bs, names = [record(cb, args.model, prompts, args.max_tokens, args.seed, "B")], ["B"]
        res = compare(a1, a2, bs, args.tolerance, args.abs_tolerance)
    except oc.ClientError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_report(res, names)
    if args.json:
        oc.write_json(args.json, {"tool": "scripts/client/logprob_ab.py",
                                  "command": ["python3", "scripts/client/logprob_ab.py"]
                                  + (sys.argv[1:] if argv is None else list(argv)), **res})
        print(f"wrote {args.json}")
    return 0 if res["within_noise"] else 1


if __name__ == "__main__":
    sys.exit(main())
