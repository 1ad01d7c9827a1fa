#!/usr/bin/env python3
"""QSA prefill over host K/V (0220-qsa-kv-offload): staged vs unstaged.

Runs on a GPU machine without vLLM, from the kit make_qsa_device_kit.py builds:

  python3 scripts/bench/make_qsa_device_kit.py --tree /work/dev-main --kit staging --out _device/qsa
  (device) cd _device/qsa && python3 bench_qsa_staging.py --json $OUT/qsa_staging.json

For each case (query rows x context x selection pattern) it runs the QSA
sparse attention kernel four ways, in one process, CUDA-event timed:
  vram         K/V in VRAM (what the offload gives up; the lower bound)
  uva          the kernel reads the host K/V directly over UVA (no arena)
  staged_torch the first staging (torch.unique + torch advanced indexing)
  staged       the patch: the in-kernel dedup (mark kernel, in-place int32
               cumsum, compact kernel), one Triton gather into the arena and
               the rewrite kernel, then the attention kernel on the arena
and checks that uva, staged_torch and staged equal vram bit for bit. Per case
it also times the staging alone (stage_only_ms, when the arena holds the
rows), the patch's dedup alone (dedup_ms: stage_selected_rows with the gather
skipped, i.e. mark + cumsum + the count read back + compact + rewrite + the
arena table; on overflow only mark + cumsum + read back) and the first
version's torch.unique dedup (dedup_torch_unique_ms, same steps, no copy).
It also times the gather alone against a contiguous host-to-device copy of
the same bytes (the link's ceiling).

Selection patterns: ``random`` = uniform top-k over the request's context
(the worst case for de-duplication), ``clustered`` = every row of the chunk
picks from one shared pool of positions plus its own recent window (adjacent
queries select mostly the same rows; decode steps overlap 72 % per SPEC §5).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import pinned_host_pool as php
import qsa_host_kv as qhk
from dev_stubs import get_accelerator_view_from_cpu_tensor as uva_view
from dev_stubs import timed
from qsa_ops import qsa_sparse_paged_attention

H_KV, GROUP, D = 2, 8, 256
BS = 12_144
TOPK = 2048 + 3


def old_stage(kv_cache, logical_indices, block_table, token_to_req, arena, stats=None,
              copy=True):
    """The first staging (kept here to time against): torch advanced indexing,
    and an overflowing batch always halved (stats claim unbounded reuse).
    copy=False: its dedup and index rewrite only (no rows copied)."""
    block_size = kv_cache.shape[2]
    topk = logical_indices.shape[1] - 1
    idx = logical_indices[:, :topk].long()
    num_requests, width = block_table.shape
    req = token_to_req.long()
    req_ok = (req >= 0) & (req < num_requests)
    safe_req = req.clamp(0, num_requests - 1)
    safe_idx = idx.clamp_min(0)
    page = safe_idx // block_size
    valid = req_ok[:, None] & (idx >= 0) & (page < width)
    physical = block_table[safe_req[:, None], page.clamp_max(width - 1)].long()
    valid &= (physical >= 0) & (physical < kv_cache.shape[0])
    slots = physical * block_size + safe_idx % block_size
    unique, inverse = torch.unique(slots[valid], sorted=True, return_inverse=True)
    if stats is not None:
        stats.update(selected=float("inf"), distinct=unique.numel())
    if unique.numel() > arena.rows:
        return None
    tokens = kv_cache.transpose(1, 2)
    if copy:
        arena.token_rows[: unique.numel()].copy_(tokens[unique // block_size, unique % block_size])
    new_idx = torch.full_like(logical_indices, -1)
    new_idx[:, topk] = logical_indices[:, topk]
    cols = new_idx[:, :topk]
    cols[valid] = inverse.to(new_idx.dtype)
    table = torch.full_like(block_table, -1)
    table[:, : arena.num_blocks] = torch.arange(arena.num_blocks, dtype=block_table.dtype,
                                                device=block_table.device)
    return arena.kv_view, new_idx, table


def selection(rows, ctx, pattern, gen):
    if pattern == "random":
        idx = torch.rand(rows, ctx, device="cuda", generator=gen).topk(TOPK, dim=1).indices
    else:
        pool_size = min(ctx, 16_384)
        pool = torch.randperm(ctx, device="cuda", generator=gen)[:pool_size]
        window = 256
        picks = pool[torch.rand(rows, pool_size, device="cuda", generator=gen)
                     .topk(TOPK - window, dim=1).indices]
        base = ctx - rows - window + torch.arange(rows, device="cuda")
        recent = base[:, None] + torch.arange(window, device="cuda")[None, :]
        idx = torch.cat([picks, recent], 1)
        # top-k gives distinct positions; the window may repeat a pool pick,
        # which the kernel allows (a repeated row is read twice)
    idx = torch.sort(idx, dim=1).values.to(torch.int32)
    count = torch.full((rows, 1), TOPK, dtype=torch.int32, device="cuda")
    return torch.cat([idx, count], 1).contiguous()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--ctx-blocks", default="4,21", help="context lengths in 12,144-token blocks")
    ap.add_argument("--rows", default="64,512", help="prefill query rows per chunk")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ctx_blocks = [int(x) for x in a.ctx_blocks.split(",")]
    nb = max(ctx_blocks) + 1
    res = {"command": "cd _device/qsa && python3 bench_qsa_staging.py " + " ".join(sys.argv[1:]),
           "kit": "python3 scripts/vllm_patches.py tree <tree> && python3 scripts/bench/make_qsa_device_kit.py "
                  "--tree <tree> --kit staging --out _device/qsa",
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "block_size": BS, "kv_heads": H_KV, "head_dim": D, "topk": TOPK, "cases": {}}
    nbytes = nb * BS * H_KV * 2 * D * 2
    pool = php.allocate_pinned_host_pool(nbytes, what="bench host K/V", rank_label="bench")
    host_kv = qhk.host_kv_layer_views(pool.tensor, 1, nb, BS, H_KV, D)[0]
    host_kv.copy_(torch.randn(host_kv.shape, dtype=torch.bfloat16))
    uva_kv = qhk.host_kv_layer_views(uva_view(pool.tensor), 1, nb, BS, H_KV, D)[0]
    vram_kv = uva_kv.clone()
    assert torch.equal(vram_kv.cpu(), host_kv)
    arena = qhk.QSAStagingArena(4, BS, H_KV, D, "cuda")
    res["arena_mib"] = arena.nbytes / 2**20

    # the link's ceiling vs the gather, same bytes
    n_rows = 48_576
    slots = torch.randperm(nb * BS, device="cuda", generator=gen)[:n_rows]
    slots32 = slots.to(torch.int32)  # the gather takes int32 slots
    gather_ms = timed(lambda: qhk.stage_rows(uva_kv, slots32, arena.token_rows), a.iters)
    torch_ms = timed(lambda: arena.token_rows.copy_(
        uva_kv.transpose(1, 2)[slots // BS, slots % BS]), a.iters)
    src = pool.tensor[: n_rows * 2048]
    dst = torch.empty(n_rows * 2048, dtype=torch.uint8, device="cuda")
    memcpy_ms = timed(lambda: dst.copy_(src, non_blocking=True), a.iters)
    gb = n_rows * 2048 / 1e9
    res["gather_48576_random_rows"] = {
        "triton_gather_ms": gather_ms, "triton_gather_gbps": gb / gather_ms * 1e3,
        "torch_index_ms": torch_ms, "torch_index_gbps": gb / torch_ms * 1e3,
        "contiguous_h2d_ms": memcpy_ms, "contiguous_h2d_gbps": gb / memcpy_ms * 1e3}
    print(json.dumps(res["gather_48576_random_rows"]), flush=True)

    def dedup_only(packed, table, t2r):
        # the patch's staging with its gather skipped: what is left is the
        # dedup (stage_selected_rows looks stage_rows up in its module)
        real = qhk.stage_rows
        qhk.stage_rows = lambda *args: None
        try:
            return qhk.stage_selected_rows(uva_kv, packed, table, t2r, arena)
        finally:
            qhk.stage_rows = real

    ok = True
    for blocks in ctx_blocks:
        ctx = blocks * BS
        table = torch.full((1, 22), -1, dtype=torch.int32, device="cuda")
        table[0, :blocks] = torch.randperm(nb, device="cuda", generator=gen)[:blocks].to(torch.int32)
        for rows in [int(x) for x in a.rows.split(",")]:
            for pattern in ("random", "clustered"):
                q = torch.randn(rows, H_KV * GROUP, D, dtype=torch.bfloat16, device="cuda")
                gate = torch.randn_like(q)
                t2r = torch.zeros(rows, dtype=torch.int32, device="cuda")
                packed = selection(rows, ctx, pattern, gen)

                def run(kv, out):
                    k, v = kv.transpose(1, 2).split(D, dim=-1)
                    qsa_sparse_paged_attention(q, k, v, packed, table, t2r, True, out,
                                               output_gate=gate)

                def staged(out, stage_fn):
                    real = qhk.stage_selected_rows
                    qhk.stage_selected_rows = stage_fn
                    try:
                        qhk.staged_sparse_attention(qsa_sparse_paged_attention, q, uva_kv, D,
                                                    packed, table, t2r, True, out, gate, arena)
                    finally:
                        qhk.stage_selected_rows = real

                outs = {k: torch.empty_like(q) for k in ("vram", "uva", "staged_torch", "staged")}
                run(vram_kv, outs["vram"])
                run(uva_kv, outs["uva"])
                staged(outs["staged_torch"], old_stage)
                staged(outs["staged"], qhk.stage_selected_rows)
                sel = packed[:, :-1].long()
                distinct = int(torch.unique(sel).numel())
                c = {"rows": rows, "ctx": ctx, "pattern": pattern, "distinct_rows": distinct,
                     "parts_needed_min": -(-distinct // arena.rows)}
                for k in ("uva", "staged_torch", "staged"):
                    c[f"{k}_equals_vram"] = bool(torch.equal(outs[k], outs["vram"]))
                    ok &= c[f"{k}_equals_vram"]
                c["vram_ms"] = timed(lambda: run(vram_kv, outs["vram"]), a.iters)
                c["uva_ms"] = timed(lambda: run(uva_kv, outs["uva"]), a.iters)
                c["staged_torch_ms"] = timed(lambda: staged(outs["staged_torch"], old_stage), a.iters)
                c["staged_ms"] = timed(lambda: staged(outs["staged"], qhk.stage_selected_rows),
                                       a.iters)
                if distinct <= arena.rows:
                    c["stage_only_ms"] = timed(lambda: qhk.stage_selected_rows(
                        uva_kv, packed, table, t2r, arena), a.iters)
                c["dedup_ms"] = timed(lambda: dedup_only(packed, table, t2r), a.iters)
                c["dedup_torch_unique_ms"] = timed(lambda: old_stage(
                    uva_kv, packed, table, t2r, arena, copy=False), a.iters)
                c["uva_over_staged"] = c["uva_ms"] / c["staged_ms"]
                c["staged_torch_over_staged"] = c["staged_torch_ms"] / c["staged_ms"]
                name = f"rows{rows}_ctx{ctx}_{pattern}"
                res["cases"][name] = c
                print(name, json.dumps(c), flush=True)
    res["all_equal"] = ok
    pool.release()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
