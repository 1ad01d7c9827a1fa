#!/usr/bin/env python3
"""Time the small kernels of the series at production shapes (Qwen3.8-Flash-
Next, max-num-seqs 4, max-num-batched-tokens 512) in CUDA graphs, and record
bytes read per call from the shapes. Runs inside the kit that
make_small_kernels_kit.py builds (no vLLM needed; torch + triton only).

  0650  get_aligned_state_indices_multi_group_kernel: one launch for every
        Mamba group's aligned state ids (4 requests)
  0100  _ple_ngram_ids_kernel: PLE n-gram ids (4 decode tokens, 512 prefill)
  0500  _int6_planes_gemm_kernel (int6_planes_linear): the shared expert's
        INT6 GEMMs for M > 8 (gate_up 2560 -> 1280, down 640 -> 2560) at
        9/16/64/512 tokens, cycling over enough weight sets to miss L2

  python3 bench_small_kernels.py --json out.json          # device
  TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python3 bench_small_kernels.py --dry-run
      # CPU: tiny shapes, one launch each, checked against torch; no timing
"""

import argparse
import json
import platform
import sys
import time

# Production shapes (scripts/data/qwen4_exp_flash_next_config.json; serving flags).
MAX_SEQS = 4
MAX_TOKENS = 512
HIDDEN, SHARED_I = 2560, 640            # hidden_size; shared expert intermediate (bench_moe_fused.py)
NGRAM_SIZE, HEADS_PER_NGRAM = 3, 8      # ngram_size; Qwen4ExpConfig's heads_per_ngram default
NGRAM_VOCAB = 20_000_000                # ngram_vocab_size_base (each head's table size, rounded to 128)
# 0650: Mamba groups per PP rank (16 layers: 12 linear-attention in 3 groups of 4
# beside 4 full-attention layers) and state slots per request (1 + 1 MTP token).
MAMBA_GROUPS, STATE_SLOTS = 3, 2
CACHE_BLOCK = 12144                     # any value: the kernel gathers one id per slot
GEMM_TOKENS = (9, 16, 64, 512)
GEMM_SHAPES = {"gate_up": (2 * SHARED_I, HIDDEN), "down": (HIDDEN, SHARED_I)}  # (N, K)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, one launch each, checked; no timing")
    ap.add_argument("--weight-sets", type=int, default=48,
                    help="INT6 weight copies cycled per graph (48 x 2.5 MB > the H200's L2)")
    ap.add_argument("--calls", type=int, default=200, help="launches per graph for the tiny kernels")
    ap.add_argument("--replays", type=int, default=50)
    return ap.parse_args(argv)


