#!/usr/bin/env python3
"""Benchmark and check the INT8 hyper-connection prefill GEMMs (patch 0400-hc-fused).

Per GatedResidual (combine_norm + mix of Qwen4Exp: hidden 2560, 4 streams,
low rank 320, 4 inject rows, merged GEMM padded to 336 rows) at 16..512
tokens (more than 8: the prefill path), three paths timed in one run:

  gemm     what the patch runs now: hc_combine_norm + _hc_prefill_down_kernel
           (W8A16 tl.dot GEMM on weight_packed's bytes, silu fused into the
           store) + _hc_prefill_up_kernel (up GEMM + gate mix, the [M, 10240]
           gate logits never written): 3 launches, no transient weight copy.
  routed   what the patch ran before: hc_combine_norm + dequant of each weight
           to a transient bf16 copy + cuBLAS + hc_silu + dequant + cuBLAS +
           hc_gate_mix (upstream's glue kernels).
  unfused  upstream's sequence on bf16 weights (cuBLAS), the lower bound of
           the routed path. On the 3090 upstream's INT8 HC linears run
           AllSpark W8A16 GEMMs (sm_8x); AllSpark and Marlin need vLLM's CUDA
           extension, absent on the GPU machine, so this is a stand-in.

Timing: the GatedResiduals of --sets distinct weight sets run back to back
in one CUDA graph, CUDA events around --reps replays; the paths are timed
alternately --rounds times, medians reported (ratios from one run).
--sweep: every candidate config is compiled first (--jobs processes, for this
GPU and for sm_86: candidates over sm_86's 101,376 B of shared memory are
dropped); per token count, each down / up candidate timed alone (each first
checked against the fp32 reference), the best kept; the whole path is then
timed with the patch's defaults and with the best configs.
Peak memory: torch.cuda.max_memory_allocated above the inputs, one call.
Bytes / FLOPs per path and a 3090 roofline (936 GB/s, 71 TFLOPS dense bf16
with fp32 accumulate) are printed as estimates, not measurements.

Correctness: gemm vs an fp32 reference of the unfused math (weights
dequantized in fp32, bf16 rounding at the unfused path's stores).

Needs a CUDA GPU, torch and triton; vLLM optional (--kernels hc_int8.py and
--upstream-hc ops/hc.py load the modules from files, as bench_hc_fused.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

HID, HC, RANK, INJ, PAD = 2560, 4, 320, 4, 12
K = HID * HC
N_ROWS = RANK + INJ + PAD
GBPS_3090, TFLOPS_3090 = 936e9, 71e12

# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)
DOWN_SWEEP = [
    (16, 32, 128, 4, 4, 3), (16, 32, 128, 8, 4, 3), (16, 32, 128, 16, 4, 3),
    (16, 64, 128, 4, 4, 3), (16, 64, 128, 8, 4, 3), (16, 64, 128, 16, 4, 3),
    (32, 32, 128, 4, 4, 3), (32, 32, 128, 8, 4, 3),
    (32, 64, 128, 2, 4, 3), (32, 64, 128, 4, 4, 3), (32, 64, 128, 8, 4, 3),
    (64, 32, 128, 2, 4, 3), (64, 32, 128, 4, 4, 3),
    (64, 64, 128, 2, 4, 3), (64, 64, 128, 4, 4, 3),
    (32, 32, 128, 1, 4, 3), (32, 32, 128, 2, 4, 3), (32, 64, 128, 1, 4, 3),
    (32, 64, 64, 1, 4, 4), (64, 32, 128, 1, 4, 3), (64, 64, 128, 1, 4, 3),
    (64, 64, 64, 1, 4, 4), (32, 128, 128, 1, 4, 3), (64, 128, 64, 1, 8, 3),
    (128, 64, 64, 1, 8, 3), (64, 64, 128, 1, 8, 3),
    (32, 128, 128, 1, 8, 3), (64, 128, 128, 1, 8, 2), (128, 64, 128, 1, 8, 2),
    (128, 128, 64, 1, 8, 3), (32, 32, 256, 1, 4, 3), (32, 32, 64, 1, 4, 4),
    (64, 32, 128, 1, 8, 3), (64, 32, 256, 1, 4, 3), (128, 32, 128, 1, 4, 3),
]
# (BLOCK_M, BLOCK_D, BLOCK_K, num_warps, num_stages)
UP_SWEEP = [
    (16, 16, 64, 4, 2), (16, 32, 64, 4, 2), (32, 16, 64, 4, 3), (32, 32, 64, 4, 3),
    (32, 64, 64, 4, 3), (64, 16, 64, 4, 3), (64, 32, 64, 4, 3), (64, 32, 64, 8, 3),
    (64, 64, 64, 8, 3), (128, 16, 64, 4, 3), (128, 16, 64, 8, 3), (128, 32, 64, 8, 3),
    (64, 32, 32, 4, 3), (128, 32, 64, 8, 2), (32, 16, 32, 4, 4), (128, 64, 64, 8, 2),
]

ARGS = None


def dcfg(t):
    return dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages"), t))


def ucfg(t):
    return dict(zip(("BLOCK_M", "BLOCK_D", "BLOCK_K", "num_warps", "num_stages"), t))


def dkey(c):
    return "BM={BLOCK_M} BN={BLOCK_N} BK={BLOCK_K} SK={SPLIT_K} w={num_warps} s={num_stages}".format(**c)


def ukey(c):
    return "BM={BLOCK_M} BD={BLOCK_D} BK={BLOCK_K} w={num_warps} s={num_stages}".format(**c)


def down_fits(c, m, H) -> bool:
    """The split-K scratch holds SPLIT_K x M_pad x N_pad fp32 (as the wrapper asserts)."""
    if c["SPLIT_K"] == 1:
        return True
    tiles = -(-(RANK + INJ) // c["BLOCK_N"]) * -(-m // c["BLOCK_M"])
    return c["SPLIT_K"] * tiles * c["BLOCK_M"] * c["BLOCK_N"] <= H._DECODE_PARTIALS


SM86_MAX_SHARED = 101_376  # bytes per block on sm_86 (as tests/sm86.py)
DOWN_SIG = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*bf16", "out_ptr": "*bf16",
            "part_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "stride_x": "i32",
            "stride_w": "i32", "stride_out": "i32"}
UP_SIG = {"a_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*bf16", "xn_ptr": "*bf16",
          "out_ptr": "*bf16", "M": "i32", "stride_a": "i32", "stride_w": "i32",
          "stride_xn": "i32", "stride_out": "i32"}


def sm86_shared(H, kind: str, c: dict) -> int:
    """Shared memory of a config compiled for sm_86 (specialized as a real
    launch: every pointer and stride 16-byte divisible, M not specialized)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if kind == "down":
        fn, sig = H._hc_prefill_down_kernel, dict(DOWN_SIG)
        cx = dict(K=K, N_SILU=RANK, N_OUT=RANK + INJ, HC=HC, DOT_F32=False,
                  **{k: c[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K")})
    else:
        fn, sig = H._hc_prefill_up_kernel, dict(UP_SIG)
        cx = dict(R=RANK, D=HID, HC=HC, DOT_F32=False,
                  **{k: c[k] for k in ("BLOCK_M", "BLOCK_D", "BLOCK_K")})
    aligned = [a for a in sig if a != "M"]
    sig.update({k: "constexpr" for k in cx})
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn, signature={a: sig[a] for a in fn.arg_names}, constexprs=cx, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 86, 32),
                       options={"num_warps": c["num_warps"], "num_stages": c["num_stages"]})
    return int(k.metadata.shared)


def _compile_worker(kernels: str, jobs: list) -> list:
    """Compile configs in a child (Triton's on-disk cache is shared): launch
    each on small real-stride tensors (M is not specialized)."""
    import torch

    from bench_hc_fused import _load_file

    H = _load_file("hc_int8", Path(kernels)) if kernels else None
    if H is None:
        from vllm.models.qwen4_exp.nvidia.ops import hc_int8 as H
    dev = torch.device("cuda")
    xn = torch.zeros(16, K, dtype=torch.bfloat16, device=dev)
    wd = torch.full((N_ROWS, K), 128, dtype=torch.uint8, device=dev)
    wu = torch.full((K, RANK), 128, dtype=torch.uint8, device=dev)
    sd = torch.zeros(N_ROWS, 1, dtype=torch.bfloat16, device=dev)
    su = torch.zeros(K, 1, dtype=torch.bfloat16, device=dev)
    lin = xn.new_empty((16, H.padded_width(RANK + INJ)))
    shared = []
    for kind, c in jobs:
        if kind == "down":
            H.hc_prefill_down_silu(xn, wd, sd, RANK, RANK + INJ, HC, c, out=lin)
        else:
            H.hc_prefill_up_gate_mix(lin[:, :RANK], wu, su, xn, HC, c)
        shared.append((kind, sorted(c.items()), sm86_shared(H, kind, c)))
    torch.cuda.synchronize()
    return shared


def precompile(jobs: list, n: int) -> dict:
    """Compile every config (for this GPU and for sm_86) in n processes:
    {(kind, config items): sm_86 shared memory bytes}."""
    import concurrent.futures as cf
    import multiprocessing as mp

    t = time.time()
    chunks = [jobs[i::n] for i in range(n)]
    with cf.ProcessPoolExecutor(n, mp_context=mp.get_context("spawn")) as ex:
        out = {(kind, tuple(tuple(i) for i in items)): sh
               for part in ex.map(_compile_worker, [ARGS.kernels] * n, chunks)
               for kind, items, sh in part}
    print(f"precompiled {len(out)} configs in {time.time() - t:.1f} s ({n} processes)",
          flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16,32,64,128,256,512", help="prefill token counts")
    ap.add_argument("--sets", type=int, default=8, help="distinct weight sets per graph")
    ap.add_argument("--reps", type=int, default=20, help="graph replays timed")
    ap.add_argument("--rounds", type=int, default=3, help="alternating timing rounds (median)")
    ap.add_argument("--sweep", action="store_true", help="sweep the down / up configs")
    ap.add_argument("--jobs", type=int, default=8, help="processes compiling the sweep configs")
    ap.add_argument("--kernels", help="path of hc_int8.py when vLLM is not installed")
    ap.add_argument("--upstream-hc", help="path of upstream ops/hc.py when vLLM is not installed")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    global ARGS
    ARGS = args

    import torch
    import torch.nn.functional as F

    from bench_hc_fused import load_kernels, load_upstream_hc
    from cuda_graph_timing import graph_us

    if not torch.cuda.is_available():
        sys.exit("bench_hc_prefill needs a CUDA GPU (none visible); run it on the GPU machine")
    torch.backends.cuda.matmul.allow_tf32 = False
    H = load_kernels(args.kernels)
    U = load_upstream_hc(args.upstream_hc)
    import bench_hc_fused

    bench_hc_fused.PDL["on"] = False  # no PDL on sm_86: upstream's glue launched without it
    dev = torch.device("cuda")
    eps = 1e-6
    g = torch.Generator(device=dev).manual_seed(0)
    token_counts = [int(t) for t in args.tokens.split(",") if t]
    t0 = time.time()

    if args.sweep:
        jobs = [("down", dcfg(c)) for c in DOWN_SWEEP] + [("up", ucfg(c)) for c in UP_SWEEP]
        jobs += [("down", H.prefill_down_config(m)) for m in token_counts]
        jobs += [("up", H.prefill_up_config(m)) for m in token_counts]
        sm86 = precompile(jobs, args.jobs)

    def fits86(kind, c) -> bool:
        """Only configs that launch on the 3090 are candidates."""
        return not args.sweep or sm86[(kind, tuple(sorted(c.items())))] <= SM86_MAX_SHARED

    def weight_set():
        wd = torch.randint(0, 256, (N_ROWS, K), dtype=torch.uint8, device=dev, generator=g)
        sd = (torch.rand(N_ROWS, 1, device=dev, generator=g) * 0.004 + 0.001).bfloat16()
        wd[RANK + INJ:] = 128  # padding rows as HCInt8LinearMethod leaves them
        sd[RANK + INJ:] = 0
        wu = torch.randint(0, 256, (K, RANK), dtype=torch.uint8, device=dev, generator=g)
        su = (torch.rand(K, 1, device=dev, generator=g) * 0.02 + 0.005).bfloat16()
        norm = (torch.randn(K, device=dev, generator=g) * 0.1).bfloat16()
        return dict(wd=H.as_uint8(wd.view(torch.int32)), sd=sd, wu=H.as_uint8(wu.view(torch.int32)),
                    su=su, norm=norm, wd_bf16=((wd.float() - 128) * sd.float()).bfloat16(),
                    wu_bf16=((wu.float() - 128) * su.float()).bfloat16())

    sets = [weight_set() for _ in range(args.sets)]

    def inputs(m):
        return [dict(h=torch.randn(m, K, device=dev, generator=g).bfloat16(),
                     blk=torch.randn(m, HID, device=dev, generator=g).bfloat16(),
                     inj=torch.randn(m, HC, device=dev, generator=g).bfloat16())
                for _ in sets]

    def norm(w, x):
        return U._hc_combine_norm(x["h"], x["blk"], x["inj"], w["norm"], eps, HC)[1]

    def unfused(w, x):
        xn = norm(w, x)
        d = F.linear(xn, w["wd_bf16"])
        lora, injection, _ = d.split([RANK, INJ, PAD], dim=-1)
        gate = F.linear(U._hc_silu(lora, HC), w["wu_bf16"])
        return U._hc_gate_mix(xn, gate, HC), injection

    def routed(w, x):
        bi, lin = H.hc_int8_prefill_mix(norm(w, x), w["wd"], w["sd"], w["wu"], w["su"], RANK,
                                        INJ, HC, U._hc_silu, U._hc_gate_mix)
        return bi, lin[:, RANK:RANK + INJ]

    def gemm(w, x, dc=None, uc=None):
        bi, lin = H.hc_int8_prefill_gemm_mix(norm(w, x), w["wd"], w["sd"], w["wu"], w["su"],
                                             RANK, INJ, HC, dc, uc)
        return bi, lin[:, RANK:RANK + INJ]

    def time_graph(fn, xs) -> float:
        def step():
            for w, x in zip(sets, xs):
                fn(w, x)
        return graph_us(step, len(sets), args.reps, warmup=2)

    def alternate(fns: dict, xs) -> dict:
        samples = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                samples[k].append(time_graph(fn, xs))
        return {k: statistics.median(v) for k, v in samples.items()} | {
            k + "_samples": v for k, v in samples.items()}

    def check(m, fn, x=None) -> dict:
        w = sets[0]
        x = x or inputs(m)[0]
        xn = norm(w, x)
        bi, inj = fn(w, x)
        ref_bi, ref_inj = H.reference_mix(xn, w["wd"], w["sd"], w["wu"], w["su"], RANK, INJ, HC,
                                          rnd=H.round_bf16_rne)
        return {
            "block_input_mismatch": int((bi.float() != ref_bi).sum()),
            "block_input_numel": bi.numel(),
            "block_input_max_abs_err": float((bi.float() - ref_bi).abs().max()),
            "block_input_max_abs": float(ref_bi.abs().max()),
            "inject_mismatch": int((inj.float() != ref_inj).sum()),
            "inject_max_abs_err": float((inj.float() - ref_inj).abs().max()),
            "inject_max_abs": float(ref_inj.abs().max()),
            "split_k_counters_left": int(H.split_k_scratch(dev)[1].abs().sum()),
        }

    def ok(c) -> bool:
        # As bench_hc_fused.py: a 1-ulp flip of a bf16 GEMM output propagates.
        return (c["split_k_counters_left"] == 0
                and c["block_input_max_abs_err"] <= 0.02 * c["block_input_max_abs"]
                and c["inject_max_abs_err"] <= 2 ** -6 * c["inject_max_abs"])

    def peak_mib(fn, x) -> float:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn(sets[0], x)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        return peak / 2 ** 20

    def traffic(m) -> dict:
        """Minimum DRAM bytes and FLOPs per GatedResidual mix (after combine_norm)."""
        a = m * K * 2  # xn bf16
        down_w, up_w = N_ROWS * K, K * RANK  # INT8
        flops = 2 * m * K * (RANK + INJ) + 2 * m * RANK * K
        lin = m * N_ROWS * 2
        bi = m * HID * 2
        gemm_b = (a + down_w + lin) + (lin + up_w + a + bi)
        gate = m * K * 2
        routed_b = (down_w + 2 * down_w) + (a + 2 * down_w + lin) + 2 * lin + (
            up_w + 2 * up_w) + (lin + 2 * up_w + gate) + (gate + a + bi)
        unfused_b = routed_b - 3 * down_w - 3 * up_w
        out = {}
        for k, b in (("gemm", gemm_b), ("routed", routed_b), ("unfused_bf16", unfused_b)):
            out[k] = {"bytes": b, "flops": flops,
                      "roofline_3090_us": max(b / GBPS_3090, flops / TFLOPS_3090) * 1e6,
                      "bytes_3090_us": b / GBPS_3090 * 1e6}
        return out

    results = {"sm86_shared_bytes": {f"{k} " + (dkey if k == "down" else ukey)(dict(c)): v
                                     for (k, c), v in sm86.items()} if args.sweep else {},
               "correctness": {}, "sweep": {}, "best_config": {}, "default_config": {},
               "graph_us": {}, "kernel_graph_us": {}, "peak_mib": {}, "traffic": {}}
    for m in token_counts:
        xs = inputs(m)
        best_d, best_u = H.prefill_down_config(m), H.prefill_up_config(m)
        results["default_config"][str(m)] = {"down": dict(best_d), "up": dict(best_u)}
        xn = [norm(w, x) for w, x in zip(sets, xs)]
        lora = [torch.randn(m, N_ROWS, device=dev, generator=g).bfloat16() for _ in sets]
        xl = list(zip(xn, lora))
        if args.sweep:
            res, bd, bu = {}, (1e9, None), (1e9, None)
            for c in map(dcfg, DOWN_SWEEP):
                if not down_fits(c, m, H) or c["BLOCK_M"] > max(16, 2 * m) or not fits86("down", c):
                    continue
                chk = check(m, lambda w, x, c=c: gemm(w, x, c, best_u), xs[0])
                t = time_graph(lambda w, x, c=c: H.hc_prefill_down_silu(
                    x[0], w["wd"], w["sd"], RANK, RANK + INJ, HC, c, out=x[1]), xl) if ok(chk) else None
                res["down " + dkey(c)] = dict(us=t, ok=ok(chk))
                if t is not None and t < bd[0]:
                    bd = (t, c)
            for c in map(ucfg, UP_SWEEP):
                if c["BLOCK_M"] > max(16, 2 * m) or not fits86("up", c):
                    continue
                chk = check(m, lambda w, x, c=c: gemm(w, x, best_d, c), xs[0])
                t = time_graph(lambda w, x, c=c: H.hc_prefill_up_gate_mix(
                    x[1][:, :RANK], w["wu"], w["su"], x[0], HC, c), xl) if ok(chk) else None
                res["up " + ukey(c)] = dict(us=t, ok=ok(chk))
                if t is not None and t < bu[0]:
                    bu = (t, c)
            best_d, best_u = bd[1] or best_d, bu[1] or best_u
            results["sweep"][str(m)] = res
            print(f"M={m} sweep best down {dkey(best_d)} {bd[0]:.2f} us, up {ukey(best_u)} "
                  f"{bu[0]:.2f} us", flush=True)
        results["best_config"][str(m)] = {"down": best_d, "up": best_u}
        results["correctness"][str(m)] = {
            "gemm_default": check(m, gemm, xs[0]),
            "gemm_best": check(m, lambda w, x: gemm(w, x, best_d, best_u), xs[0]),
            "routed": check(m, routed, xs[0]), "unfused_bf16": check(m, unfused, xs[0])}
        print(f"M={m} correctness {json.dumps(results['correctness'][str(m)])}", flush=True)
        fns = {"unfused_bf16": unfused, "routed": routed, "gemm_default": gemm,
               "gemm_best": lambda w, x: gemm(w, x, best_d, best_u)}
        r = alternate(fns, xs)
        r["ratio_routed_over_gemm_default"] = r["routed"] / r["gemm_default"]
        r["ratio_routed_over_gemm_best"] = r["routed"] / r["gemm_best"]
        r["ratio_unfused_over_gemm_default"] = r["unfused_bf16"] / r["gemm_default"]
        results["graph_us"][str(m)] = r
        print(f"M={m} graph us/GatedResidual: unfused(bf16) {r['unfused_bf16']:.2f}, routed "
              f"{r['routed']:.2f}, gemm(default) {r['gemm_default']:.2f} (routed/gemm "
              f"x{r['ratio_routed_over_gemm_default']:.2f}), gemm(best) {r['gemm_best']:.2f}",
              flush=True)
        kt = {
            "combine_norm": time_graph(lambda w, x: norm(w, x), xs),
            "gemm_down": time_graph(lambda w, x: H.hc_prefill_down_silu(
                x[0], w["wd"], w["sd"], RANK, RANK + INJ, HC, None, out=x[1]), xl),
            "gemm_up_gate_mix": time_graph(lambda w, x: H.hc_prefill_up_gate_mix(
                x[1][:, :RANK], w["wu"], w["su"], x[0], HC), xl),
            "dequant_down": time_graph(lambda w, x: H.dequant_bf16(w["wd"], w["sd"], N_ROWS), xl),
            "dequant_up": time_graph(lambda w, x: H.dequant_bf16(w["wu"], w["su"], K), xl),
            "cublas_down_bf16": time_graph(lambda w, x: F.linear(x[0], w["wd_bf16"]), xl),
            "cublas_up_bf16": time_graph(lambda w, x: F.linear(x[1][:, :RANK], w["wu_bf16"]), xl),
            "hc_silu": time_graph(lambda w, x: U._hc_silu(x[1][:, :RANK], HC), xl),
        }
        gate = [torch.randn(m, K, device=dev, generator=g).bfloat16() for _ in sets]
        kt["hc_gate_mix"] = time_graph(lambda w, x: U._hc_gate_mix(x[0], x[1], HC),
                                       list(zip(xn, gate)))
        results["kernel_graph_us"][str(m)] = kt
        results["peak_mib"][str(m)] = {k: peak_mib(fn, xs[0]) for k, fn in
                                       (("routed", routed), ("gemm", gemm),
                                        ("unfused_bf16", unfused))}
        results["traffic"][str(m)] = traffic(m)
        print(f"M={m} kernels {json.dumps({k: round(v, 2) for k, v in kt.items()})}\n"
              f"  peak MiB above inputs {results['peak_mib'][str(m)]}", flush=True)
        del gate, lora, xl, xn, xs
        save(results, t0)
    save(results, t0, done=True)


def save(results: dict, t0: float, done: bool = False) -> None:
    import torch
    import triton

    results.update(
        complete=done,
        command=" ".join(["python3", "scripts/bench/bench_hc_prefill.py", *sys.argv[1:]]),
        device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        sets=ARGS.sets, reps=ARGS.reps, rounds=ARGS.rounds, wall_s=round(time.time() - t0, 1),
        shapes=dict(hidden=HID, hc=HC, low_rank=RANK, inject=INJ, pad=PAD),
        method="CUDA graph of --sets GatedResiduals (distinct weights), CUDA events around "
               "--reps replays; paths alternated --rounds times, medians; PDL off (sm_86 has none)",
        paths=dict(
            gemm="hc_combine_norm + _hc_prefill_down_kernel + _hc_prefill_up_kernel (INT8 "
                 "weight_packed read directly, no transient copy)",
            routed="hc_combine_norm + dequant to bf16 + cuBLAS + hc_silu + dequant + cuBLAS + "
                   "hc_gate_mix (the patch's previous prefill path)",
            unfused_bf16="upstream sequence on bf16 weights with cuBLAS (stand-in: on sm_86 "
                         "upstream's INT8 HC linears run AllSpark, which needs vLLM)"),
        roofline_3090="estimate, not a measurement: max(bytes / 936 GB/s, flops / 71 TFLOPS)",
    )
    if ARGS.json:
        Path(ARGS.json).write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {ARGS.json}", flush=True)


if __name__ == "__main__":
    main()
