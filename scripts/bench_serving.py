#!/usr/bin/env python3
"""Client-side TTFT / inter-token latency / tok/s benchmark for an OpenAI-compatible server.

Method (SPEC §3.0, the reference's): fixed prompt and fixed seed, 1 warm-up +
3 measured runs per configuration, report the MEDIAN inter-token latency and
the MEAN tok/s (the mean keeps the outliers: PLE cache misses, NVMe stalls,
which is what a user feels). TTFT is measured here, on the client: the
server's "Avg prompt throughput" line is prompt length / 10 s, not a TTFT.

A configuration = prompt length x prefix mode x concurrency:
  --prompt-tokens 0,8192,65536,250000   filler prompts of about that many tokens
                                        (calibrated with the server's /tokenize
                                        when it has one, else estimated at
                                        1.15 tokens per filler word)
  --prefix warm                         the warm-up request sends the same prompts
                                        as the measured runs: TTFT of a cached prefix
  --prefix cold                         every request (warm-up too) gets filler
                                        no request has sent before (salted by
                                        --cold-salt, the run and the stream): TTFT
                                        of an unread prompt; use a different
                                        --cold-salt on each side of an A/B
  --concurrency 1,2,4,8                 streams sent together in each run

Per stream: TTFT = first output chunk - request sent; ITL = gaps between output
chunks (one token each without speculative decoding; with MTP a chunk can hold
several tokens, so compare tok/s there); tok/s = (tokens - 1) / (last chunk -
first chunk), tokens from the usage chunk. Per run: total tok/s = all output
tokens / (last chunk of any stream - first request sent).

Requests use ignore_eos and max_tokens so every stream decodes the same length.
Every loop is bounded: (warm-up + runs) x concurrency requests per configuration,
each limited by --timeout seconds.

  python3 scripts/bench_serving.py --concurrency 1,4 --prompt-tokens 0,8192 \\
      --json bench.json --plot bench.png
"""

from __future__ import annotations

import argparse
import datetime
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import oai_client as oc

try:
    from tqdm import tqdm
except ImportError:  # the tools run without the venv too
    tqdm = None


def int_list(s: str) -> list[int]:
    out = []
    for part in s.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1
        if part.endswith("k"):
            mult, part = 1024, part[:-1]
        out.append(int(float(part) * mult))
    return out


def stream_seed(seed: int, prompt_tokens: int, stream: int, salt: str = "") -> int:
    return oc.stable_int(f"{seed}/{prompt_tokens}/{stream}/{salt}")


class Bench:
    def __init__(self, client: oc.Client, model: str, *, max_tokens: int = 256, seed: int = 0,
                 temperature: float = 0.0, warmup: int = 1, runs: int = 3, cold_salt: str = "",
                 use_tokenize: bool = True, extra_body: dict | None = None, progress=None, log=print):
        self.client, self.model = client, model
        self.max_tokens, self.seed, self.temperature = max_tokens, seed, temperature
        self.warmup, self.runs, self.cold_salt = warmup, runs, cold_salt
        self.use_tokenize, self.extra_body = use_tokenize, extra_body or {}
        self.progress, self.log = progress, log
        self.words: dict[int, tuple[int, int | None]] = {}
        self.cold_counter = 0

    def n_words(self, prompt_tokens: int) -> int:
        if prompt_tokens not in self.words:
            count = (lambda t: self.client.tokenize(self.model, t)) if self.use_tokenize else None
            self.words[prompt_tokens] = oc.words_for_tokens(prompt_tokens, self.seed, count)
        return self.words[prompt_tokens][0]

    def prompts(self, prompt_tokens: int, concurrency: int, cold: bool) -> list[str]:
        n = self.n_words(prompt_tokens)
        out = []
        for i in range(concurrency):
            if cold:
                self.cold_counter += 1
                salt = f"cold/{self.cold_salt}/{self.cold_counter}"
                # A distinct first line too, so not even the first block is shared.
                out.append(oc.prompt_text(stream_seed(self.seed, prompt_tokens, i, salt), n, head=f"[{salt}]"))
            else:
                out.append(oc.prompt_text(stream_seed(self.seed, prompt_tokens, i), n))
        return out

    def body(self, prompt: str) -> dict:
        b = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
             "max_tokens": self.max_tokens, "temperature": self.temperature, "seed": self.seed,
             "ignore_eos": True, "stream_options": {"include_usage": True}}
        b.update(self.extra_body)
        return b

    def round(self, prompts: list[str]) -> list[oc.StreamResult]:
        """All prompts sent together (one thread each, released by a barrier)."""
        barrier = threading.Barrier(len(prompts))

        def one(p):
            try:
                barrier.wait(timeout=60)
            except threading.BrokenBarrierError:
                pass
            r = self.client.stream_chat(self.body(p))
            if self.progress is not None:
                self.progress.update(1)
            return r

        with ThreadPoolExecutor(max_workers=len(prompts)) as ex:
            return list(ex.map(one, prompts))

    def config(self, prompt_tokens: int, prefix: str, concurrency: int) -> dict:
        cold = prefix == "cold"
        for _ in range(self.warmup):
            self.round(self.prompts(prompt_tokens, concurrency, cold))
        runs = []
        for _ in range(self.runs):
            runs.append(run_summary(self.round(self.prompts(prompt_tokens, concurrency, cold))))
        return {"prompt_tokens": prompt_tokens, "prefix": prefix, "concurrency": concurrency,
                "runs": runs, "summary": config_summary(runs)}


