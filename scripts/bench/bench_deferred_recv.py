#!/usr/bin/env python3
"""Step time of a 3-stage PP decode loop with and without the deferred receive.

decode-03 (patch 0300-deferred-recv, gate VLLM_PP_DEFERRED_RECV). Runs the
3-process gloo harness of scripts/bench/pp_pipeline_harness.py (real
Worker.execute_model, GroupCoordinator irecv/isend_tensor_dict and
DeferredRecvIntermediateTensors; a stand-in runner) with sleeps standing in
for --prep-ms of input/attention-metadata preparation and --gpu-ms of forward
per rank, one request decoding (rank 0 waits for the last rank's token
before preparing the next step). CPU only.

The stand-in forward is synchronous (the sleep holds the host until the
output is sent), so the model is: upstream step = 3 * (prep + gpu), deferred
step = prep + 3 * gpu (ranks 1 and 2 prepare while they wait). These are the
harness's numbers, not the server's; on the 3x3090 server the same change
lifted the 12.5 ms decode floor (article section 3.2).

Example:
  python scripts/bench/bench_deferred_recv.py \
      --json scripts/bench/results/deferred_recv.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# CPU only: the harness never touches a GPU.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pp_pipeline_harness import (  # noqa: E402
    HarnessConfig,
    events_by_step,
    run_pipeline,
)


def step_periods_ms(results: list[dict], warmup: int) -> list[float]:
    """Rank 0 step start to step start: one token of the decode loop."""
    ev = events_by_step(results[0])
    starts = [ev[s]["step_start"] for s in sorted(ev) if "step_start" in ev[s]]
    return [(b - a) * 1e3 for a, b in zip(starts, starts[1:])][warmup:]


def run_one(args, deferred: bool) -> list[float]:
    cfg = HarnessConfig(
        deferred=deferred,
        steps=args.steps,
        prep_ms=args.prep_ms,
        gpu_ms=args.gpu_ms,
        trace_steps=args.steps,
        timeout_s=args.timeout,
    )
    return step_periods_ms(run_pipeline(cfg), args.warmup)


def summarize(periods: list[float]) -> dict:
    return {
        "median_ms": round(statistics.median(periods), 3),
        "mean_ms": round(statistics.fmean(periods), 3),
        "p90_ms": round(sorted(periods)[int(0.9 * (len(periods) - 1))], 3),
        "n": len(periods),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=200, help="decode steps per run")
    p.add_argument("--warmup", type=int, default=10, help="steps left out per run")
    p.add_argument(
        "--repeats", type=int, default=3, help="runs per setting (alternating)"
    )
    p.add_argument("--prep-ms", type=float, default=3.0, help="host prep per rank")
    p.add_argument("--gpu-ms", type=float, default=3.5, help="forward per rank")
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds per run before its ranks are killed",
    )
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write the result as JSON to PATH (no PATH: stdout)")
    args = p.parse_args(argv)
    if args.steps <= args.warmup + 2:
        p.error("--steps must exceed --warmup by at least 3")

    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is in the project venv; plain loop otherwise
        def tqdm(x, **_):
            return x

    print("importing vllm (about 20 s of CPU) ...", file=sys.stderr, flush=True)
    import vllm.v1.worker.gpu_worker  # noqa: F401  (once; the ranks are forked)

    periods = {False: [], True: []}
    runs = [(r, d) for r in range(args.repeats) for d in (False, True)]
    for _, deferred in tqdm(runs, desc="runs (upstream/deferred)", file=sys.stderr):
        periods[deferred].extend(run_one(args, deferred))

    up, de = summarize(periods[False]), summarize(periods[True])
    P, G = args.prep_ms, args.gpu_ms
    out = {
        "bench": "deferred_recv",
        "patch": "0300-deferred-recv",
        "gate": "VLLM_PP_DEFERRED_RECV",
        "command": "python scripts/bench/bench_deferred_recv.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {
            "ranks": 3,
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "prep_ms": P,
            "gpu_ms": G,
            "backend": "gloo (CPU), stand-in runner with sleeps",
        },
        "model_ms": {"upstream": 3 * (P + G), "deferred": P + 3 * G},
        "upstream": up,
        "deferred": de,
        "saved_median_ms": round(up["median_ms"] - de["median_ms"], 3),
        "model_saved_ms": 2 * P,
        "ratio_median": round(de["median_ms"] / up["median_ms"], 4),
        "ratio_mean": round(de["mean_ms"] / up["mean_ms"], 4),
        "host": {
            "cpus": os.cpu_count(),
            "loadavg_1m": round(os.getloadavg()[0], 2),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    }
    print(
        f"step time, median: upstream {up['median_ms']:.2f} ms, deferred "
        f"{de['median_ms']:.2f} ms, ratio {out['ratio_median']:.3f} (model "
        f"{out['model_ms']['upstream']:.1f} -> {out['model_ms']['deferred']:.1f} ms)",
        file=sys.stderr,
    )
    if args.json == "-":
        print(json.dumps(out, indent=2))
    elif args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
