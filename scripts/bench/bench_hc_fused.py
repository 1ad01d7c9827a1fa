#!/usr/bin/env python3
"""Benchmark and check the fused INT8 hyper-connection kernels (patch 0400-hc-fused).

Per GatedResidual (combine_norm + mix of Qwen4Exp, hidden 2560, 4 streams,
low rank 320), at 1, 2, 4, 8 tokens and at a 512-token prefill:

  unfused  upstream 0.30.0 path: hc_combine_norm, merged down+inject GEMM
           (cuBLAS, bf16 weights [336,10240]), hc_silu, up GEMM (cuBLAS,
           [10240,320]), hc_gate_mix: 5 launches (upstream Triton glue
           kernels). On the 3090 (sm_86) upstream runs these INT8 linears
           with AllSpark W8A16 GEMMs (Machete on sm_90, Marlin elsewhere);
           those need vLLM's CUDA extension, absent on the GPU machine, so
           bf16 cuBLAS (twice the weight bytes) stands in.
  fused    hc_combine_norm + _hc_down_inject_silu_kernel + _hc_up_gate_mix_kernel
           reading the INT8 weight_packed bytes directly: 3 launches.
  routed   (prefill, what the patch ran above 8 tokens before its W8A16
           GEMMs: bench_hc_prefill.py compares the two) hc_combine_norm + the
           unfused sequence on transient bf16 copies of the INT8 weights
           (dequant kernel + cuBLAS + upstream glue).

Timing: the GatedResiduals of --sets distinct weight sets (more bytes than the
L2 cache, as 96 GatedResiduals per token are) run back to back. "graph":
captured in one CUDA graph, CUDA events around --reps replays (production
decode runs in FULL cudagraphs: launch overhead removed from both sides);
"eager": the same calls launched from Python, CUDA events around them (host
launch overhead included). Unfused and fused are timed alternately --rounds
times and the medians reported, so ratios come from one run. PDL on/off:
programmatic dependent launch for every Triton kernel of both sides (sm_90
only; the 3090 has none).

--sweep: per token count, each down config (with the default up config),
then each up config (with the best down config), timed on the whole fused
GatedResidual, each checked against the fp32 reference first.

Correctness: fused vs an fp32 reference of the unfused math (exact-match
count) and vs the unfused bf16 path (max abs error).

Needs a CUDA GPU, torch and triton; vLLM is optional (without it the kernel
module and upstream's ops/hc.py are loaded from files: --kernels, --upstream-hc).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
import types
from pathlib import Path

PDL = {"on": False}
ARGS = None


def _load_file(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_kernels(path: str | None):
    if path is None:
        from vllm.models.qwen4_exp.nvidia.ops import hc_int8

        return hc_int8
    return _load_file("hc_int8", Path(path))


def load_upstream_hc(path: str | None):
    """Upstream's ops/hc.py (the unfused glue kernels), with vLLM or with stubs.
    With stubs, PDL follows the PDL flag of this script (both sides)."""
    if path is None:
        from vllm.models.qwen4_exp.nvidia.ops import hc

        return hc
    import triton
    import triton.language as tl

    class _Platform:
        @staticmethod
        def is_arch_support_pdl():
            return PDL["on"]

    stubs = {
        "vllm": types.ModuleType("vllm"),
        "vllm.platforms": types.ModuleType("vllm.platforms"),
        "vllm.triton_utils": types.ModuleType("vllm.triton_utils"),
        "vllm.utils": types.ModuleType("vllm.utils"),
        "vllm.utils.torch_utils": types.ModuleType("vllm.utils.torch_utils"),
    }
    stubs["vllm.platforms"].current_platform = _Platform()
    stubs["vllm.triton_utils"].tl = tl
    stubs["vllm.triton_utils"].triton = triton
    stubs["vllm.utils.torch_utils"].direct_register_custom_op = lambda **kw: None
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try:
        return _load_file("upstream_hc", Path(path))
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


DOWN_SWEEP = [  # (BLOCK_N, K_SPLIT, USE_DOT, num_warps)
    (2, 1024, False, 4), (4, 1024, False, 4), (4, 512, False, 4), (4, 2048, False, 4),
    (8, 1024, False, 4), (8, 512, False, 4), (4, 1024, False, 8),
    (16, 512, True, 4), (16, 1024, True, 4), (16, 256, True, 4), (32, 512, True, 4),
    (16, 512, True, 8),
]
UP_SWEEP = [  # (BLOCK_D, USE_DOT, num_warps)
    (2, False, 4), (4, False, 4), (8, False, 4), (4, False, 2),
    (4, True, 4), (8, True, 4), (16, True, 4), (4, True, 2),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,2,3,4,5,6,7,8", help="decode token counts")
    ap.add_argument("--prefill", type=int, default=512, help="prefill token count (0: skip)")
    ap.add_argument("--sets", type=int, default=16, help="distinct weight sets per graph")
    ap.add_argument("--reps", type=int, default=50, help="graph replays timed")
    ap.add_argument("--rounds", type=int, default=5, help="alternating timing rounds (median)")
    ap.add_argument("--sweep", action="store_true", help="also sweep the GEMV configs")
    ap.add_argument("--no-pdl", action="store_true", help="skip the PDL-off comparison")
    ap.add_argument("--kernels", help="path of hc_int8.py when vLLM is not installed")
    ap.add_argument("--upstream-hc", help="path of upstream ops/hc.py when vLLM is not installed")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    global ARGS
    ARGS = args

    import torch
    import torch.nn.functional as F
    from cuda_graph_timing import graph_us
    import triton

    if not torch.cuda.is_available():
        sys.exit("bench_hc_fused needs a CUDA GPU (none visible); run it on the GPU machine")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 reference must be fp32
    H = load_kernels(args.kernels)
    U = load_upstream_hc(args.upstream_hc)
    dev = torch.device("cuda")
    pdl_capable = torch.cuda.get_device_capability()[0] >= 9
    PDL["on"] = pdl_capable
    hid, hc, rank, inj, pad = 2560, 4, 320, 4, 12
    K, n_rows = hid * hc, rank + inj + pad
    eps = 1e-6
    g = torch.Generator(device=dev).manual_seed(0)

    def weight_set():
        wd = torch.randint(0, 256, (n_rows, K), dtype=torch.uint8, device=dev, generator=g)
        sd = (torch.rand(n_rows, 1, device=dev, generator=g) * 0.004 + 0.001).bfloat16()
        wd[rank + inj:] = 128  # padding rows as HCInt8LinearMethod leaves them
        sd[rank + inj:] = 0
        wu = torch.randint(0, 256, (K, rank), dtype=torch.uint8, device=dev, generator=g)
        su = (torch.rand(K, 1, device=dev, generator=g) * 0.02 + 0.005).bfloat16()
        # Pack like the checkpoint: int32 words, the kernels view them as uint8.
        wd_packed, wu_packed = wd.view(torch.int32), wu.view(torch.int32)
        norm = (torch.randn(K, device=dev, generator=g) * 0.1).bfloat16()
        return dict(
            wd=H.as_uint8(wd_packed), sd=sd, wu=H.as_uint8(wu_packed), su=su, norm=norm,
            wd_bf16=((wd.float() - 128) * sd.float()).bfloat16(),
            wu_bf16=((wu.float() - 128) * su.float()).bfloat16())

    sets = [weight_set() for _ in range(args.sets)]

    def inputs(m):
        return [dict(h=torch.randn(m, K, device=dev, generator=g).bfloat16(),
                     blk=torch.randn(m, hid, device=dev, generator=g).bfloat16(),
                     inj=torch.randn(m, hc, device=dev, generator=g).bfloat16())
                for _ in sets]

    def unfused(w, x):
        h, xn = U._hc_combine_norm(x["h"], x["blk"], x["inj"], w["norm"], eps, hc)
        d = F.linear(xn, w["wd_bf16"])
        lora, injection, _ = d.split([rank, inj, pad], dim=-1)
        lora = U._hc_silu(lora, hc)
        gate = F.linear(lora, w["wu_bf16"])
        return U._hc_gate_mix(xn, gate, hc), injection, xn

    def fused(w, x, dcfg=None, ucfg=None):
        h, xn = U._hc_combine_norm(x["h"], x["blk"], x["inj"], w["norm"], eps, hc)
        bi, injection = H.hc_int8_mix(xn, w["wd"], w["sd"], w["wu"], w["su"], rank, inj, hc,
                                      PDL["on"], dcfg, ucfg)
        return bi, injection, xn

    def routed(w, x):
        h, xn = U._hc_combine_norm(x["h"], x["blk"], x["inj"], w["norm"], eps, hc)
        bi, lin = H.hc_int8_prefill_mix(xn, w["wd"], w["sd"], w["wu"], w["su"], rank, inj, hc,
                                        U._hc_silu, U._hc_gate_mix)
        return bi, lin[:, rank:rank + inj], xn

    def time_graph(fn, xs, reps=None) -> float:
        """us per GatedResidual (graph of len(sets) calls)."""

        def step():
            for w, x in zip(sets, xs):
                fn(w, x)

        return graph_us(step, len(sets), reps or args.reps, warmup=2)

    def time_eager(fn, xs, reps=None) -> float:
        reps = max(5, (reps or args.reps) // 5)
        for w, x in zip(sets, xs):
            fn(w, x)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(reps):
            for w, x in zip(sets, xs):
                fn(w, x)
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) * 1e3 / (reps * len(sets))

    def alternate(fns: dict, xs, timer) -> dict:
        """Median over --rounds of alternating timings of every fn."""
        samples = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                samples[k].append(timer(fn, xs))
        return {k: statistics.median(v) for k, v in samples.items()} | {
            k + "_samples": v for k, v in samples.items()}

    def check(m, dcfg=None, ucfg=None, fn=None) -> dict:
        w, x = sets[0], inputs(m)[0]
        bi_f, inj_f, xn = (fn or (lambda w, x: fused(w, x, dcfg, ucfg)))(w, x)
        bi_u, inj_u, _ = unfused(w, x)
        ref_bi, ref_inj = H.reference_mix(xn, w["wd"], w["sd"], w["wu"], w["su"], rank, inj,
                                          hc, rnd=H.round_bf16_rne)
        counters = int(H.split_k_scratch(dev)[1].abs().sum())
        return {
            "block_input_mismatch_vs_fp32_ref": int((bi_f.float() != ref_bi).sum()),
            "block_input_numel": bi_f.numel(),
            "block_input_max_abs_err_vs_fp32_ref": float((bi_f.float() - ref_bi).abs().max()),
            "inject_mismatch_vs_fp32_ref": int((inj_f.float() != ref_inj).sum()),
            "inject_max_abs_err_vs_fp32_ref": float((inj_f.float() - ref_inj).abs().max()),
            "block_input_max_abs_err_vs_unfused_bf16": float((bi_f.float() - bi_u.float()).abs().max()),
            "unfused_block_input_max_abs_err_vs_fp32_ref": float((bi_u.float() - ref_bi).abs().max()),
            "block_input_max_abs": float(ref_bi.abs().max()),
            "inject_max_abs": float(ref_inj.abs().max()),
            "split_k_counters_left": counters,
        }

    def ok(c: dict) -> bool:
        # 1-ulp flips of a bf16 GEMM output propagate: accept <= 2 % of the max
        # (block_input), 2 bf16 ulps of the largest (inject logits).
        return (c["split_k_counters_left"] == 0 and c["block_input_max_abs_err_vs_fp32_ref"]
                <= 0.02 * c["block_input_max_abs"]
                and c["inject_max_abs_err_vs_fp32_ref"] <= 2 ** -6 * c["inject_max_abs"])

    t0 = time.time()
    token_counts = [int(t) for t in args.tokens.split(",") if t]
    results = {"correctness": {}, "sweep": {}, "best_config": {}, "graph_us": {},
               "graph_us_pdl_off": {}, "eager_us": {}, "kernel_graph_us": {},
               "achieved_GBps": {}, "prefill_us": {}}

    def dkey(c):
        return "BN={BLOCK_N} KS={K_SPLIT} dot={USE_DOT} w={num_warps}".format(**c)

    def ukey(c):
        return "BD={BLOCK_D} dot={USE_DOT} w={num_warps}".format(**c)

    for m in token_counts:
        xs = inputs(m)
        best_d, best_u = H.down_gemv_config(m), H.up_gemv_config(m)
        if args.sweep:
            res = {}
            for bn, ks, dot, nw in DOWN_SWEEP:
                c = dict(BLOCK_N=bn, K_SPLIT=ks, USE_DOT=dot, num_warps=nw)
                chk = check(m, c, best_u)
                t = time_graph(lambda w, x, c=c: fused(w, x, c, best_u), xs) if ok(chk) else None
                res["down " + dkey(c)] = dict(us=t, ok=ok(chk), check=chk)
                if t is not None and t < res.get("_best_d", (1e9,))[0]:
                    res["_best_d"] = (t, c)
            best_d = res.pop("_best_d")[1]
            for bd, dot, nw in UP_SWEEP:
                c = dict(BLOCK_D=bd, USE_DOT=dot, num_warps=nw)
                chk = check(m, best_d, c)
                t = time_graph(lambda w, x, c=c: fused(w, x, best_d, c), xs) if ok(chk) else None
                res["up " + ukey(c)] = dict(us=t, ok=ok(chk), check=chk)
                if t is not None and t < res.get("_best_u", (1e9,))[0]:
                    res["_best_u"] = (t, c)
            best_u = res.pop("_best_u")[1]
            results["sweep"][str(m)] = res
            for k, v in res.items():
                print(f"sweep M={m} {k}: {v}", flush=True)
        results["best_config"][str(m)] = {"down": best_d, "up": best_u}
        results["correctness"][str(m)] = {
            "default": check(m), "best": check(m, best_d, best_u)}
        print(f"M={m} best down {best_d} up {best_u}\n  correctness "
              f"{results['correctness'][str(m)]}", flush=True)
        fns = {"unfused": unfused,
               "fused_best": lambda w, x: fused(w, x, best_d, best_u),
               "fused_default": fused}
        r = alternate(fns, xs, time_graph)
        r["ratio_best"] = r["unfused"] / r["fused_best"]
        r["ratio_default"] = r["unfused"] / r["fused_default"]
        results["graph_us"][str(m)] = r
        print(f"M={m} graph PDL={PDL['on']}: unfused {r['unfused']:.2f} us, fused(best) "
              f"{r['fused_best']:.2f} (x{r['ratio_best']:.2f}), fused(default) "
              f"{r['fused_default']:.2f} (x{r['ratio_default']:.2f})", flush=True)
        # Kernel-only times (graph of len(sets) launches) and achieved bandwidth.
        xn = [U._hc_combine_norm(x["h"], x["blk"], x["inj"], w["norm"], eps, hc)[1]
              for w, x in zip(sets, xs)]
        lora = [torch.randn(m, rank, device=dev, generator=g).bfloat16() for _ in sets]
        xl = list(zip(xn, lora))
        kt = {
            "down": time_graph(lambda w, x: H.hc_down_inject_silu(
                x[0], w["wd"], w["sd"], rank, rank + inj, hc, PDL["on"], best_d), xl),
            "up": time_graph(lambda w, x: H.hc_up_gate_mix(
                x[1], w["wu"], w["su"], x[0], hc, PDL["on"], best_u), xl),
            "combine_norm": time_graph(lambda w, x: U._hc_combine_norm(
                x["h"], x["blk"], x["inj"], w["norm"], eps, hc), xs),
            "cublas_down_bf16": time_graph(lambda w, x: F.linear(x[0], w["wd_bf16"]), xl),
            "cublas_up_bf16": time_graph(lambda w, x: F.linear(x[1], w["wu_bf16"]), xl),
        }
        results["kernel_graph_us"][str(m)] = kt
        bytes_down = (rank + inj) * K + m * K * 2 + m * (rank + inj) * 2
        bytes_up = K * rank + m * rank * 2 + m * K * 2 + m * hid * 2
        results["achieved_GBps"][str(m)] = {
            "down": bytes_down / kt["down"] / 1e3, "up": bytes_up / kt["up"] / 1e3,
            "cublas_down_bf16": (n_rows * K * 2 + m * K * 2) / kt["cublas_down_bf16"] / 1e3,
            "cublas_up_bf16": (K * rank * 2 + m * rank * 2) / kt["cublas_up_bf16"] / 1e3,
            "bytes_down": bytes_down, "bytes_up": bytes_up}
        print(f"M={m} kernels (graph, us): {kt}\n  GB/s {results['achieved_GBps'][str(m)]}",
              flush=True)
        fns = {"unfused": unfused, "fused_best": lambda w, x: fused(w, x, best_d, best_u)}
        if pdl_capable and not args.no_pdl:
            PDL["on"] = False
            r = alternate(fns, xs, time_graph)
            r["ratio_best"] = r["unfused"] / r["fused_best"]
            results["graph_us_pdl_off"][str(m)] = r
            PDL["on"] = True
            print(f"M={m} graph PDL=off: unfused {r['unfused']:.2f} us, fused(best) "
                  f"{r['fused_best']:.2f} (x{r['ratio_best']:.2f})", flush=True)
        r = alternate(fns, xs, time_eager)
        r["ratio_best"] = r["unfused"] / r["fused_best"]
        results["eager_us"][str(m)] = r
        print(f"M={m} eager PDL={PDL['on']}: unfused {r['unfused']:.2f} us, fused(best) "
              f"{r['fused_best']:.2f} (x{r['ratio_best']:.2f})", flush=True)
        save(results, t0)

    if args.prefill:
        m = args.prefill
        xs = inputs(m)
        results["correctness"][str(m)] = {"routed": check(m, fn=routed)}
        print(f"M={m} correctness {results['correctness'][str(m)]}", flush=True)
        save(results, t0)
        # The dequant route only (the results files of this script predate the
        # prefill GEMMs; bench_hc_prefill.py times those against it).
        r = alternate({"unfused": unfused, "routed": routed}, xs,
                      lambda fn, xs: time_graph(fn, xs, max(5, args.reps // 5)))
        r["ratio_routed"] = r["unfused"] / r["routed"]
        results["prefill_us"][str(m)] = r
        print(f"prefill {m}: unfused {r['unfused']:.2f} us, routed {r['routed']:.2f} "
              f"(x{r['ratio_routed']:.2f})", flush=True)

    save(results, t0, done=True)


def save(results: dict, t0: float, done: bool = False) -> None:
    """Write the results so far (a crash later still leaves the data)."""
    import torch
    import triton

    results.update(
        complete=done,
        command=" ".join(["python3", "scripts/bench/bench_hc_fused.py", *sys.argv[1:]]),
        device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        pdl_capable=torch.cuda.get_device_capability()[0] >= 9, sets=ARGS.sets,
        reps=ARGS.reps, rounds=ARGS.rounds, wall_s=round(time.time() - t0, 1),
        shapes=dict(hidden=2560, hc=4, low_rank=320, inject=4, pad=12),
        method="CUDA graph of --sets GatedResiduals (distinct weights, > L2), CUDA events "
               "around --reps replays; unfused/fused alternated --rounds times, medians",
        unfused="upstream 0.30.0 bf16 path: hc_combine_norm + cuBLAS merged GEMM + hc_silu + "
                "cuBLAS up + hc_gate_mix (stand-in for AllSpark W8A16 on sm_86, not available here)",
        fused="hc_combine_norm + _hc_down_inject_silu_kernel + _hc_up_gate_mix_kernel "
              "(INT8 weight_packed)",
        routed="hc_combine_norm + dequant to bf16 + cuBLAS + hc_silu + dequant + cuBLAS + "
               "hc_gate_mix (prefill on the INT8 weights)",
    )
    if ARGS.json:
        Path(ARGS.json).write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {ARGS.json}", flush=True)


if __name__ == "__main__":
    main()
