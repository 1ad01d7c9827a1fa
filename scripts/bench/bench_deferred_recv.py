#!/usr/bin/env python3
"""Step time of a 3-stage PP decode loop with and without the deferred receive.

decode-03 (patch 0300-deferred-recv, gate VLLM_PP_DEFERRED_RECV). Runs the
3-process gloo harness of scripts/bench/pp_pipeline_harness.py (real
Worker.execute_model, GroupCoordinator irecv/isend_tensor_dict and
DeferredRecvIntermediateTensors; a stand-in runner) with sleeps standing in
for --prep-ms of input/attention-metadata preparation and --gpu-ms of forward
per rank, one request decoding (rank 0 waits for the last rank's token
before preparing the next step). CPU only.

--prep-from JSON takes each rank's prep time from a measurement of the real
V2 runner's input preparation (scripts/bench/measure_runner_prep.py --json):
the median per-step total of that rank at --prep-reqs decoding requests
(--prep-stat piece-medians: the sum of the pieces' medians instead, the
quiet-host figure). --gpu-ms stays a stand-in.

The stand-in forward is synchronous (the sleep holds the host until the
output is sent), so the model is: upstream step = 3 * (prep + gpu), deferred
step = prep + 3 * gpu (ranks 1 and 2 prepare while they wait). These are the
harness's numbers, not the server's; on the 3x3090 server the same change
lifted the 12.5 ms decode floor (article section 3.2).

Example:
  python scripts/bench/bench_deferred_recv.py \
      --prep-from scripts/bench/results/runner_prep.json \
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
        rank_prep_ms=args.rank_prep_ms,
        gpu_ms=args.gpu_ms,
        trace_steps=args.steps,
        timeout_s=args.timeout,
    )
    return step_periods_ms(run_pipeline(cfg), args.warmup)


def prep_from(path: str, num_reqs: int, stat: str) -> tuple[list[float], dict]:
    """Per-rank prep ms from a measure_runner_prep.py JSON."""
    data = json.loads(Path(path).read_text())
    if data.get("bench") != "runner_prep":
        raise SystemExit(f"{path}: not a measure_runner_prep.py result "
                         "(run scripts/bench/measure_runner_prep.py --json PATH)")
    per_rank = []
    for r in sorted(data["ranks"], key=lambda r: r["rank"]):
        case = next((c for c in r["cases"] if c["num_reqs"] == num_reqs), None)
        if case is None:
            raise SystemExit(f"{path}: rank {r['rank']} has no case with "
                             f"{num_reqs} requests (measure with --num-reqs {num_reqs})")
        per_rank.append(case["total"]["median_ms"] if stat == "median"
                        else case["sum_of_piece_medians_ms"])
    if len(per_rank) != 3:
        raise SystemExit(f"{path}: {len(per_rank)} ranks measured, the harness has 3")
    src = {"path": path, "num_reqs": num_reqs, "stat": stat,
           "measured_command": data.get("command"), "measured_host": data.get("host"),
           "measured_config": data.get("config")}
    return per_rank, src


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
    p.add_argument("--prep-from", metavar="JSON",
                   help="per-rank prep from a measure_runner_prep.py result")
    p.add_argument("--prep-reqs", type=int, default=1,
                   help="with --prep-from: the decode batch size to take")
    p.add_argument("--prep-stat", choices=("median", "piece-medians"), default="median",
                   help="with --prep-from: median per-step total (default) or the "
                   "sum of the pieces' medians")
    p.add_argument("--gpu-ms", type=float, default=3.5,
                   help="forward per rank (stand-in)")
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
    args.rank_prep_ms, prep_source = None, None
    if args.prep_from:
        per_rank, prep_source = prep_from(args.prep_from, args.prep_reqs, args.prep_stat)
        args.rank_prep_ms = tuple(per_rank)

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
    G = args.gpu_ms
    preps = list(args.rank_prep_ms or (args.prep_ms,) * 3)
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
            "prep_ms": preps if args.rank_prep_ms else args.prep_ms,
            "prep_source": prep_source or "--prep-ms (a guess)",
            "gpu_ms": G,
            "backend": "gloo (CPU), stand-in runner with sleeps",
        },
        # Ranks 1 and 2 prepare while the earlier ranks work (their prep fits
        # in rank 0's prep + forward); rank 0 waits for the token first.
        "model_ms": {"upstream": round(sum(preps) + 3 * G, 3),
                     "deferred": round(preps[0] + 3 * G, 3)},
        "upstream": up,
        "deferred": de,
        "saved_median_ms": round(up["median_ms"] - de["median_ms"], 3),
        "model_saved_ms": round(preps[1] + preps[2], 3),
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
