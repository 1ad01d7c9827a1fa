#!/usr/bin/env python3
"""Client-side TTFT / inter-token latency / tok/s benchmark for an OpenAI-compatible server.

Method (the write-up, 3.0): fixed prompt and fixed seed, 1 warm-up +
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

Prefix reuse: every request asks for the usage chunk (stream_options
include_usage); vLLM started with --enable-prompt-tokens-details returns
usage.prompt_tokens_details.cached_tokens, reported per request and as
"cached %" beside TTFT.

JSON: each configuration also carries the fields `vllm bench serve` writes
(completed, failed, duration, total_input_tokens, total_output_tokens,
request_throughput, output_throughput, total_token_throughput,
max_concurrency, mean/median/std/p50/p90/p99 of ttft/tpot/itl/e2el in ms,
input_lens, output_lens, ttfts, itls, errors), so vLLM's plotting and
comparison habits apply. TPOT = (E2E - TTFT) / (output tokens - 1).

Requests use ignore_eos and max_tokens so every stream decodes the same length.
Every loop is bounded: (warm-up + runs) x concurrency requests per configuration,
each limited by --timeout seconds. --json is rewritten after every
configuration, so Ctrl-C (or a crash) keeps what was measured; the run stops
at the first round in which every request failed (--keep-going: go on).

  python3 scripts/client/bench_serving.py --concurrency 1,4 --prompt-tokens 0,8192 \\
      --json bench.json --plot bench.png
"""

from __future__ import annotations

import argparse
import datetime
import os
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
        try:
            out.append(int(float(part) * mult))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not a number (give a comma list like 0,8k,65536)")
    if not out:
        raise argparse.ArgumentTypeError("empty list")
    return out


def count_list(s: str) -> list[int]:
    out = int_list(s)
    if min(out) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: every concurrency must be >= 1 (streams sent together)")
    return out


def token_list(s: str) -> list[int]:
    out = int_list(s)
    if min(out) < 0:
        raise argparse.ArgumentTypeError(f"{s!r}: prompt lengths must be >= 0")
    return out