def aligned_case(torch, sk, triton, dev, num_reqs, groups, slots, block, width):
    g = torch.Generator().manual_seed(0)
    bts = [torch.randint(0, 1 << 20, (MAX_SEQS, width), generator=g, dtype=torch.int32).to(dev)
           for _ in range(groups)]
    ptrs = torch.tensor([bt.data_ptr() for bt in bts], dtype=torch.int64, device=dev)
    seq_lens = torch.randint(1, block * (width - slots) + 1, (MAX_SEQS,), generator=g,
                             dtype=torch.int32).to(dev)
    out = torch.zeros(groups, MAX_SEQS, slots, dtype=torch.int32, device=dev)

    def launch():
        sk.get_aligned_state_indices_multi_group_kernel[(triton.cdiv(num_reqs, 32),)](
            ptrs, seq_lens, out, bts[0].stride(0), seq_lens.stride(0), out.stride(0), out.stride(1),
            out.stride(2), num_reqs, CACHE_BLOCK_SIZE=block, NUM_GROUPS=groups,
            BLOCK_GROUPS=triton.next_power_of_2(groups), NUM_STATE_SLOTS=slots,
            BLOCK_STATE_SLOTS=triton.next_power_of_2(slots), BLOCK_ROWS=32, num_warps=1)

    def check():
        first = ((seq_lens[:num_reqs].long() - 1) // block).clamp(min=0)
        idx = first[:, None] + torch.arange(slots, device=dev)[None]
        ref = torch.stack([bt[:num_reqs].gather(1, idx) for bt in bts])
        assert torch.equal(out[:, :num_reqs], ref), "aligned state ids differ from the torch gather"

    # reads: seq_lens + group base pointers + the gathered ids; writes the ids
    nread = num_reqs * 4 + groups * 8 + groups * num_reqs * slots * 4
    shape = dict(num_reqs=num_reqs, groups=groups, state_slots=slots, cache_block=block)
    return launch, check, nread, groups * num_reqs * slots * 4, shape, bts


def ngram_case(torch, sk, triton, dev, tokens, reqs):
    ctx_len = NGRAM_SIZE - 1
    heads = ctx_len * HEADS_PER_NGRAM
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 150000, (tokens,), generator=g, dtype=torch.int32).to(dev)
    per = [tokens // reqs + (i < tokens % reqs) for i in range(reqs)]
    qsl = torch.tensor([0] + list(__import__("itertools").accumulate(per)), dtype=torch.int32, device=dev)
    ctx = torch.randint(0, 150000, (reqs, ctx_len), generator=g, dtype=torch.int64).to(dev)
    mult = torch.randint(1, 1 << 40, (ctx_len + 1,), generator=g, dtype=torch.int64).to(dev)
    sizes = torch.full((heads,), NGRAM_VOCAB, dtype=torch.int64, device=dev) + torch.arange(
        heads, device=dev) * 128
    offs = torch.cumsum(sizes, 0) - sizes
    out = torch.empty(tokens, heads, dtype=torch.int64, device=dev)

    def launch():
        sk._ple_ngram_ids_kernel[(triton.cdiv(tokens, 8),)](
            ids, qsl, ctx, mult, sizes, offs, out, tokens, reqs, 2,
            binary_search_iters=reqs.bit_length(), NGRAM_CONTEXT_LEN=ctx_len,
            HEADS_PER_NGRAM=HEADS_PER_NGRAM, BLOCK_T=8, launch_pdl=False, num_warps=4)

    def check():
        assert bool(((out >= offs) & (out < offs + sizes)).all()), "n-gram id outside its head's table"

    # reads: ids (each token + its ctx_len predecessors, served once from DRAM),
    # query_start_loc, ngram_context rows, multipliers, sizes, offsets; writes ids
    nread = tokens * 4 + (reqs + 1) * 4 + reqs * ctx_len * 8 + (ctx_len + 1) * 8 + 2 * heads * 8
    shape = dict(tokens=tokens, reqs=reqs, ngram_context=ctx_len, heads=heads, launch_pdl=False)
    return launch, check, nread, tokens * heads * 8, shape, None


_WEIGHTS = {}


def gemm_case(torch, mf, dev, m, n, k, sets, interp):
    g = torch.Generator().manual_seed(2)
    if (n, k, sets) not in _WEIGHTS:  # one set of weight copies per shape, shared by the token counts
        ws = []
        for _ in range(sets):
            u = torch.randint(0, 64, (n, k), generator=g, dtype=torch.int32)
            s = (torch.rand(n, 1, generator=g) * 2e-3 + 5e-4).bfloat16()
            ws.append((mf.int6_to_planes(mf.int6_pack_dense(u.to(dev)), k), s.to(dev), u))
        _WEIGHTS.clear()
        _WEIGHTS[(n, k, sets)] = ws
    ws = _WEIGHTS[(n, k, sets)]
    x = (torch.randn(m, k, generator=g) * 0.5).bfloat16().to(dev)
    res = {}

    def launch():
        for p, s, _ in ws:
            res["out"] = mf.int6_planes_linear(x, p, s, k, dot_f32=True if interp else None)

    def check():
        p, s, u = ws[-1]
        ref = x.float().cpu() @ ((u.float().cpu() - 32) * s.float().cpu()).t()
        got = res["out"].float().cpu()
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-2, f"INT6 GEMM differs from the dequantized matmul: rel err {err:.3g}"

    # reads per call: x (bf16) + bit planes (6 bits per weight) + per-channel scales (bf16)
    nread = m * k * 2 + n * k * 6 // 8 + n * 2
    shape = dict(M=m, N=n, K=k, group=0, weight_sets=sets,
                 tiles=[mf.GEMM_BLOCK_M, mf.GEMM_BLOCK_N, mf.GEMM_BLOCK_K])
    return launch, check, nread, m * n * 2, shape, ws


def main(argv=None) -> int:
    a = parse(argv)
    import os

    import torch
    import triton

    import moe_fused as mf
    import small_kernels as sk
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if not a.dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --dry-run (TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=) on CPU")
    dev = "cpu" if a.dry_run and interp else "cuda"
    if a.dry_run:
        cases = [("0650 aligned state ids", "aligned_state_ids",
                  lambda: aligned_case(torch, sk, triton, dev, 3, 3, 2, 16, 8)),
                 ("0100 PLE n-gram ids", "ple_ngram_ids", lambda: ngram_case(torch, sk, triton, dev, 11, 3)),
                 ("0500 INT6 GEMM", "int6_gemm", lambda: gemm_case(torch, mf, dev, 9, 64, 128, 1, interp))]
    else:
        from cuda_graph_timing import graph_us
        cases = [("0650 aligned state ids, 4 reqs", "aligned_state_ids",
                  lambda: aligned_case(torch, sk, triton, dev, MAX_SEQS, MAMBA_GROUPS, STATE_SLOTS,
                                       CACHE_BLOCK, 24))]
        for t in (MAX_SEQS, MAX_TOKENS):
            cases.append((f"0100 PLE n-gram ids, {t} tok", "ple_ngram_ids",
                          lambda t=t: ngram_case(torch, sk, triton, dev, t, MAX_SEQS)))
        for name, (n, k) in GEMM_SHAPES.items():
            for m in GEMM_TOKENS:
                cases.append((f"0500 INT6 GEMM {name}, {m} tok", f"int6_gemm_{name}",
                              lambda m=m, n=n, k=k: gemm_case(torch, mf, dev, m, n, k, a.weight_sets, interp)))
    rec = {"command": "python3 bench_small_kernels.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "device": torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "triton": triton.__version__, "dry_run": a.dry_run,
           "timing": "CUDA graph of many launches (cuda_graph_timing.graph_us), us per call",
           "bytes_read": "per call, from the shapes (formulas in bench_small_kernels.py)", "cases": []}
    try:
        for label, kind, make in cases:
            t0 = time.time()
            launch, check, nread, nwrite, shape, _keep = make()
            launch()
            if dev == "cuda":
                torch.cuda.synchronize()
            check()
            r = {"label": label, "kernel": kind, "shape": shape, "bytes_read": nread, "bytes_written": nwrite}
            if not a.dry_run:
                sets = shape.get("weight_sets", 1)
                calls = 1 if sets > 1 else a.calls

                def step(launch=launch, calls=calls):
                    for _ in range(calls):
                        launch()
                us = graph_us(step, calls * sets, a.replays)
                r["us"] = round(us, 3)
                r["gbs"] = round(nread / (us * 1e-6) / 1e9, 2)
            rec["cases"].append(r)
            print(f"{label}: read {nread:,} B" + (f", {r['us']:.2f} us, {r['gbs']:.1f} GB/s" if "us" in r else
                                                  ", checked") + f" ({time.time() - t0:.1f} s)", flush=True)
    except KeyboardInterrupt:
        print("interrupted: keeping the cases done so far", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