def run_summary(results: list[oc.StreamResult]) -> dict:
    ok = [r for r in results if r.ok]
    t0 = min(r.t_start for r in results)
    t_last = max((r.chunk_times[-1] for r in ok if r.chunk_times), default=None)
    tokens = sum(r.n_tokens for r in ok)
    wall = (t_last - t0) if t_last is not None else None
    return {
        "streams": len(results), "errors": len(results) - len(ok),
        "error_samples": [f"HTTP {r.status}: {r.error[:300]}" for r in results if not r.ok][:3],
        "ttft_s": [r.ttft for r in ok],
        "itl_s": [x for r in ok for x in r.itls],
        "tok_s_per_stream": [r.decode_tok_s for r in ok if r.decode_tok_s is not None],
        "output_tokens": tokens,
        "prompt_tokens_server": [r.prompt_tokens for r in ok],
        "total_tok_s": tokens / wall if wall else None,
        "itl_median_s": oc.median([x for r in ok for x in r.itls]),
    }


def config_summary(runs: list[dict]) -> dict:
    ttft = [x for r in runs for x in r["ttft_s"]]
    itl = [x for r in runs for x in r["itl_s"]]
    per_stream = [x for r in runs for x in r["tok_s_per_stream"]]
    totals = [r["total_tok_s"] for r in runs if r["total_tok_s"] is not None]
    prompt_tok = [x for r in runs for x in r["prompt_tokens_server"] if x is not None]
    return {
        "errors": sum(r["errors"] for r in runs),
        "requests": sum(r["streams"] for r in runs),
        "ttft_s": oc.summarize(ttft),
        "itl_ms": {k: (v * 1e3 if isinstance(v, float) and k != "n" else v)
                   for k, v in oc.summarize(itl).items()},
        "itl_median_ms_per_run": [None if r["itl_median_s"] is None else r["itl_median_s"] * 1e3 for r in runs],
        "tok_s_per_stream_mean": oc.mean(per_stream),
        "total_tok_s_mean": oc.mean(totals),
        "prompt_tokens_server_median": oc.median(prompt_tok),
    }


def table(results: list[dict]) -> str:
    head = ("| prompt | prefix | streams | TTFT median s | ITL median ms | ITL p90 ms | ITL mean ms "
            "| tok/s per stream (mean) | total tok/s (mean) | errors |")
    rows = [head, "|" + "---|" * 10]
    for r in results:
        s = r["summary"]
        rows.append(f"| {r['prompt_tokens']} | {r['prefix']} | {r['concurrency']} | "
                    f"{oc.fmt(s['ttft_s']['median'], '.3f')} | {oc.fmt(s['itl_ms']['median'], '.2f')} | "
                    f"{oc.fmt(s['itl_ms']['p90'], '.2f')} | {oc.fmt(s['itl_ms']['mean'], '.2f')} | "
                    f"{oc.fmt(s['tok_s_per_stream_mean'])} | {oc.fmt(s['total_tok_s_mean'])} | "
                    f"{s['errors']}/{s['requests']} |")
    return "\n".join(rows)


