#!/usr/bin/env python3
"""Per-layer QSA decode attention time with K/V in pinned host RAM (UVA):
every row from host (upstream split-K kernel) vs the row cache
(0250-qsa-row-cache: invalidate + plan + cached split-K + merge) at 0 %,
72 % and 100 % step-to-step selection overlap, and the all-VRAM upstream
kernel as the floor. One run, so the ratios compare like with like.

Reference (article §5, RTX 3090, 1 row): 174 us all from host; cached 177
(0 %), 78 (72 %), 38 us (100 %).

Real shapes: 2 KV heads x 256, 16 query heads, selection width 2,051 (rows
of 2 KiB), 12,144-token blocks, 22 blocks per request (262k context), the
<= 12-row launch config (64 splits). A step's selection keeps `overlap` of
the previous step's columns and replaces the rest with positions never
selected before (a fresh permutation of the context), so 0 % is really 0.
Steady state: eager warm-up steps of the same sequence, then the timed
steps replayed as one CUDA graph (GPU time per step, CUDA events).

  python3 scripts/bench/bench_qsa_row_cache.py --json scripts/bench/results/qsa_row_cache_h200.json
  (device kit: cd _device/rowcache && python3 bench_qsa_row_cache.py --json $OUT/x.json)
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

try:
    from vllm.models.qwen4_exp.nvidia.ops import qsa_row_cache as rc
    from vllm.models.qwen4_exp.nvidia.ops.qsa import qsa_sparse_paged_attention
except ImportError:  # device kit (no vLLM)
    import qsa_row_cache as rc
    from qsa_ops import qsa_sparse_paged_attention

KV_HEADS, HEAD_DIM, Q_HEADS, TOPK, BLOCK, WIDTH = 2, 256, 16, 2051, 12144, 22


class _CAI:
    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (nbytes,),
                                         "typestr": "|u1", "version": 3}


def selections(rows: int, steps: int, overlap: float, ctx: int, g: torch.Generator) -> torch.Tensor:
    """[steps, rows, TOPK] logical positions; step t+1 keeps `overlap` of
    step t's columns (the same columns), the rest are never-seen positions."""
    out = torch.empty(steps, rows, TOPK, dtype=torch.int64)
    for r in range(rows):
        perm = torch.randperm(ctx, generator=g)
        cur, nxt = perm[:TOPK].clone(), TOPK
        for t in range(steps):
            out[t, r] = cur
            n_new = TOPK - round(overlap * TOPK)
            cols = torch.randperm(TOPK, generator=g)[:n_new]
            if nxt + n_new > ctx:
                raise SystemExit("context too small for this many fresh steps")
            cur = cur.clone()
            cur[cols] = perm[nxt:nxt + n_new]
            nxt += n_new
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="decode rows (1 per request)")
    ap.add_argument("--overlaps", type=float, nargs="+", default=[0.0, 0.72, 1.0])
    ap.add_argument("--steps", type=int, default=100, help="timed steps per case")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes; the median is kept")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    dev = "cuda"
    g = torch.Generator().manual_seed(0)
    max_rows = max(a.rows)
    assert max_rows <= rc.ROW_CACHE_MAX_ROWS
    ctx = WIDTH * BLOCK
    # Host K/V of one layer: each request its own 22 blocks (token-major BLNHC).
    num_blocks = WIDTH * max_rows
    host = torch.empty(num_blocks, BLOCK, KV_HEADS, 2 * HEAD_DIM, dtype=torch.bfloat16,
                       pin_memory=True)
    uva = torch.as_tensor(_CAI(host.data_ptr(), host.nbytes), device=dev)
    uva = uva.view(torch.bfloat16).view(host.shape)
    uva.copy_(torch.randn(host.shape, device=dev, dtype=torch.bfloat16))
    vram = uva.clone()
    torch.cuda.synchronize()
    kv_host, kv_vram = uva.transpose(1, 2), vram.transpose(1, 2)
    arena = torch.zeros(4, BLOCK, KV_HEADS, 2 * HEAD_DIM, dtype=torch.bfloat16, device=dev)
    table_all = torch.arange(num_blocks, dtype=torch.int32, device=dev).view(max_rows, WIDTH)

    def split(kv):
        return kv.transpose(1, 2).split(HEAD_DIM, dim=-1)

    res = {"command": " ".join(["python3", *sys.argv]), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "shape": dict(kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                                     q_heads=Q_HEADS, topk=TOPK, block=BLOCK,
                                                     table_width=WIDTH),
           "steps": a.steps, "warmup": a.warmup, "repeats": a.repeats, "cases": []}
    for rows in a.rows:
        table = table_all[:rows].contiguous()
        t2r = torch.arange(rows, dtype=torch.int32, device=dev)
        q = torch.randn(rows, Q_HEADS, HEAD_DIM, device=dev).bfloat16()
        gate = torch.randn(rows, Q_HEADS, HEAD_DIM, device=dev).bfloat16()
        out = torch.empty_like(q)
        # the step's K/V store: one new token per request (a slot no step selects)
        slot_mapping = (table[:, -1].long() * BLOCK + BLOCK - 1).contiguous()
        for overlap in a.overlaps:
            n = a.warmup + a.steps
            sel = selections(rows, n, overlap, ctx - 1, g)
            idx = torch.cat([sel.to(torch.int32),
                             torch.full((n, rows, 1), TOPK, dtype=torch.int32)], -1).to(dev)
            case = {"rows": rows, "overlap": overlap}

            def run_upstream(kv, i):
                k, v = split(kv)
                qsa_sparse_paged_attention(q, k, v, idx[i], table, t2r, False, out,
                                           output_gate=gate)

            def timed(fn, setup=None):
                """GPU time per step: the timed steps are one CUDA graph
                (eager Triton launches would make the loop CPU-bound),
                replayed after eager warm-up steps of the same sequence."""
                if setup is not None:
                    setup()
                for i in range(n):  # compiles every kernel before capture
                    fn(i)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for i in range(a.warmup, n):
                        fn(i)
                times = []
                for _ in range(a.repeats):
                    if setup is not None:
                        setup()
                    for i in range(a.warmup):
                        fn(i)
                    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                    start.record()
                    graph.replay()
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end) * 1e3 / a.steps)
                del graph
                times.sort()
                return round(times[len(times) // 2], 1)

            case["host_us"] = timed(lambda i: run_upstream(kv_host, i))
            case["vram_us"] = timed(lambda i: run_upstream(kv_vram, i))
            cache = rc.QSARowCache(arena)

            def reset():
                cache.tags.fill_(-1)

            def run_cached(i):
                cache.invalidate(0, slot_mapping)
                k, v = split(kv_host)
                cache.attention(0, q, k, v, idx[i], table, t2r, out, output_gate=gate)

            case["cached_us"] = timed(run_cached, reset)
            # correctness of the last step and the hit rate (counted pass)
            ref = torch.empty_like(q)
            k, v = split(kv_host)
            qsa_sparse_paged_attention(q, k, v, idx[n - 1], table, t2r, False, ref,
                                       output_gate=gate)
            case["last_step_equal"] = bool(torch.equal(out, ref))
            reset()
            cache.count_hits = True
            for i in range(n):
                if i == a.warmup:
                    cache.stats.zero_()
                run_cached(i)
            hits, lookups = cache.stats[0].tolist()
            case["hit_rate"] = round(hits / max(1, lookups), 4)
            case["cached_vs_host"] = round(case["cached_us"] / case["host_us"], 3)
            print(json.dumps(case), flush=True)
            res["cases"].append(case)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
