#!/usr/bin/env python3
"""Whole MoE block and whole GatedResidual: vLLM 0.30.0's own kernels vs the
series' fused kernels (0400-hc-fused, 0500-moe-fused), CUDA graphs, PDL off.

Upstream side: the pinned wheel's compiled `_moe_C` extension (the exact
binary of vLLM 0.30.0, commit gced6857af, loaded with torch.ops.load_library;
the kit carries it xz-compressed, make_upstream_kit.py):
  MoE block  router F.linear (cuBLAS, what upstream's ReplicatedLinear runs),
             _moe_C.topk_softmax (bf16 logits, renormalize),
             _moe_C.moe_align_block_size, routed experts =
             _moe_C.moe_wna16_marlin_gemm x2 (INT4 uint4b8, group 128, as
             fused_marlin_moe calls it), _moe_C.moe_sum, shared expert + gate;
             the INT6 shared expert through Humming (humming-kernels 0.1.12,
             JIT CUDA) exactly as 0.30.0 calls it: vLLM's own
             HummingLinearKernel.process_weights_after_loading/apply_weights
             (uint6b32, channelwise -> {"dtype": "int6", "group_size": 0}),
             copied verbatim into the kit as upstream_humming.py.
  GatedResidual  upstream ops/hc.py Triton glue (hc_combine_norm, hc_silu,
             hc_gate_mix) around two INT8 W8A16 GEMMs.
Series side: moe_route + the same two Marlin GEMMs + shared_gate_up_silu +
shared_down_final; hc_combine_norm + hc_int8_mix (2 INT8 GEMV kernels).

Stand-ins (labelled in the JSON; the ops live in `_C`, which does not fit in
the same device call as `_moe_C`):
  - HC INT8 GEMMs: upstream picks AllSpark on sm_86 (uint8b128, per channel,
    N,K % 16 == 0) and Machete (up, K=320 N=10240) / Marlin (down, N=336
    padded to 384) on sm_90; here the Marlin MoE kernel of `_moe_C`
    (moe_wna16_marlin_gemm, uint8b128, 1 expert, top-1) stands in for all of
    them: same Marlin code family as gptq_marlin_gemm, 1 byte per weight.
  - shared expert, kept as an extra row and block arm (and the upstream arm
    when Humming cannot load: --no-humming, or its import/JIT fails, recorded):
    bf16 cuBLAS on the same values (reads 2.67x the INT6 bytes). Either way
    silu*mul between the shared GEMMs is torch (_C.silu_and_mul lives in
    `_C`), and the gate sigmoid*shared and the final add are torch ops, as
    upstream's are separate launches.
  - silu_and_mul between the routed GEMMs (`_C`): torch, identical in both arms.
Marlin weights are random words in Marlin's layout (both arms call the same
GEMM on them; timing only); a layout-independent check (every weight word
the same value) verifies the Marlin call itself.

Per kernel: bytes read per call, achieved GB/s on this GPU, and a 3090
estimate = max(bytes / 936 GB/s, the latency measured here) (a kernel cannot
be faster on the 3090 than on the H200: fewer SMs, lower bandwidth).

  python3 bench_upstream_baselines.py --moe-c _moe_C_stable_libtorch.abi3.so.xz \\
      --skip hc --json $OUT/upstream_baselines_humming.json

--hc-c (kit: make_upstream_kit.py --so _C): the GatedResidual against the
real `_C` GEMMs instead of the stand-in: Machete `up` + Marlin `down` as
0.30.0 picks them on sm_90, weights repacked by upstream's own `_C` ops;
AllSpark (the sm_86 pick) is tried and its failure recorded. --dry-run checks
the packing and references on CPU at tiny shapes.

  python3 bench_upstream_baselines.py --hc-c --c-so _C_stable_libtorch.abi3.so.xz \\
      --json $OUT/upstream_baselines_hc.json
"""

from __future__ import annotations

import argparse
import json
import lzma
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

BW_3090 = 936e9
E, TOPK, H, I_SH, I_MOE = 512, 10, 2560, 640, 640
HC, RANK, INJ, PAD = 4, 320, 4, 12
K_HC = H * HC
N_DOWN = RANK + INJ + PAD  # 336, the merged down+inject layer
N_DOWN_MARLIN = 384        # Marlin pads N to a multiple of 64 (marlin_padded_nk)
U4B8_ID, U8B128_ID = 1125899907892224, 1125899923621888  # vllm.scalar_type ids (0.30.0)
MOE_GROUP = 128
ARGS = None


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe-c", help="vLLM's _moe_C_stable_libtorch.abi3.so (or .so.xz); default: "
                    "the installed vllm package's")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--layers", type=int, default=8, help="weight sets cycled per graph (> L2)")
    ap.add_argument("--routed-sets", type=int, default=2,
                    help="routed-expert weight sets (1.26 GB each) shared by the layers")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (median)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: moe,hc")
    ap.add_argument("--no-humming", action="store_true",
                    help="upstream's INT6 shared expert as the bf16 cuBLAS stand-in only (no Humming)")
    ap.add_argument("--json", help="write results here (rewritten after every part)")
    ap.add_argument("--hc-c", action="store_true",
                    help="GatedResidual against upstream's real `_C` INT8 GEMMs (Machete up + Marlin "
                    "down on sm_90, AllSpark tried too); needs --c-so (make_upstream_kit.py --so _C)")
    ap.add_argument("--c-so", help="vLLM's _C_stable_libtorch.abi3.so (or .so.xz); default: the "
                    "installed vllm package's")
    ap.add_argument("--dry-run", action="store_true",
                    help="--hc-c on CPU at tiny shapes: build and pack every weight, check the "
                    "packing round trip and the references, no `_C` ops, no GPU")
    ap.add_argument("--table", metavar="RESULTS_JSON",
                    help="print the README's kernel table from a results JSON and exit (no GPU)")
    return ap.parse_args()


# The write-up's 3090 figures (1 token), quoted beside each row of --table.
WRITEUP_3090 = {
    "router_cublas": "router GEMV 12",
    "topk_softmax": "7 (1 CTA)",
    "moe_align_block_size": "7 (2 kernels)",
    "marlin_moe_gemm1_int4": "experts 25 MB: 42 (both GEMMs)",
    "shared_bf16_cublas_standin": "gate_up+SiluAndMul 13.4, down+final 7.0",
    "shared_humming_int6": "gate_up+SiluAndMul 13.4, down+final 7.0",
    "shared_gate_up_silu": "7.8 (from 13.4)",
    "shared_down_final": "5.3 (from 7.0)",
    "block:hc:upstream": "32 (6 kernels)",
    "block:hc:fused": "13.3",
}
ROWS = [  # (part, kernel)
    ("MoE", "router_cublas"), ("MoE", "topk_softmax"), ("MoE", "moe_align_block_size"),
    ("MoE", "moe_sum"), ("MoE", "shared_humming_int6"), ("MoE", "humming_gate_up_int6"),
    ("MoE", "humming_down_int6"), ("MoE", "shared_bf16_cublas_standin"), ("MoE", "moe_route"),
    ("MoE", "shared_gate_up_silu"), ("MoE", "shared_down_final"), ("MoE", "marlin_moe_gemm1_int4"),
    ("MoE", "marlin_moe_gemm2_int4"), ("HC", "hc_combine_norm"), ("HC", "hc_silu"), ("HC", "hc_gate_mix"),
    ("HC", "marlin_w8a16_down_standin"), ("HC", "marlin_w8a16_up_standin"),
    ("HC", "hc_down_inject_silu"), ("HC", "hc_up_gate_mix"),
]