class Progress:
    """tqdm when installed; else one line on stderr per finished round (bare python3)."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled = total, 0, enabled
        self.t0 = time.monotonic()
        self.bar = tqdm(total=total, desc="requests", file=sys.stderr) if (tqdm and enabled) else None

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
            return
        el = time.monotonic() - self.t0
        eta = el / self.done * (self.total - self.done) if self.done else None
        print(f"[{self.done}/{self.total} requests, {el:.0f} s"
              + (f", about {eta:.0f} s left" if eta is not None else "") + f"] {text}",
              file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class AllFailed(Exception):
    """Every request of a round failed: the server is not serving."""


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
        # main() stops the run at a round in which every request failed (--keep-going: not)
        self.stop_on_all_failed = False
        self._lock = threading.Lock()

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
                with self._lock:
                    self.progress.update(1)
            return r

        with ThreadPoolExecutor(max_workers=len(prompts)) as ex:
            return list(ex.map(one, prompts))

    def checked_round(self, prompts: list[str], what: str) -> list[oc.StreamResult]:
        res = self.round(prompts)
        if self.stop_on_all_failed and not any(r.ok for r in res):
            r = res[0]
            raise AllFailed(f"{what}: all {len(res)} requests failed (first: HTTP {r.status}: "
                            f"{r.error[:300]})")
        return res

    def config(self, prompt_tokens: int, prefix: str, concurrency: int) -> dict:
        cold = prefix == "cold"
        name = f"{prompt_tokens} tokens {prefix} x{concurrency}"
        for i in range(self.warmup):
            self.checked_round(self.prompts(prompt_tokens, concurrency, cold), f"{name} warm-up")
        runs = []
        for i in range(self.runs):
            rs = run_summary(self.checked_round(self.prompts(prompt_tokens, concurrency, cold),
                                                f"{name} run {i + 1}"))
            runs.append(rs)
            if self.progress is not None:
                self.progress.note(f"{name}: run {i + 1}/{self.runs}: TTFT median "
                                   f"{oc.fmt(oc.median(rs['ttft_s']), '.3f')} s, "
                                   f"{oc.fmt(oc.mean(rs['tok_s_per_stream']))} tok/s per stream, "
                                   f"{rs['errors']} errors")
        out = {"prompt_tokens": prompt_tokens, "prefix": prefix, "concurrency": concurrency,
               "runs": runs, "summary": config_summary(runs)}
        out.update(vllm_fields(runs, concurrency))
        return out


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
        "cached_tokens": [r.cached_tokens for r in ok],
        "e2e_s": [r.e2e for r in ok],
        "output_tokens_per_stream": [r.n_tokens for r in ok],
        "itl_s_per_stream": [r.itls for r in ok],
        "wall_s": wall,
        "total_tok_s": tokens / wall if wall else None,
        "itl_median_s": oc.median([x for r in ok for x in r.itls]),
    }


def config_summary(runs: list[dict]) -> dict:
    ttft = [x for r in runs for x in r["ttft_s"]]
    itl = [x for r in runs for x in r["itl_s"]]
    per_stream = [x for r in runs for x in r["tok_s_per_stream"]]
    totals = [r["total_tok_s"] for r in runs if r["total_tok_s"] is not None]
    prompt_tok = [x for r in runs for x in r["prompt_tokens_server"] if x is not None]
    reuse = [c / p for r in runs for c, p in zip(r["cached_tokens"], r["prompt_tokens_server"])
             if c is not None and p]
    return {
        "cached_tokens_median": oc.median([x for r in runs for x in r["cached_tokens"] if x is not None]),
        # cached / prompt tokens per request (None: the server sent no cached_tokens)
        "prefix_reuse_median": oc.median(reuse),
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


def _std(xs: list[float]) -> float | None:
    if not xs:
        return None
    m = sum(xs) / len(xs)
    return (sum((x - m) ** 2 for x in xs) / len(xs)) ** 0.5  # population std, as numpy's default


def vllm_fields(runs: list[dict], concurrency: int, percentiles=(50, 90, 99)) -> dict:
    """The per-benchmark fields `vllm bench serve --save-result` writes (times in ms),
    over the measured runs (not the warm-ups)."""
    ttfts = [x for r in runs for x in r["ttft_s"]]
    e2els = [x for r in runs for x in r["e2e_s"]]
    itls = [x for r in runs for x in r["itl_s"]]
    outs = [x for r in runs for x in r["output_tokens_per_stream"]]
    tpots = [(e - t) / (n - 1) for t, e, n in zip(ttfts, e2els, outs) if e is not None and n > 1]
    ins = [x for r in runs for x in r["prompt_tokens_server"]]
    duration = sum(r["wall_s"] or 0.0 for r in runs)
    completed = sum(r["streams"] - r["errors"] for r in runs)
    total_in = sum(x for x in ins if x)
    total_out = sum(outs)
    d = {"completed": completed, "failed": sum(r["errors"] for r in runs),
         "num_prompts": sum(r["streams"] for r in runs), "max_concurrency": concurrency,
         "duration": duration, "total_input_tokens": total_in, "total_output_tokens": total_out,
         "request_throughput": completed / duration if duration else None,
         "output_throughput": total_out / duration if duration else None,
         "total_token_throughput": (total_in + total_out) / duration if duration else None}
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        xs = [x for x in xs if x is not None]
        ms = lambda v: None if v is None else v * 1000  # noqa: E731
        d[f"mean_{name}_ms"] = ms(oc.mean(xs))
        d[f"median_{name}_ms"] = ms(oc.median(xs))
        d[f"std_{name}_ms"] = ms(_std(xs))
        for q in percentiles:
            d[f"p{q}_{name}_ms"] = ms(oc.percentile(xs, q))
    d.update({"input_lens": ins, "output_lens": outs, "ttfts": ttfts,
              "itls": [x for r in runs for x in r["itl_s_per_stream"]],
              "errors": [e for r in runs for e in r["error_samples"]]})
    return d


def table(results: list[dict]) -> str:
    head = ("| prompt | prefix | streams | TTFT median s | cached % | ITL median ms | ITL p90 ms | ITL mean ms "
            "| tok/s per stream (mean) | total tok/s (mean) | errors |")
    rows = [head, "|" + "---|" * 11]
    for r in results:
        s = r["summary"]
        rows.append(f"| {r['prompt_tokens']} | {r['prefix']} | {r['concurrency']} | "
                    f"{oc.fmt(s['ttft_s']['median'], '.3f')} | "
                    f"{oc.fmt(None if s.get('prefix_reuse_median') is None else 100 * s['prefix_reuse_median'], '.0f')} | "
                    f"{oc.fmt(s['itl_ms']['median'], '.2f')} | "
                    f"{oc.fmt(s['itl_ms']['p90'], '.2f')} | {oc.fmt(s['itl_ms']['mean'], '.2f')} | "
                    f"{oc.fmt(s['tok_s_per_stream_mean'])} | {oc.fmt(s['total_tok_s_mean'])} | "
                    f"{s['errors']}/{s['requests']} |")
    return "\n".join(rows)


def prompt_label(p: int) -> str:
    """The exact length, so 1100 and 2000 (or 4000 and 4096) stay apart."""
    return f"{p:,} tok"


def plot(results: list[dict], path: str, title: str = "") -> str | None:
    """tok/s vs streams, one line per (prompt length, prefix); returns the
    backend used, or None (nothing written) when no request succeeded."""
    import tinypng

    series: dict[str, list] = {}
    for r in results:
        key = f"{prompt_label(r['prompt_tokens'])} {r['prefix']}"
        s = r["summary"]
        series.setdefault(key + " per stream", []).append((r["concurrency"], s["tok_s_per_stream_mean"]))
        series.setdefault(key + " total", []).append((r["concurrency"], s["total_tok_s_mean"]))
    if not any(y is not None for pts in series.values() for _, y in pts):
        return None
    series = {k: v for k, v in series.items() if any(y is not None for _, y in v)}
    return tinypng.line_chart(series, path, title=title or "decode tok/s vs concurrent streams",
                              xlabel="concurrent streams", ylabel="output tok/s", log2_x=True)


def check_writable(path: str | None, what: str) -> str | None:
    """An error message when `path` cannot be written (checked before the run)."""
    if not path:
        return None
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        return f"{what} {path}: directory {d} does not exist (create it first)"
    if not os.access(d, os.W_OK):
        return f"{what} {path}: directory {d} is not writable"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    oc.add_common_args(ap)
    ap.add_argument("--concurrency", type=count_list, default=[1, 2, 4, 8], help="default: 1,2,4,8")
    ap.add_argument("--prompt-tokens", type=token_list, default=[0, 8192, 65536, 250000],
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
    ap.add_argument("--json", metavar="PATH", help="write all results (and the command) here; rewritten after "
                                                  "every configuration")
    ap.add_argument("--plot", metavar="PNG", help="write a tok/s vs streams chart (matplotlib if installed, "
                                                  "else pure Python)")
    ap.add_argument("--keep-going", action="store_true",
                    help="run every configuration even when a whole round of requests failed")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar / progress lines")
    args = ap.parse_args(argv)
    if args.max_tokens < 2:
        ap.error("--max-tokens must be >= 2 (ITL and tok/s need two output tokens)")
    if args.runs < 1 or args.warmup < 0:
        ap.error("--runs must be >= 1 and --warmup >= 0")
    for msg in (check_writable(args.json, "--json"), check_writable(args.plot, "--plot")):
        if msg:
            print(f"error: {msg}", file=sys.stderr)
            return 2

    client = oc.connect(args)
    if client is None:
        return 2
    try:
        oc.check_model(client, args.model)
    except oc.ClientError as e:
        print(f"error: {e}", file=sys.stderr)
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
    bar = Progress(n_requests, enabled=not args.no_progress)
    bench = Bench(client, args.model, max_tokens=args.max_tokens, seed=args.seed, temperature=args.temperature,
                  warmup=args.warmup, runs=args.runs, cold_salt=args.cold_salt,
                  use_tokenize=not args.no_tokenize, extra_body=args.extra_body, progress=bar)
    bench.stop_on_all_failed = not args.keep_going
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    t0 = time.monotonic()
    results: list[dict] = []
    stopped = None  # why the run ended early

    def document() -> dict:
        return {
            "tool": "scripts/client/bench_serving.py",
            "command": ["python3", "scripts/client/bench_serving.py"] + (sys.argv[1:] if argv is None else list(argv)),
            "started_at": started, "wall_s": time.monotonic() - t0, "label": args.label,
            "date": started, "backend": "openai-chat", "model_id": args.model,
            "base_url": args.base_url, "model": args.model,
            "complete": stopped is None and len(results) == len(configs), "stopped": stopped,
            "configs_planned": len(configs), "skipped_configs": skipped,
            "settings": {"max_tokens": args.max_tokens, "warmup": args.warmup, "runs": args.runs,
                         "seed": args.seed, "temperature": args.temperature, "cold_salt": args.cold_salt,
                         "extra_body": args.extra_body},
            "prompts": {str(p): {"filler_words": w, "tokens_measured": meas,
                                 "tokens_estimated": round(w * oc.TOKENS_PER_WORD)}
                        for p, (w, meas) in bench.words.items()},
            "results": results,
        }

    try:
        for k, (p, m, c) in enumerate(configs, 1):
            bar.note(f"configuration {k}/{len(configs)}: {p} tokens, {m} prefix, {c} streams")
            results.append(bench.config(p, m, c))
            if args.json:
                oc.write_json(args.json, document())  # kept if the run dies later
    except KeyboardInterrupt:
        stopped = "interrupted (Ctrl-C)"
    except AllFailed as e:
        stopped = f"stopped: {e}"
    finally:
        bar.close()
    out = document()
    if results:
        print(table(results))
    if args.json:
        oc.write_json(args.json, out)
        print(f"wrote {args.json}" + ("" if out["complete"] else f" ({len(results)} of {len(configs)} configurations)"))
    if args.plot:
        backend = plot(results, args.plot, title=args.label or "decode tok/s vs concurrent streams")
        if backend:
            print(f"wrote {args.plot} ({backend})")
        else:
            print(f"no chart: no request succeeded, {args.plot} not written", file=sys.stderr)
    served = [r for r in results for run in r["runs"] for x in run["prompt_tokens_server"]]
    if served and all(x is None for r in results for run in r["runs"] for x in run["cached_tokens"]):
        print("note: the server sent no usage.prompt_tokens_details.cached_tokens (no prefix-reuse figures); "
              "vLLM returns it when started with --enable-prompt-tokens-details", file=sys.stderr)
    if stopped:
        print(f"error: {stopped}; the results measured so far are kept"
              + ("" if "Ctrl-C" in stopped else " (--keep-going runs every configuration anyway)"),
              file=sys.stderr)
        return 130 if "Ctrl-C" in stopped else 1
    errors = sum(r["summary"]["errors"] for r in results)
    if errors:
        first = next(s for r in results for run in r["runs"] for s in run["error_samples"])
        print(f"error: {errors} requests failed; first: {first}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
