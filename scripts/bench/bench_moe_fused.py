#!/usr/bin/env python3
"""Benchmark the decode MoE-block periphery, unfused vs fused (decode-05).

Periphery = everything in a Qwen4Exp MoE block except the routed-expert
Marlin GEMMs: router GEMV, top-k softmax + renormalize, Marlin block
alignment, shared-expert gate_up + SiluAndMul + down, shared gate GEMV +
sigmoid * shared, sum over the top-k routed outputs, final add.

unfused: the upstream sequence with torch stand-ins where vLLM's own kernels
are not available on the bench machine (it has torch + triton, no vLLM):
cuBLAS F.linear for router / shared gate, torch softmax/topk/div for
`_moe_C.topk_softmax`, a torch sort/bincount emulation of
`moe_align_block_size`, bf16 cuBLAS for the INT6 Humming shared-expert GEMMs
(bf16 reads 2.67x the INT6 bytes), torch silu/mul/sigmoid/sum/add.
fused: `moe_route` (1 kernel) + `shared_gate_up_silu` + `shared_down_final`.

Both run as CUDA graphs (production uses FULL decode cudagraphs); each graph
step uses the weights of a different layer (LAYERS copies > L2), as decode
cycles through 48 layers. Time per block = CUDA events around replays.

  python scripts/bench/bench_moe_fused.py --json scripts/bench/results/moe_fused.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from cuda_graph_timing import graph_us

try:
    from vllm.models.qwen4_exp.nvidia.ops import moe_fused as mf
except ImportError:  # bare torch + triton machine: moe_fused.py on PYTHONPATH
    import moe_fused as mf

E, TOPK, H, I = 512, 10, 2560, 640


def make_layers(n, dev, group):
    g = torch.Generator(device=dev).manual_seed(0)
    layers = []
    for _ in range(n):
        u_gu = torch.randint(0, 64, (2 * I, H), device=dev, generator=g, dtype=torch.int32)
        u_dn = torch.randint(0, 64, (H, I), device=dev, generator=g, dtype=torch.int32)
        ng_gu, ng_dn = (1, 1) if group == 0 else (H // group, I // group)
        s_gu = (torch.rand(2 * I, ng_gu, device=dev, generator=g) * 2e-3 + 5e-4).bfloat16()
        s_dn = (torch.rand(H, ng_dn, device=dev, generator=g) * 2e-3 + 5e-4).bfloat16()
        deq = lambda u, s: ((u.float() - 32) * s.float().repeat_interleave(u.shape[1] // s.shape[1], 1)).bfloat16()  # noqa: E731
        layers.append(dict(
            gw=(torch.randn(E, H, device=dev, generator=g) * 0.02).bfloat16(),
            sgw=(torch.randn(1, H, device=dev, generator=g) * 0.02).bfloat16(),
            p_gu=mf.int6_to_planes(mf.int6_pack_dense(u_gu), H), s_gu=s_gu,
            p_dn=mf.int6_to_planes(mf.int6_pack_dense(u_dn), I), s_dn=s_dn,
            w_gu=deq(u_gu, s_gu), w_dn=deq(u_dn, s_dn),
            counter=torch.zeros(1, dtype=torch.int32, device=dev)))
    return layers


def torch_align(topk_ids, bs):
    """moe_align_block_size semantics in torch ops (stand-in for _moe_C)."""
    M, k = topk_ids.shape
    n_sorted, n_blocks = mf.align_sizes(M, k, E, bs)
    flat = topk_ids.flatten().long()
    cnt = torch.zeros(E, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    pc = (cnt + bs - 1) // bs * bs
    off = torch.cumsum(pc, 0) - pc
    order = torch.sort(flat, stable=True).indices
    ranks = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(cnt, 0) - cnt)[flat[order]]
    sorted_ids = torch.full((n_sorted,), flat.numel(), dtype=torch.int32, device=flat.device)
    sorted_ids[off[flat[order]] + ranks] = order.int()
    blk = torch.arange(n_blocks, device=flat.device) * bs
    eids = (torch.searchsorted(off + pc, blk, right=True)).clamp_max(E - 1).int()
    return sorted_ids, eids, pc.sum().view(1).int()


def unfused_step(x, L, routed):
    logits = F.linear(x, L["gw"])
    p = torch.softmax(logits.float(), -1)
    w, ids = torch.topk(p, TOPK, -1)
    w = w / w.sum(-1, keepdim=True)
    bs = mf.marlin_block_size_m(x.shape[0], TOPK, E)
    torch_align(ids.int(), bs)
    gu = F.linear(x, L["w_gu"])
    a = F.silu(gu[:, :I]) * gu[:, I:]
    d = F.linear(a, L["w_dn"])
    shared = torch.sigmoid(F.linear(x, L["sgw"])) * d
    return shared + routed.sum(1), w


def fused_step(x, L, routed):
    tw, ti, s_ids, e_ids, ntpp, lg, bs = mf.moe_route(x, L["gw"], L["sgw"], TOPK, L["counter"])
    act = mf.shared_gate_up_silu(x, L["p_gu"], L["s_gu"], H)
    return mf.shared_down_final(act, L["p_dn"], L["s_dn"], routed, lg[:, E]), tw


def only_route(x, L, routed):
    return mf.moe_route(x, L["gw"], L["sgw"], TOPK, L["counter"])


def only_gate_up(x, L, routed):
    return mf.shared_gate_up_silu(x, L["p_gu"], L["s_gu"], H)


def only_down(x, L, routed, act=None, sg=None):
    return mf.shared_down_final(act, L["p_dn"], L["s_dn"], routed, sg)


def time_graph(fn, layers, x, routed, replays, extra=None):
    """us per step: one graph with one step per layer, replayed `replays` times."""

    def step():
        for L in layers:
            fn(x, L, routed, **(extra or {}))

    return graph_us(step, len(layers), replays)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,2,4,8", help="decode batch sizes")
    ap.add_argument("--layers", type=int, default=16, help="weight copies cycled per graph (> L2)")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--group", type=int, default=0, help="INT6 scale group size (0 = per channel)")
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    ap.add_argument("--json", help="write results here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device (run on the GPU machine)")
    dev = "cuda"
    layers = make_layers(a.layers, dev, a.group)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": "python " + " ".join(sys.argv), "layers_cycled": a.layers, "group": a.group,
           "shapes": dict(experts=E, top_k=TOPK, hidden=H, shared_intermediate=I),
           "baseline_note": __doc__.split("\n\n")[2].replace("\n", " "), "tokens": {}}
    for m in [int(t) for t in a.tokens.split(",")]:
        x = torch.randn(m, H, device=dev).bfloat16()
        routed = (torch.randn(m, TOPK, H, device=dev) * 0.05).bfloat16()
        # correctness of the fused step vs the unfused one on the same weights
        o_u, w_u = unfused_step(x, layers[0], routed)
        o_f, w_f = fused_step(x, layers[0], routed)
        rel = ((o_f.float() - o_u.float()).abs().max() / o_u.float().abs().max()).item()
        act = mf.shared_gate_up_silu(x, layers[0]["p_gu"], layers[0]["s_gu"], H)
        sg = torch.zeros(m, device=dev)
        r = dict(
            unfused_us=time_graph(unfused_step, layers, x, routed, a.replays),
            fused_us=time_graph(fused_step, layers, x, routed, a.replays),
            route_us=time_graph(only_route, layers, x, routed, a.replays),
            gate_up_silu_us=time_graph(only_gate_up, layers, x, routed, a.replays),
            down_final_us=time_graph(only_down, layers, x, routed, a.replays, dict(act=act, sg=sg)),
            out_max_rel_diff_vs_unfused=rel)
        r["ratio_unfused_over_fused"] = r["unfused_us"] / r["fused_us"]
        if a.sweep:
            sw = {}
            for bn, bk, nw in [(4, 256, 4), (2, 256, 4), (2, 512, 4), (4, 512, 4), (8, 512, 8), (4, 512, 8)]:
                f = lambda x, L, routed: mf.moe_route(x, L["gw"], L["sgw"], TOPK, L["counter"],  # noqa: E731
                                                      block_n=bn, block_k=bk, num_warps=nw)
                sw[f"route_n{bn}_k{bk}_w{nw}"] = time_graph(f, layers, x, routed, a.replays)
            for bn, bk, nw in [(8, 256, 4), (4, 256, 4), (4, 512, 4), (2, 512, 4), (8, 512, 8), (4, 128, 2)]:
                f = lambda x, L, routed: mf.shared_gate_up_silu(x, L["p_gu"], L["s_gu"], H,  # noqa: E731
                                                                block_k=bk, block_n=bn, num_warps=nw)
                sw[f"gate_up_n{bn}_k{bk}_w{nw}"] = time_graph(f, layers, x, routed, a.replays)
            for bn, bk, nw in [(16, 128, 4), (8, 128, 4), (32, 128, 4), (8, 64, 2), (16, 64, 4), (32, 128, 8)]:
                f = lambda x, L, routed: mf.shared_down_final(act, L["p_dn"], L["s_dn"], routed, sg,  # noqa: E731
                                                              block_k=bk, block_n=bn, num_warps=nw)
                sw[f"down_n{bn}_k{bk}_w{nw}"] = time_graph(f, layers, x, routed, a.replays)
            r["sweep_us"] = sw
        res["tokens"][str(m)] = r
        print(m, json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", a.json)


if __name__ == "__main__":
    main()