def table(path):
    r = json.loads(Path(path).read_text())
    if r.get("mode") == "hc_c":
        return table_hc_c(r)
    ks = r["kernels"]
    lo, hi = "1", max(ks["moe_route"], key=int)
    f = lambda v: f"{v:.1f}"  # noqa: E731
    out = [f"| kernel | what | bytes/call ({lo} tok) | {r['device']} us ({lo} / {hi} tok) | "
           f"GB/s ({lo} tok) | 3090 est. us ({lo} / {hi} tok) | write-up 3090 us |",
           "|---|---|---|---|---|---|---|"]
    for part, k in ROWS:
        if k not in ks:  # a part skipped (--skip hc) or no Humming in that run
            continue
        a, b = ks[k][lo], ks[k][hi]
        out.append(f"| {part} `{k}` | {a['what']} | {a['bytes']:,} | {f(a['h200_us'])} / {f(b['h200_us'])} | "
                   f"{a['h200_GBps']:.0f} | {f(a['est_3090_us'])} / {f(b['est_3090_us'])} | "
                   f"{WRITEUP_3090.get(k, '-')} |")
    for part, key, arms in (("moe", "MoE block", ("upstream", "fused")),
                            ("hc", "GatedResidual", ("upstream", "fused"))):
        for arm in arms:
            if not r[part]:
                continue
            a, b = r[part][lo], r[part][hi]
            if part == "moe":
                ea = f"{f(a['est_3090_us'][arm + '_periphery'])} / {f(b['est_3090_us'][arm + '_periphery'])} periphery"
            else:
                ea = f"{f(a['est_3090_us'][arm])} / {f(b['est_3090_us'][arm])}"
            out.append(f"| **{key}, {arm}** (one CUDA graph) | ratio upstream/fused "
                       f"{a['block_graph_us']['ratio_upstream_over_fused']:.2f} / "
                       f"{b['block_graph_us']['ratio_upstream_over_fused']:.2f} | - | "
                       f"{f(a['block_graph_us'][arm])} / {f(b['block_graph_us'][arm])} | - | {ea} | "
                       f"{WRITEUP_3090.get(f'block:{part}:{arm}', '-')} |")
    return "\n".join(out)


def table_hc_c(r):
    """README rows of a --hc-c results JSON."""
    ks = r["kernels"]
    lo, hi = "1", max(r["hc"], key=int)
    f = lambda v: f"{v:.1f}"  # noqa: E731
    out = []
    for k in HC_C_UP + HC_C_FUSED[1:]:
        a, b = ks[k][lo], ks[k][hi]
        out.append(f"| HC `{k}` | {a['what']} | {a['bytes']:,} | {f(a['h200_us'])} / {f(b['h200_us'])} | "
                   f"{a['h200_GBps']:.0f} | {f(a['est_3090_us'])} / {f(b['est_3090_us'])} | - |")
    for arm in ("upstream", "fused"):
        a, b = r["hc"][lo], r["hc"][hi]
        out.append(f"| **GatedResidual, {arm}** (one CUDA graph) | ratio upstream/fused "
                   f"{a['block_graph_us']['ratio_upstream_over_fused']:.2f} / "
                   f"{b['block_graph_us']['ratio_upstream_over_fused']:.2f} | - | "
                   f"{f(a['block_graph_us'][arm])} / {f(b['block_graph_us'][arm])} | - | "
                   f"{f(a['est_3090_us'][arm])} / {f(b['est_3090_us'][arm])}"
                   f"{' (of Machete + Marlin; a 3090 runs AllSpark)' if arm == 'upstream' else ''} | "
                   f"{WRITEUP_3090.get(f'block:hc:{arm}', '-')} |")
    return "\n".join(out)


def load_vllm_ext(path, lib, flag, kit_hint):
    """Load one of the pinned wheel's compiled extensions (``lib`` =
    "_moe_C" or "_C", stable libtorch ABI) from ``path`` (xz or .so) or from
    the installed vllm; returns its torch.ops namespace."""
    import torch

    if path is None:
        import importlib.util

        spec = importlib.util.find_spec("vllm")
        if spec is None:
            sys.exit(f"no {flag} and no vllm installed: pass {flag} PATH ({kit_hint} packs it)")
        path = str(Path(spec.origin).parent / f"{lib}_stable_libtorch.abi3.so")
    if path.endswith(".xz"):
        so = f"/tmp/{lib}_stable_libtorch.abi3.so"
        with lzma.open(path) as f, open(so, "wb") as g:
            shutil.copyfileobj(f, g)
        path = so
    torch.ops.load_library(path)
    return getattr(torch.ops, lib)


def load_series():
    """(moe_fused, hc_int8, upstream hc) from vllm, else from the kit's copies."""
    try:
        from vllm.models.qwen4_exp.nvidia.ops import hc_int8, moe_fused
        from vllm.models.qwen4_exp.nvidia.ops import hc as up_hc
        return moe_fused, hc_int8, up_hc
    except ImportError:
        import hc_int8
        import moe_fused
        from bench_hc_fused import load_upstream_hc  # stubs vllm; PDL stays off
        return moe_fused, hc_int8, load_upstream_hc(str(Path(__file__).with_name("upstream_hc.py")))