def plot(results: list[dict], path: str, title: str = "") -> None:
    import tinypng

    series: dict[str, list] = {}
    for r in results:
        key = f"{r['prompt_tokens'] // 1024}K" if r["prompt_tokens"] >= 1024 else str(r["prompt_tokens"])
        key += f" {r['prefix']}"
        series.setdefault(key + " /stream", []).append((r["concurrency"], r["summary"]["tok_s_per_stream_mean"]))
        series.setdefault(key + " total", []).append((r["concurrency"], r["summary"]["total_tok_s_mean"]))
    tinypng.line_chart(series, path, title=title or "tok/s vs streams", xlabel="concurrent streams",
                       ylabel="tok/s", log2_x=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    oc.add_common_args(ap)
    ap.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8], help="default: 1,2,4,8")
    ap.add_argument("--prompt-tokens", type=int_list, default=[0, 8192, 65536, 250000],
                    help="comma list, 'k' = 1024 (default: 0,8192,65536,250000)")
    ap.add_argument("--prefix", choices=["warm", "cold", "both"], default="warm",
                    help="warm: cached prefix; cold: unread prompts (default: %(default)s)")
    ap.add_argument("--cold-salt", default="", help="makes cold prompts differ between invocations (A/B sides)")
    ap.add_argument("--kv-capacity-tokens", type=int, default=4 * 262144,
                    help="skip configurations that hold more tokens at once (streams x (prompt + output)); "
                         "default 4 x 262144 (the production KV capacity; MTP build: 2 x 262144; 0: no limit)")
    ap.add_argument("--max-tokens", type=int, default=256, help="output tokens per stream (ignore_eos)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--no-tokenize", action="store_true", help="do not calibrate prompt lengths with /tokenize")
    ap.add_argument("--extra-body", type=oc.json_arg, default=None,
                    help='JSON merged into every request, e.g. \'{"chat_template_kwargs":{"enable_thinking":false}}\'')
    ap.add_argument("--label", default="", help="free text stored in the JSON (e.g. the gate setting)")
    ap.add_argument("--json", metavar="PATH", help="write all results (and the command) here")
    ap.add_argument("--plot", metavar="PNG", help="write a tok/s vs streams chart (pure-Python PNG)")
    args = ap.parse_args(argv)

    client = oc.connect(args)
    if client is None:
        return 2
    prefixes = ["warm", "cold"] if args.prefix == "both" else [args.prefix]
    configs, skipped = [], []
    for p in args.prompt_tokens:
        for m in prefixes:
            for c in args.concurrency:
                if m == "cold" and p == 0:
                    continue  # nothing to be cold about
                if args.kv_capacity_tokens and c * (p + args.max_tokens) > args.kv_capacity_tokens:
                    skipped.append(f"{p} tokens x {c} streams")
                    continue
                configs.append((p, m, c))
    if skipped:
        print(f"skipped (more than --kv-capacity-tokens {args.kv_capacity_tokens} held at once: the server "
              f"would queue or preempt): {', '.join(dict.fromkeys(skipped))}", file=sys.stderr)
    n_requests = sum((args.warmup + args.runs) * c for _, _, c in configs)
    bar = tqdm(total=n_requests, desc="requests", file=sys.stderr) if tqdm else None
    bench = Bench(client, args.model, max_tokens=args.max_tokens, seed=args.seed, temperature=args.temperature,
                  warmup=args.warmup, runs=args.runs, cold_salt=args.cold_salt,
                  use_tokenize=not args.no_tokenize, extra_body=args.extra_body, progress=bar)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    t0 = time.monotonic()
    results = []
    for p, m, c in configs:
        results.append(bench.config(p, m, c))
    if bar:
        bar.close()
    out = {
        "tool": "scripts/bench_serving.py", "command": ["python3", "scripts/bench_serving.py"] + (sys.argv[1:] if argv is None else list(argv)),
        "started_at": started, "wall_s": time.monotonic() - t0, "label": args.label,
        "base_url": args.base_url, "model": args.model,
        "skipped_configs": skipped,
        "settings": {"max_tokens": args.max_tokens, "warmup": args.warmup, "runs": args.runs, "seed": args.seed,
                     "temperature": args.temperature, "cold_salt": args.cold_salt,
                     "extra_body": args.extra_body},
        "prompts": {str(p): {"filler_words": w, "tokens_measured": meas,
                             "tokens_estimated": round(w * oc.TOKENS_PER_WORD)}
                    for p, (w, meas) in bench.words.items()},
        "results": results,
    }
    print(table(results))
    if args.json:
        oc.write_json(args.json, out)
        print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot, title=args.label or "tok/s vs streams")
        print(f"wrote {args.plot}")
    errors = sum(r["summary"]["errors"] for r in results)
    if errors:
        first = next(s for r in results for run in r["runs"] for s in run["error_samples"])
        print(f"error: {errors} requests failed; first: {first}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