def main():
    global ARGS
    ARGS = a = parse()
    if a.table:
        print(table(a.table))
        return
    if a.hc_c:
        return hc_c_main(a)
    import torch
    import torch.nn.functional as F
    from cuda_graph_timing import graph_us

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (run it on the GPU machine with the kit of make_upstream_kit.py)")
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    ops = load_vllm_ext(a.moe_c, "_moe_C", "--moe-c", "make_upstream_kit.py")
    mf, hk, U = load_series()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ws = torch.zeros(sms * 4, dtype=torch.int32, device=dev)  # marlin_make_workspace_new(dev, 4)
    res = dict(command="python3 scripts/bench/bench_upstream_baselines.py " + " ".join(sys.argv[1:]),
               device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
               torch=torch.__version__, python=platform.python_version(), pdl="off (both arms)",
               layers=a.layers, replays=a.replays, rounds=a.rounds, bw_3090=BW_3090,
               upstream_binary="vLLM 0.30.0 wheel _moe_C_stable_libtorch.abi3.so (commit gced6857af)",
               note=__doc__.split("\n\n")[1:4], moe={}, hc={}, kernels={}, errors=[])

    def save(done=False):
        res.update(complete=done, wall_s=round(time.time() - t0, 1))
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1) + "\n")

    def rnd_words(*shape):
        return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device=dev, generator=g)

    def marlin(x, out, w, s, sorted_ids, eids, ntpp, tw, bs, top_k, mul, type_id, m, n, k):
        return ops.moe_wna16_marlin_gemm(x, out, w, None, s, None, None, None, ws, sorted_ids, eids,
                                         ntpp, tw, bs, top_k, mul, type_id, m, n, k,
                                         False, True, False, -1, -1, -1)

    def timed(fns, step_inputs, calls):
        """median us per call over alternating rounds; fns: name -> step()."""
        samp = {k: [] for k in fns}
        for _ in range(a.rounds):
            for k, fn in fns.items():
                samp[k].append(graph_us(fn, calls, a.replays))
        return {k: statistics.median(v) for k, v in samp.items()}

    def kernel_row(name, us, nbytes, m, what):
        est = max(nbytes / BW_3090 * 1e6, us)
        res["kernels"].setdefault(name, {})[str(m)] = dict(
            h200_us=us, bytes=int(nbytes), h200_GBps=nbytes / us / 1e3, est_3090_us=est,
            bound_3090="bytes" if nbytes / BW_3090 * 1e6 >= us else "latency", what=what)
        return est

    tokens = [int(t) for t in a.tokens.split(",") if t]
    skip = set(a.skip.split(","))

    # ------------------------------------------------------------------ Marlin check
    def marlin_check(type_id, word, val, m, n, k, group):
        x = torch.randn(m, k, device=dev).bfloat16()
        pack = 8 if type_id == U4B8_ID else 4
        w = torch.full((1, k // 16, n * 16 // pack), word, dtype=torch.int32, device=dev)
        s = torch.full((1, k // group if group else 1, n), 0.01, device=dev).bfloat16()
        bs = 8
        sid = torch.full((bs,), m, dtype=torch.int32, device=dev)
        sid[:m] = torch.arange(m, device=dev, dtype=torch.int32)
        eid = torch.zeros(1, dtype=torch.int32, device=dev)
        ntpp = torch.full((1,), bs, dtype=torch.int32, device=dev)
        tw = torch.ones(m, 1, device=dev)
        out = marlin(x, None, w, s, sid, eid, ntpp, tw, bs, 1, False, type_id, m, n, k)
        ref = x.float().sum(-1, keepdim=True) * val * 0.01
        return float(((out.float() - ref).abs().max() / ref.abs().max()))

    try:
        res["marlin_const_weight_check_rel_err"] = {
            "uint4b8_g128": marlin_check(U4B8_ID, -1717986919, 1.0, 4, 2 * I_MOE, H, MOE_GROUP),  # 0x99999999: 9-8=1
            "uint8b128_channel": marlin_check(U8B128_ID, -2122219135, 1.0, 4, N_DOWN_MARLIN, K_HC, 0)}  # 0x81818181
    except Exception as e:  # noqa: BLE001
        res["errors"].append(f"marlin check: {e!r}"[:2000])
    print("marlin check", res.get("marlin_const_weight_check_rel_err"), flush=True)
    save()

    def humming_linear(u, s, out_sizes):
        """One INT6 shared-expert linear as 0.30.0 builds it: the checkpoint's
        CompressedTensorsWNA16 params (weight_packed int32 [N, K*6/32] in the
        dense humming layout of u = q + 32, weight_scale bf16 [N, 1],
        weight_shape), then vLLM's HummingLinearKernel (uint6b32, channelwise,
        symmetric) repacks them and apply_weights runs humming_forward."""
        from types import SimpleNamespace

        import upstream_humming as UH

        n, k = u.shape
        layer = torch.nn.Module()
        layer.register_parameter("weight_packed", torch.nn.Parameter(mf.int6_pack_dense(u),
                                                                     requires_grad=False))
        layer.register_parameter("weight_scale", torch.nn.Parameter(s.clone(), requires_grad=False))
        layer.register_parameter("weight_shape", torch.nn.Parameter(
            torch.tensor([n, k], dtype=torch.int64), requires_grad=False))
        layer.input_size_per_partition, layer.output_partition_sizes = k, out_sizes
        layer.params_dtype, layer.has_bias = torch.bfloat16, False
        cfg = SimpleNamespace(weight_type=SimpleNamespace(size_bits=6), group_size=-1, zero_points=False)
        kern = UH.HummingLinearKernel(cfg, "weight_packed", "weight_scale", "weight_zero_point")
        kern.process_weights_after_loading(layer)
        return lambda x: kern.apply_weights(layer, x)

    # ------------------------------------------------------------------ MoE block
    if "moe" not in skip:
        routed_sets = [dict(w13=rnd_words(E, H // 16, 2 * I_MOE * 2), w2=rnd_words(E, I_MOE // 16, H * 2),
                            s13=(torch.rand(E, H // MOE_GROUP, 2 * I_MOE, device=dev, generator=g) * 2e-3).bfloat16(),
                            s2=(torch.rand(E, I_MOE // MOE_GROUP, H, device=dev, generator=g) * 2e-3).bfloat16())
                       for _ in range(a.routed_sets)]
        layers = []
        for li in range(a.layers):
            u_gu = torch.randint(0, 64, (2 * I_SH, H), device=dev, generator=g, dtype=torch.int32)
            u_dn = torch.randint(0, 64, (H, I_SH), device=dev, generator=g, dtype=torch.int32)
            s_gu = (torch.rand(2 * I_SH, 1, device=dev, generator=g) * 2e-3 + 5e-4).bfloat16()
            s_dn = (torch.rand(H, 1, device=dev, generator=g) * 2e-3 + 5e-4).bfloat16()
            deq = lambda u, s: ((u.float() - 32) * s.float()).bfloat16()  # noqa: E731
            layers.append(dict(
                u_gu=u_gu, u_dn=u_dn,
                gw=(torch.randn(E, H, device=dev, generator=g) * 0.02).bfloat16(),
                sgw=(torch.randn(1, H, device=dev, generator=g) * 0.02).bfloat16(),
                p_gu=mf.int6_to_planes(mf.int6_pack_dense(u_gu), H), s_gu=s_gu,
                p_dn=mf.int6_to_planes(mf.int6_pack_dense(u_dn), I_SH), s_dn=s_dn,
                w_gu=deq(u_gu, s_gu), w_dn=deq(u_dn, s_dn),
                counter=torch.zeros(1, dtype=torch.int32, device=dev),
                R=routed_sets[li % a.routed_sets]))
        humming_error = None
        if not a.no_humming:
            try:
                for L in layers:
                    L["h_gu"] = humming_linear(L["u_gu"], L["s_gu"], [I_SH, I_SH])
                    L["h_dn"] = humming_linear(L["u_dn"], L["s_dn"], [H])
            except Exception as e:  # noqa: BLE001
                import traceback
                humming_error = f"humming: {traceback.format_exc()[-3000:]}"
                res["errors"].append(humming_error)
                print(humming_error, flush=True)
        HUMMING = not a.no_humming and humming_error is None
        res["upstream_shared_expert"] = ("humming INT6 (vLLM 0.30.0 HummingLinearKernel)" if HUMMING
                                         else "STAND-IN bf16 cuBLAS")
        if HUMMING:
            import humming
            res["humming_version"] = getattr(humming, "__version__", "?")

        def routed_experts(x, R, tw, sid, eid, ntpp, bs):
            m = x.shape[0]
            c1 = marlin(x, None, R["w13"], R["s13"], sid, eid, ntpp, tw, bs, TOPK, False, U4B8_ID,
                        m, 2 * I_MOE, H)
            act = F.silu(c1[:, :I_MOE]) * c1[:, I_MOE:]  # stand-in for _C.silu_and_mul
            c2 = marlin(act, None, R["w2"], R["s2"], sid, eid, ntpp, tw, bs, 1, True, U4B8_ID,
                        m * TOPK, H, I_MOE)
            return c2.view(m, TOPK, H)

        def up_route(x, L):
            m = x.shape[0]
            logits = F.linear(x, L["gw"])
            tw = torch.empty(m, TOPK, dtype=torch.float32, device=dev)
            ti = torch.empty(m, TOPK, dtype=torch.int32, device=dev)
            tei = torch.empty(m, TOPK, dtype=torch.int32, device=dev)
            ops.topk_softmax(tw, ti, tei, logits if LOGITS_BF16 else logits.float(), True, None, None)
            bs = mf.marlin_block_size_m(m, TOPK, E)
            ns, nb = mf.align_sizes(m, TOPK, E, bs)
            sid = torch.empty(ns, dtype=torch.int32, device=dev)
            eid = torch.empty(nb, dtype=torch.int32, device=dev)
            ntpp = torch.empty(1, dtype=torch.int32, device=dev)
            ops.moe_align_block_size(ti, E, bs, sid, eid, ntpp, None)
            return tw, ti, sid, eid, ntpp, bs

        # upstream hands the bf16 router logits to topk_softmax; fall back to fp32 if this build
        # lacks the bf16 instantiation (recorded)
        LOGITS_BF16 = True
        try:
            lg = torch.randn(1, E, device=dev).bfloat16()
            tmp = torch.empty(1, TOPK, dtype=torch.int32, device=dev)
            ops.topk_softmax(torch.empty(1, TOPK, device=dev), tmp, torch.empty_like(tmp), lg, True, None, None)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            LOGITS_BF16 = False
            res["errors"].append(f"topk_softmax bf16 logits: {e!r}"[:500] + " -> fp32 logits")
        res["topk_softmax_logits"] = "bf16" if LOGITS_BF16 else "fp32"

        def shared_standin(x, L):
            gu = F.linear(x, L["w_gu"])
            return F.linear(F.silu(gu[:, :I_SH]) * gu[:, I_SH:], L["w_dn"])

        def shared_humming(x, L):
            gu = L["h_gu"](x)
            return L["h_dn"](F.silu(gu[:, :I_SH]) * gu[:, I_SH:])

        def up_block(x, L, shared=None):
            shared = shared or (shared_humming if HUMMING else shared_standin)
            tw, ti, sid, eid, ntpp, bs = up_route(x, L)
            r = routed_experts(x, L["R"], tw, sid, eid, ntpp, bs)
            out = torch.empty(x.shape[0], H, dtype=x.dtype, device=dev)
            ops.moe_sum(r, out, None, None)
            d = shared(x, L)
            return torch.sigmoid(F.linear(x, L["sgw"])) * d + out, tw, ti

        def up_block_standin(x, L):
            return up_block(x, L, shared_standin)

        def fused_block(x, L):
            tw, ti, sid, eid, ntpp, lg, bs = mf.moe_route(x, L["gw"], L["sgw"], TOPK, L["counter"])
            r = routed_experts(x, L["R"], tw, sid, eid, ntpp, bs)
            act = mf.shared_gate_up_silu(x, L["p_gu"], L["s_gu"], H)
            return mf.shared_down_final(act, L["p_dn"], L["s_dn"], r, lg[:, E]), tw, ti

        for m in tokens:
            try:
                x = torch.randn(m, H, device=dev, generator=g).bfloat16()
                L0 = layers[0]
                o_u, w_u, i_u = up_block(x, L0)
                o_f, w_f, i_f = fused_block(x, L0)
                ids_eq = bool((i_u.sort(-1)[0] == i_f.sort(-1)[0]).all())
                chk = dict(topk_ids_equal=ids_eq,
                           topk_w_max_abs_diff=float((w_u.sort(-1)[0] - w_f.sort(-1)[0]).abs().max()),
                           out_max_rel_diff=float((o_f.float() - o_u.float()).abs().max()
                                                  / o_u.float().abs().max()))
                if HUMMING:
                    # Humming vs the bf16 dequant of the same INT6 values (fp32 reference)
                    ref_gu = x.float() @ L0["w_gu"].float().t()
                    h_gu = L0["h_gu"](x).float()
                    act_r = (F.silu(ref_gu[:, :I_SH]) * ref_gu[:, I_SH:]).bfloat16()
                    ref_dn = act_r.float() @ L0["w_dn"].float().t()
                    h_dn = L0["h_dn"](act_r).float()
                    rel = lambda o, r_: float((o - r_).abs().max() / r_.abs().max())  # noqa: E731
                    chk.update(humming_gate_up_max_rel_diff=rel(h_gu, ref_gu),
                               humming_down_max_rel_diff=rel(h_dn, ref_dn))
                    o_s = up_block_standin(x, L0)[0]
                    chk["upstream_humming_vs_standin_out_max_rel_diff"] = float(
                        (o_u.float() - o_s.float()).abs().max() / o_s.float().abs().max())
                n_exp = int(torch.unique(i_u).numel())
                run = lambda fn: (lambda: [fn(x, L) for L in layers])  # noqa: E731
                arms = {"upstream": run(up_block), "fused": run(fused_block)}
                if HUMMING:
                    arms["upstream_bf16_standin"] = run(up_block_standin)
                t = timed(arms, None, len(layers))
                t["ratio_upstream_over_fused"] = t["upstream"] / t["fused"]
                if HUMMING:
                    t["ratio_upstream_bf16_standin_over_fused"] = t["upstream_bf16_standin"] / t["fused"]
                # per-kernel graphs (each over all layers)
                tw, ti, sid, eid, ntpp, bs = up_route(x, L0)
                logits = F.linear(x, L0["gw"])
                lgk = logits if LOGITS_BF16 else logits.float()
                ns, nb = mf.align_sizes(m, TOPK, E, bs)
                bufs = dict(tw=torch.empty(m, TOPK, device=dev), ti=torch.empty_like(ti),
                            tei=torch.empty_like(ti), sid=torch.empty(ns, dtype=torch.int32, device=dev),
                            eid=torch.empty(nb, dtype=torch.int32, device=dev),
                            ntpp=torch.empty(1, dtype=torch.int32, device=dev))
                r0 = routed_experts(x, L0["R"], tw, sid, eid, ntpp, bs)
                act0 = mf.shared_gate_up_silu(x, L0["p_gu"], L0["s_gu"], H)
                c1 = marlin(x, None, L0["R"]["w13"], L0["R"]["s13"], sid, eid, ntpp, tw, bs, TOPK, False,
                            U4B8_ID, m, 2 * I_MOE, H)
                a1 = (F.silu(c1[:, :I_MOE]) * c1[:, I_MOE:]).contiguous()
                sg = torch.zeros(m, device=dev)
                outb = torch.empty(m, H, dtype=x.dtype, device=dev)
                K = {
                    "router_cublas": lambda: [F.linear(x, L["gw"]) for L in layers],
                    "topk_softmax": lambda: [ops.topk_softmax(bufs["tw"], bufs["ti"], bufs["tei"], lgk,
                                                              True, None, None) for _ in layers],
                    "moe_align_block_size": lambda: [ops.moe_align_block_size(
                        ti, E, bs, bufs["sid"], bufs["eid"], bufs["ntpp"], None) for _ in layers],
                    "marlin_moe_gemm1_int4": lambda: [marlin(
                        x, None, L["R"]["w13"], L["R"]["s13"], sid, eid, ntpp, tw, bs, TOPK, False,
                        U4B8_ID, m, 2 * I_MOE, H) for L in layers],
                    "marlin_moe_gemm2_int4": lambda: [marlin(
                        a1, None, L["R"]["w2"], L["R"]["s2"], sid, eid, ntpp, tw, bs, 1, True,
                        U4B8_ID, m * TOPK, H, I_MOE) for L in layers],
                    "moe_sum": lambda: [ops.moe_sum(r0, outb, None, None) for _ in layers],
                    "shared_bf16_cublas_standin": lambda: [shared_standin(x, L) for L in layers],
                    "moe_route": lambda: [mf.moe_route(x, L["gw"], L["sgw"], TOPK, L["counter"]) for L in layers],
                    "shared_gate_up_silu": lambda: [mf.shared_gate_up_silu(x, L["p_gu"], L["s_gu"], H)
                                                    for L in layers],
                    "shared_down_final": lambda: [mf.shared_down_final(act0, L["p_dn"], L["s_dn"], r0, sg)
                                                  for L in layers],
                }
                if HUMMING:
                    a_sh = (F.silu(h_gu[:, :I_SH]) * h_gu[:, I_SH:]).bfloat16()
                    K["shared_humming_int6"] = lambda: [shared_humming(x, L) for L in layers]
                    K["humming_gate_up_int6"] = lambda: [L["h_gu"](x) for L in layers]
                    K["humming_down_int6"] = lambda: [L["h_dn"](a_sh) for L in layers]
                kt = {k: graph_us(fn, len(layers), a.replays) for k, fn in K.items()}
                nsorted_read = ns * 4
                ex13 = n_exp * (H * 2 * I_MOE // 2 + (H // MOE_GROUP) * 2 * I_MOE * 2)
                ex2 = n_exp * (I_MOE * H // 2 + (I_MOE // MOE_GROUP) * H * 2)
                nb_ = {
                    "router_cublas": E * H * 2 + m * H * 2 + m * E * 2,
                    "topk_softmax": m * E * (2 if LOGITS_BF16 else 4) + m * TOPK * 12,
                    "moe_align_block_size": m * TOPK * 4 + nsorted_read + nb * 4 + 4,
                    "marlin_moe_gemm1_int4": ex13 + m * H * 2 + m * TOPK * 2 * I_MOE * 2,
                    "marlin_moe_gemm2_int4": ex2 + m * TOPK * I_MOE * 2 + m * TOPK * H * 2,
                    "moe_sum": m * TOPK * H * 2 + m * H * 2,
                    "shared_bf16_cublas_standin": 3 * I_SH * H * 2 + m * H * 4 + m * I_SH * 6,
                    # INT6 weights + bf16 per-channel scales + the same activations
                    "shared_humming_int6": 3 * I_SH * H * 6 // 8 + (2 * I_SH + H) * 2 + m * H * 4 + m * I_SH * 6,
                    "humming_gate_up_int6": 2 * I_SH * H * 6 // 8 + 2 * I_SH * 2 + m * H * 2 + m * 2 * I_SH * 2,
                    "humming_down_int6": H * I_SH * 6 // 8 + H * 2 + m * I_SH * 2 + m * H * 2,
                    "moe_route": (E + 1) * H * 2 + m * H * 2 + m * (E + 1) * 4 + nsorted_read,
                    "shared_gate_up_silu": 2 * I_SH * H * 6 // 8 + 2 * I_SH * 2 + m * H * 2 + m * I_SH * 2,
                    "shared_down_final": H * I_SH * 6 // 8 + H * 2 + m * I_SH * 2 + m * TOPK * H * 2 + m * H * 2,
                }
                what = {"router_cublas": "upstream (cuBLAS, same in 0.30.0)",
                        "topk_softmax": "upstream _moe_C", "moe_align_block_size": "upstream _moe_C",
                        "marlin_moe_gemm1_int4": "upstream _moe_C (both arms)",
                        "marlin_moe_gemm2_int4": "upstream _moe_C (both arms)", "moe_sum": "upstream _moe_C",
                        "shared_bf16_cublas_standin": "STAND-IN for Humming INT6 gate_up+silu+down"
                        + (" (extra row: the block's upstream arm runs Humming)" if HUMMING else ""),
                        "shared_humming_int6": "upstream Humming INT6 gate_up + torch silu*mul + down "
                        "(0.30.0 HummingLinearKernel)",
                        "humming_gate_up_int6": "upstream Humming INT6 gate_up GEMM alone (N 1280, K 2560)",
                        "humming_down_int6": "upstream Humming INT6 down GEMM alone (N 2560, K 640)",
                        "moe_route": "series 0500", "shared_gate_up_silu": "series 0500",
                        "shared_down_final": "series 0500"}
                est = {k: kernel_row(k, kt[k], nb_[k], m, what[k]) for k in K}
                periph_up = ["router_cublas", "topk_softmax", "moe_align_block_size", "moe_sum",
                             "shared_humming_int6" if HUMMING else "shared_bf16_cublas_standin"]
                periph_f = ["moe_route", "shared_gate_up_silu", "shared_down_final"]
                experts = ["marlin_moe_gemm1_int4", "marlin_moe_gemm2_int4"]
                res["moe"][str(m)] = dict(
                    block_graph_us=t, check=chk, distinct_experts=n_exp, block_size_m=bs,
                    est_3090_us=dict(upstream_periphery=sum(est[k] for k in periph_up),
                                     fused_periphery=sum(est[k] for k in periph_f),
                                     routed_experts=sum(est[k] for k in experts)),
                    h200_kernel_sum_us=dict(upstream_periphery=sum(kt[k] for k in periph_up),
                                            fused_periphery=sum(kt[k] for k in periph_f),
                                            routed_experts=sum(kt[k] for k in experts)))
                print(f"MoE M={m}: {json.dumps(res['moe'][str(m)])}", flush=True)
            except Exception as e:  # noqa: BLE001
                import traceback
                res["errors"].append(f"moe M={m}: {traceback.format_exc()[-3000:]}")
                print(res["errors"][-1], flush=True)
            save()
        del layers, routed_sets
        torch.cuda.empty_cache()

    # ------------------------------------------------------------------ GatedResidual
    if "hc" not in skip:
        eps = 1e-6
        sets = []
        for _ in range(a.layers * 2):
            wd = torch.randint(0, 256, (N_DOWN, K_HC), dtype=torch.uint8, device=dev, generator=g)
            wd[RANK + INJ:] = 128
            sd = (torch.rand(N_DOWN, 1, device=dev, generator=g) * 0.004 + 0.001).bfloat16()
            sd[RANK + INJ:] = 0
            wu = torch.randint(0, 256, (K_HC, RANK), dtype=torch.uint8, device=dev, generator=g)
            su = (torch.rand(K_HC, 1, device=dev, generator=g) * 0.02 + 0.005).bfloat16()
            sets.append(dict(
                wd=hk.as_uint8(wd.view(torch.int32)), sd=sd, wu=hk.as_uint8(wu.view(torch.int32)), su=su,
                norm=(torch.randn(K_HC, device=dev, generator=g) * 0.1).bfloat16(),
                # Marlin layout (random words: timing only), per-channel scales
                mwd=rnd_words(1, K_HC // 16, N_DOWN_MARLIN * 4),
                msd=(torch.rand(1, 1, N_DOWN_MARLIN, device=dev, generator=g) * 0.004).bfloat16(),
                mwu=rnd_words(1, RANK // 16, K_HC * 4),
                msu=(torch.rand(1, 1, K_HC, device=dev, generator=g) * 0.02).bfloat16()))

        for m in tokens:
            try:
                bs = 8 if m <= 8 else 16
                sid = torch.full((bs,), m, dtype=torch.int32, device=dev)
                sid[:m] = torch.arange(m, device=dev, dtype=torch.int32)
                eid = torch.zeros(1, dtype=torch.int32, device=dev)
                ntpp = torch.full((1,), bs, dtype=torch.int32, device=dev)
                tw1 = torch.ones(m, 1, device=dev)
                xs = [dict(h=torch.randn(m, K_HC, device=dev, generator=g).bfloat16(),
                           blk=torch.randn(m, H, device=dev, generator=g).bfloat16(),
                           inj=torch.randn(m, HC, device=dev, generator=g).bfloat16()) for _ in sets]

                def up_gr(w, x):
                    h, xn = U._hc_combine_norm(x["h"], x["blk"], x["inj"], w["norm"], eps, HC)
                    d = marlin(xn, None, w["mwd"], w["msd"], sid, eid, ntpp, tw1, bs, 1, False, U8B128_ID,
                               m, N_DOWN_MARLIN, K_HC)
                    lora = U._hc_silu(d[:, :RANK], HC)
                    gate = marlin(lora, None, w["mwu"], w["msu"], sid, eid, ntpp, tw1, bs, 1, False,
                                  U8B128_ID, m, K_HC, RANK)
                    return U._hc_gate_mix(xn, gate, HC), d[:, RANK:RANK + INJ]

                def fused_gr(w, x):
                    h, xn = U._hc_combine_norm(x["h"], x["blk"], x["inj"], w["norm"], eps, HC)
                    return hk.hc_int8_mix(xn, w["wd"], w["sd"], w["wu"], w["su"], RANK, INJ, HC, False)

                run = lambda fn: (lambda: [fn(w, x) for w, x in zip(sets, xs)])  # noqa: E731
                t = timed({"upstream": run(up_gr), "fused": run(fused_gr)}, None, len(sets))
                t["ratio_upstream_over_fused"] = t["upstream"] / t["fused"]
                xn = [U._hc_combine_norm(x["h"], x["blk"], x["inj"], w["norm"], eps, HC)[1]
                      for w, x in zip(sets, xs)]
                lora = [torch.randn(m, RANK, device=dev, generator=g).bfloat16() for _ in sets]
                Z = list(zip(sets, xs, xn, lora))
                dcfg, ucfg = hk.down_gemv_config(m), hk.up_gemv_config(m)
                K = {
                    "hc_combine_norm": lambda: [U._hc_combine_norm(x["h"], x["blk"], x["inj"], w["norm"], eps, HC)
                                                for w, x, _, _ in Z],
                    "hc_silu": lambda: [U._hc_silu(lo, HC) for _, _, _, lo in Z],
                    "hc_gate_mix": lambda: [U._hc_gate_mix(n, n[:, :K_HC], HC) for _, _, n, _ in Z],
                    "marlin_w8a16_down_standin": lambda: [marlin(
                        n, None, w["mwd"], w["msd"], sid, eid, ntpp, tw1, bs, 1, False, U8B128_ID, m,
                        N_DOWN_MARLIN, K_HC) for w, _, n, _ in Z],
                    "marlin_w8a16_up_standin": lambda: [marlin(
                        lo, None, w["mwu"], w["msu"], sid, eid, ntpp, tw1, bs, 1, False, U8B128_ID, m,
                        K_HC, RANK) for w, _, _, lo in Z],
                    "hc_down_inject_silu": lambda: [hk.hc_down_inject_silu(
                        n, w["wd"], w["sd"], RANK, RANK + INJ, HC, False, dcfg) for w, _, n, _ in Z],
                    "hc_up_gate_mix": lambda: [hk.hc_up_gate_mix(lo, w["wu"], w["su"], n, HC, False, ucfg)
                                               for w, _, n, lo in Z],
                }
                kt = {k: graph_us(fn, len(sets), a.replays) for k, fn in K.items()}
                nb_ = {
                    "hc_combine_norm": m * K_HC * 2 + m * H * 2 + m * HC * 2 + K_HC * 2 + 2 * m * K_HC * 2,
                    "hc_silu": 2 * m * RANK * 2,
                    "hc_gate_mix": 2 * m * K_HC * 2 + m * H * 2,
                    "marlin_w8a16_down_standin": N_DOWN_MARLIN * K_HC + N_DOWN_MARLIN * 2 + m * K_HC * 2
                    + m * N_DOWN_MARLIN * 2,
                    "marlin_w8a16_up_standin": K_HC * RANK + K_HC * 2 + m * RANK * 2 + m * K_HC * 2,
                    "hc_down_inject_silu": (RANK + INJ) * K_HC + m * K_HC * 2 + m * (RANK + INJ) * 2,
                    "hc_up_gate_mix": K_HC * RANK + m * RANK * 2 + m * K_HC * 2 + m * H * 2,
                }
                what = {"hc_combine_norm": "upstream ops/hc.py Triton (both arms)",
                        "hc_silu": "upstream ops/hc.py Triton", "hc_gate_mix": "upstream ops/hc.py Triton",
                        "marlin_w8a16_down_standin": "STAND-IN: _moe_C Marlin uint8b128 E=1 for "
                                                     "AllSpark (sm_86) / Marlin (sm_90)",
                        "marlin_w8a16_up_standin": "STAND-IN: _moe_C Marlin uint8b128 E=1 for "
                                                   "AllSpark (sm_86) / Machete (sm_90)",
                        "hc_down_inject_silu": "series 0400", "hc_up_gate_mix": "series 0400"}
                est = {k: kernel_row(k, kt[k], nb_[k], m, what[k]) for k in K}
                up_k = ["hc_combine_norm", "marlin_w8a16_down_standin", "hc_silu", "marlin_w8a16_up_standin",
                        "hc_gate_mix"]
                f_k = ["hc_combine_norm", "hc_down_inject_silu", "hc_up_gate_mix"]
                res["hc"][str(m)] = dict(
                    block_graph_us=t, marlin_block_size=bs,
                    est_3090_us=dict(upstream=sum(est[k] for k in up_k), fused=sum(est[k] for k in f_k)),
                    h200_kernel_sum_us=dict(upstream=sum(kt[k] for k in up_k), fused=sum(kt[k] for k in f_k)))
                print(f"HC M={m}: {json.dumps(res['hc'][str(m)])}", flush=True)
            except Exception:  # noqa: BLE001
                import traceback
                res["errors"].append(f"hc M={m}: {traceback.format_exc()[-3000:]}")
                print(res["errors"][-1], flush=True)
            save()
    save(done=True)
    print("done", round(time.time() - t0, 1), "s", "errors:", len(res["errors"]), flush=True)


# ====================================================================== --hc-c
# GatedResidual against upstream's real `_C` INT8 W8A16 GEMMs. vLLM 0.30.0
# picks the HC layers' kernel from _POSSIBLE_KERNELS[CUDA] in
# model_executor/kernels/linear/__init__.py (CutlassW4A8, Machete, AllSpark,
# Marlin, ...), the first whose can_implement passes:
#   sm_90  up   (K=320,  N=10240): Machete (K % 64, N % 128, uint8b128, per channel)
#          down (K=10240, N=336):  Machete no (336 % 128), AllSpark no (sm 80-89
#                                  only), Marlin: N padded to 384, output sliced
#                                  back to 336 (marlin_unpad_output, one copy)
#   sm_86  both: AllSpark (uint8b128, per channel, N, K % 16 == 0)
# Weights are repacked at load by each kernel's process_weights_after_loading;
# here with the same `_C` ops: machete_prepack_B, gptq_marlin_repack (+
# marlin_permute_scales, torch), rearrange_kn_weight_as_n32k16_order (AllSpark).

HC_C_WHAT = {
    "hc_combine_norm": "upstream ops/hc.py Triton (both arms)",
    "marlin_gemm_down": "upstream _C marlin_gemm uint8b128 (sm_90 pick for down, N 336 -> 384)",
    "marlin_unpad_copy": "upstream marlin_unpad_output (torch slice copy 384 -> 336)",
    "hc_silu": "upstream ops/hc.py Triton",
    "machete_mm_up": "upstream _C machete_mm uint8b128 (sm_90 pick for up)",
    "hc_gate_mix": "upstream ops/hc.py Triton",
    "allspark_down": "upstream _C allspark_w8a16_gemm (sm_86 pick)",
    "allspark_up": "upstream _C allspark_w8a16_gemm (sm_86 pick)",
    "hc_down_inject_silu": "series 0400",
    "hc_up_gate_mix": "series 0400",
}
HC_C_UP = ["hc_combine_norm", "marlin_gemm_down", "marlin_unpad_copy", "hc_silu", "machete_mm_up", "hc_gate_mix"]
HC_C_FUSED = ["hc_combine_norm", "hc_down_inject_silu", "hc_up_gate_mix"]


def round_up(x, m):
    return -(-x // m) * m


def marlin_padded_nk(n, k):
    """vllm marlin_utils.marlin_padded_nk for group_size -1."""
    c = ((round_up(n, 64), round_up(k, 128)), (round_up(n, 128), round_up(k, 64)))
    return min(c, key=lambda nk: (nk[0] * nk[1], nk[0] + nk[1]))


def marlin_permute_scales_channel(s):
    """vllm marlin_utils.marlin_permute_scales, group_size -1 ([1, N])."""
    perm = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    n = s.shape[-1]
    return s.reshape(-1, len(perm))[:, perm].reshape(-1, n).contiguous()


def gptq_pack(u8):
    """[N, K] uint8 (q + 128) -> the checkpoint's GPTQ layout after
    permute_param_layout_(input_dim=0, output_dim=1, packed_dim=0): [K/4, N]
    int32, 4 consecutive k per word, low byte first (the same bytes the series
    reads as [N, K] uint8, transposed)."""
    import torch

    return u8.contiguous().view(torch.int32).t()


def gptq_unpack(w):
    """inverse of gptq_pack: [K/4, N] int32 -> [N, K] uint8."""
    import torch

    kq, n = w.shape
    sh = torch.arange(4, dtype=torch.int32, device=w.device) * 8
    v = (w.t().contiguous()[:, :, None] >> sh) & 0xFF
    return v.reshape(n, kq * 4).to(torch.uint8)


def hc_c_pack_torch(u8, s):
    """The torch half of each upstream kernel's process_weights_after_loading
    for a [N, K] uint8 (q + 128) weight with [N, 1] bf16 per-channel scales:
    the `_C` repack calls take these as inputs."""
    import torch.nn.functional as F

    n, k = u8.shape
    q = gptq_pack(u8)                                      # [K/4, N] int32, column-major
    pn, pk = marlin_padded_nk(n, k)
    assert pk == k, "HC K is a multiple of 128"
    return dict(
        gptq=q, n=n, k=k,
        machete_in=q.t().contiguous().t(),                 # as MacheteLinearKernel hands it over
        machete_s=s.reshape(1, n).contiguous(),            # [groups=1, N]
        marlin_in=F.pad(q.contiguous(), (0, pn - n)),      # marlin_pad_qweight: [K/4, pn]
        marlin_n=pn,
        marlin_s=marlin_permute_scales_channel(F.pad(s.reshape(1, n), (0, pn - n))),
        allspark_in=u8.t().contiguous(),                   # [K, N] uint8 (AllSpark's unpack)
        allspark_s=s.reshape(1, n).contiguous())


def hc_c_ref(xn, u8, s):
    """fp32 x @ (scale * (u - 128))^T."""
    return xn.float() @ ((u8.float() - 128.0) * s.float()).t()


def hc_c_dry_run(a):
    """CPU, tiny shapes: the weights, packings and references of --hc-c."""
    import torch

    g = torch.Generator().manual_seed(0)
    hc, rank, inj, pad, d = 4, 64, 4, 12, 64
    k_hc, n_down = hc * d, rank + inj + pad
    out = {}
    for name, (n, k) in {"down": (n_down, k_hc), "up": (k_hc, rank)}.items():
        u8 = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
        s = (torch.rand(n, 1, generator=g) * 0.01).bfloat16()
        p = hc_c_pack_torch(u8, s)
        assert p["gptq"].shape == (k // 4, n) and p["gptq"].dtype == torch.int32
        assert torch.equal(gptq_unpack(p["gptq"]), u8), "GPTQ pack round trip"
        assert p["machete_in"].stride() == (1, k // 4)
        assert p["marlin_in"].shape == (k // 4, p["marlin_n"]) and p["marlin_n"] % 64 == 0
        assert torch.equal(gptq_unpack(p["marlin_in"])[:n], u8)
        assert not gptq_unpack(p["marlin_in"])[n:].any()  # padded rows: q 0 with scale 0
        assert torch.equal(p["marlin_s"].sort(-1)[0], torch.cat(
            [s.reshape(1, n), s.new_zeros(1, p["marlin_n"] - n)], 1).sort(-1)[0])
        x = torch.randn(3, k, generator=g).bfloat16()
        r = hc_c_ref(x, u8, s)
        # the per-channel dequant equals the GPTQ words decoded explicitly
        r2 = x.float() @ ((gptq_unpack(p["gptq"]).float() - 128) * s.float()).t()
        assert torch.equal(r, r2)
        out[name] = dict(n=n, k=k, marlin_n=p["marlin_n"],
                         machete_ok=k % 64 == 0 and n % 128 == 0, allspark_ok=n % 16 == 0 and k % 16 == 0)
    print(json.dumps({"dry_run": "ok", "shapes": out}))
    return out


def hc_c_main(a):
    if a.dry_run:
        return hc_c_dry_run(a)
    import torch
    from cuda_graph_timing import graph_us

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --dry-run); run it on the GPU machine with make_upstream_kit.py --so _C")
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    C = load_vllm_ext(a.c_so, "_C", "--c-so", "make_upstream_kit.py --so _C")
    _, hk, U = load_series()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    sms, sm_ver = props.multi_processor_count, props.major * 10 + props.minor
    ws = torch.zeros(sms, dtype=torch.int32, device=dev)  # marlin_make_workspace_new(dev, 1)
    zp_empty = torch.empty(0, dtype=torch.int32, device=dev)  # marlin_make_empty
    eps = 1e-6
    res = dict(mode="hc_c", command="python3 scripts/bench/bench_upstream_baselines.py " + " ".join(sys.argv[1:]),
               device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
               torch=torch.__version__, python=platform.python_version(), pdl="off (both arms)",
               weight_sets=a.layers * 2, replays=a.replays, rounds=a.rounds, bw_3090=BW_3090,
               upstream_binary="vLLM 0.30.0 wheel _C_stable_libtorch.abi3.so (commit gced6857af)",
               selection="sm_90: Machete up (K 320, N 10240), Marlin down (N 336 padded to 384; Machete "
                         "needs N % 128, AllSpark sm 80-89); sm_86: AllSpark both",
               hc={}, kernels={}, checks={}, allspark={}, errors=[])

    def save(done=False):
        res.update(complete=done, wall_s=round(time.time() - t0, 1))
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1) + "\n")

    def kernel_row(name, us, nbytes, m):
        est = max(nbytes / BW_3090 * 1e6, us)
        res["kernels"].setdefault(name, {})[str(m)] = dict(
            h200_us=us, bytes=int(nbytes), h200_GBps=nbytes / us / 1e3, est_3090_us=est,
            bound_3090="bytes" if nbytes / BW_3090 * 1e6 >= us else "latency", what=HC_C_WHAT[name])
        return est

    # ---- weights: [N, K] uint8 q + 128 + [N, 1] bf16 scales, then each kernel's repack
    sets = []
    for i in range(a.layers * 2):
        wd = torch.randint(0, 256, (N_DOWN, K_HC), dtype=torch.uint8, device=dev, generator=g)
        wd[RANK + INJ:] = 128
        sd = (torch.rand(N_DOWN, 1, device=dev, generator=g) * 0.004 + 0.001).bfloat16()
        sd[RANK + INJ:] = 0
        wu = torch.randint(0, 256, (K_HC, RANK), dtype=torch.uint8, device=dev, generator=g)
        su = (torch.rand(K_HC, 1, device=dev, generator=g) * 0.02 + 0.005).bfloat16()
        pd, pu = hc_c_pack_torch(wd, sd), hc_c_pack_torch(wu, su)
        w = dict(wd=wd, sd=sd, wu=wu, su=su, norm=(torch.randn(K_HC, device=dev, generator=g) * 0.1).bfloat16(),
                 mar_d=C.gptq_marlin_repack(pd["marlin_in"], K_HC, pd["marlin_n"], 8, False), mar_sd=pd["marlin_s"],
                 mach_u=C.machete_prepack_B(pu["machete_in"], torch.bfloat16, U8B128_ID, torch.bfloat16),
                 mach_su=pu["machete_s"], pd=pd, pu=pu)
        sets.append(w)
    n_mar = sets[0]["pd"]["marlin_n"]
    print(f"weights packed: {len(sets)} sets, marlin down N {n_mar}, {time.time() - t0:.1f} s", flush=True)

    def marlin_down(xn, w):
        return C.marlin_gemm(xn, None, w["mar_d"], None, w["mar_sd"], None, None, zp_empty, ws, U8B128_ID,
                             xn.shape[0], n_mar, K_HC, False, True, False)

    def machete_up(lora, w):
        return C.machete_mm(lora, w["mach_u"], U8B128_ID, None, w["mach_su"], None, -1, None, None, None)

    def up_gr(w, x):
        h, xn = U._hc_combine_norm(x["h"], x["blk"], x["inj"], w["norm"], eps, HC)
        d = marlin_down(xn, w)[:, :N_DOWN].contiguous()  # apply_gptq_marlin_linear's unpad
        lora = U._hc_silu(d[:, :RANK], HC)
        return U._hc_gate_mix(xn, machete_up(lora, w), HC), d[:, RANK:RANK + INJ]

    def fused_gr(w, x):
        h, xn = U._hc_combine_norm(x["h"], x["blk"], x["inj"], w["norm"], eps, HC)
        return hk.hc_int8_mix(xn, hk.as_uint8(w["wd"].view(torch.int32)), w["sd"],
                              hk.as_uint8(w["wu"].view(torch.int32)), w["su"], RANK, INJ, HC, False)

    rel = lambda o, r: float((o.float() - r).abs().max() / r.abs().max())  # noqa: E731
    tokens = [int(t) for t in a.tokens.split(",") if t]
    for m in tokens:
        try:
            xs = [dict(h=torch.randn(m, K_HC, device=dev, generator=g).bfloat16(),
                       blk=torch.randn(m, H, device=dev, generator=g).bfloat16(),
                       inj=torch.randn(m, HC, device=dev, generator=g).bfloat16()) for _ in sets]
            # ---- correctness: each `_C` GEMM against fp32, the two arms against each other
            w0, x0 = sets[0], xs[0]
            xn0 = U._hc_combine_norm(x0["h"], x0["blk"], x0["inj"], w0["norm"], eps, HC)[1]
            lora0 = torch.randn(m, RANK, device=dev, generator=g).bfloat16()
            o_u, i_u = up_gr(w0, x0)
            o_f, i_f = fused_gr(w0, x0)
            res["checks"][str(m)] = dict(
                marlin_down_vs_fp32=rel(marlin_down(xn0, w0)[:, :N_DOWN], hc_c_ref(xn0, w0["wd"], w0["sd"])),
                machete_up_vs_fp32=rel(machete_up(lora0, w0), hc_c_ref(lora0, w0["wu"], w0["su"])),
                block_input_fused_vs_upstream=rel(o_f, o_u.float()),
                injection_fused_vs_upstream=rel(i_f[:, :INJ], i_u.float()))
            print(f"HC-C M={m} checks {json.dumps(res['checks'][str(m)])}", flush=True)
            run = lambda fn: (lambda: [fn(w, x) for w, x in zip(sets, xs)])  # noqa: E731
            samp = {"upstream": [], "fused": []}
            for _ in range(a.rounds):
                for k_, fn in (("upstream", up_gr), ("fused", fused_gr)):
                    samp[k_].append(graph_us(run(fn), len(sets), a.replays))
            t = {k_: statistics.median(v) for k_, v in samp.items()}
            t["ratio_upstream_over_fused"] = t["upstream"] / t["fused"]
            xn = [U._hc_combine_norm(x["h"], x["blk"], x["inj"], w["norm"], eps, HC)[1] for w, x in zip(sets, xs)]
            lora = [torch.randn(m, RANK, device=dev, generator=g).bfloat16() for _ in sets]
            dpad = [marlin_down(n, w) for w, n in zip(sets, xn)]
            Z = list(zip(sets, xs, xn, lora, dpad))
            dcfg, ucfg = hk.down_gemv_config(m), hk.up_gemv_config(m)
            K = {
                "hc_combine_norm": lambda: [U._hc_combine_norm(x["h"], x["blk"], x["inj"], w["norm"], eps, HC)
                                            for w, x, _, _, _ in Z],
                "marlin_gemm_down": lambda: [marlin_down(n, w) for w, _, n, _, _ in Z],
                "marlin_unpad_copy": lambda: [dp[:, :N_DOWN].contiguous() for _, _, _, _, dp in Z],
                "hc_silu": lambda: [U._hc_silu(dp[:, :RANK], HC) for _, _, _, _, dp in Z],
                "machete_mm_up": lambda: [machete_up(lo, w) for w, _, _, lo, _ in Z],
                "hc_gate_mix": lambda: [U._hc_gate_mix(n, n, HC) for _, _, n, _, _ in Z],
                "hc_down_inject_silu": lambda: [hk.hc_down_inject_silu(
                    n, hk.as_uint8(w["wd"].view(torch.int32)), w["sd"], RANK, RANK + INJ, HC, False, dcfg)
                    for w, _, n, _, _ in Z],
                "hc_up_gate_mix": lambda: [hk.hc_up_gate_mix(lo, hk.as_uint8(w["wu"].view(torch.int32)), w["su"],
                                                             n, HC, False, ucfg) for w, _, n, lo, _ in Z],
            }
            kt = {k_: graph_us(fn, len(sets), a.replays) for k_, fn in K.items()}
            nb_ = {
                "hc_combine_norm": m * K_HC * 2 + m * H * 2 + m * HC * 2 + K_HC * 2 + 2 * m * K_HC * 2,
                "marlin_gemm_down": n_mar * K_HC + n_mar * 2 + m * K_HC * 2 + m * n_mar * 2,
                "marlin_unpad_copy": m * n_mar * 2 + m * N_DOWN * 2,
                "hc_silu": 2 * m * RANK * 2,
                "machete_mm_up": K_HC * RANK + K_HC * 2 + m * RANK * 2 + m * K_HC * 2,
                "hc_gate_mix": 2 * m * K_HC * 2 + m * H * 2,
                "hc_down_inject_silu": (RANK + INJ) * K_HC + m * K_HC * 2 + m * (RANK + INJ) * 2,
                "hc_up_gate_mix": K_HC * RANK + m * RANK * 2 + m * K_HC * 2 + m * H * 2,
            }
            est = {k_: kernel_row(k_, kt[k_], nb_[k_], m) for k_ in K}
            res["hc"][str(m)] = dict(
                block_graph_us=t, samples_us=samp,
                est_3090_us=dict(upstream=sum(est[k_] for k_ in HC_C_UP), fused=sum(est[k_] for k_ in HC_C_FUSED)),
                h200_kernel_sum_us=dict(upstream=sum(kt[k_] for k_ in HC_C_UP),
                                        fused=sum(kt[k_] for k_ in HC_C_FUSED)))
            print(f"HC-C M={m}: {json.dumps(res['hc'][str(m)])}", flush=True)
        except Exception:  # noqa: BLE001
            import traceback
            res["errors"].append(f"hc_c M={m}: {traceback.format_exc()[-3000:]}")
            print(res["errors"][-1], flush=True)
        save()

    # ---- AllSpark (the sm_86 pick) last: its kernels may carry only sm_80-89 code
    for sv in (sm_ver, 86):
        key = f"sm_version_arg_{sv}"
        try:
            w0 = sets[0]
            pd, pu = w0["pd"], w0["pu"]
            nd32, nu32 = round_up(N_DOWN, 32), round_up(K_HC, 32)
            qd = torch.empty(nd32, K_HC, dtype=torch.uint8, device=dev)
            sdr = torch.empty(1, nd32, dtype=torch.bfloat16, device=dev)
            C.rearrange_kn_weight_as_n32k16_order(pd["allspark_in"], pd["allspark_s"], None, False, qd, sdr, None,
                                                  K_HC, N_DOWN, nd32)
            qu = torch.empty(nu32, RANK, dtype=torch.uint8, device=dev)
            sur = torch.empty(1, nu32, dtype=torch.bfloat16, device=dev)
            C.rearrange_kn_weight_as_n32k16_order(pu["allspark_in"], pu["allspark_s"], None, False, qu, sur, None,
                                                  RANK, K_HC, nu32)
            xn = torch.randn(1, K_HC, device=dev, generator=g).bfloat16()
            lo = torch.randn(1, RANK, device=dev, generator=g).bfloat16()
            od = C.allspark_w8a16_gemm(xn, qd, sdr, None, N_DOWN, -1, sms, sv, 1024, False, True)
            ou = C.allspark_w8a16_gemm(lo, qu, sur, None, K_HC, -1, sms, sv, 1024, False, True)
            torch.cuda.synchronize()
            r = dict(ran=True, down_vs_fp32=rel(od, hc_c_ref(xn, w0["wd"], w0["sd"])),
                     up_vs_fp32=rel(ou, hc_c_ref(lo, w0["wu"], w0["su"])))
            if r["down_vs_fp32"] < 0.02 and r["up_vs_fp32"] < 0.02:
                r["h200_us_1tok"] = dict(
                    down=graph_us(lambda: C.allspark_w8a16_gemm(xn, qd, sdr, None, N_DOWN, -1, sms, sv, 1024,
                                                                False, True), 1, a.replays),
                    up=graph_us(lambda: C.allspark_w8a16_gemm(lo, qu, sur, None, K_HC, -1, sms, sv, 1024,
                                                              False, True), 1, a.replays))
            res["allspark"][key] = r
        except Exception as e:  # noqa: BLE001
            res["allspark"][key] = dict(ran=False, error=f"{type(e).__name__}: {e}"[:1500])
        print(f"AllSpark {key}: {json.dumps(res['allspark'][key])}", flush=True)
        save()
    save(done=True)
    print("done", round(time.time() - t0, 1), "s", "errors:", len(res["errors"]), flush=True)


if __name__ == "__main__":
    main()
