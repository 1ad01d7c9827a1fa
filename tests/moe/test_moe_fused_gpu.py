"""decode-05 on a real GPU (skips without CUDA): real shapes (512 experts,
top-10, hidden 2560, shared intermediate 640).

* the last-CTA protocol under real concurrency: thousands of back-to-back
  launches (eager and CUDA-graph replays) without a sync in between, every
  result compared with the torch reference of upstream topk_softmax +
  renormalize and moe_align_block_size; the counter is 0 after each.
* shared-expert kernels against the fp32 reference at bf16 level.

Also runs as a script (`python tests/moe/test_moe_fused_gpu.py --json F`) on a
machine without vLLM, with moe_fused.py on PYTHONPATH.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

try:
    from vllm.models.qwen4_exp.nvidia.ops import moe_fused as mf
except ImportError:  # bare torch + triton machine
    import moe_fused as mf

E, TOPK, H, I = 512, 10, 2560, 640
TOKENS = (1, 2, 3, 4, 5, 8)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _ref_route(logits_bf16):
    """upstream topk_softmax + renormalize semantics on the given bf16 logits."""
    return mf.ref_topk_softmax(logits_bf16, TOPK)


def _align_ok(ids, sorted_ids, expert_ids, ntpp, bs):
    rs, re_, rn = mf.ref_align(ids.cpu(), bs, E)
    return (torch.equal(ntpp.cpu(), rn) and torch.equal(sorted_ids.cpu(), rs)
            and torch.equal(expert_ids.cpu(), re_))


def _logits_bound(x, w, lg):
    """(launch over 1 bf16 ulp vs fp32 GEMM rounded once, launch over the
    guaranteed bound). The guarantee: fp32 accumulation in another order
    differs from the fp32 GEMM by at most K * 2^-24 * sum_k |x_k w_k| (worst
    case for any order), then one bf16 rounding each: + 1 ulp. Near a
    cancellation (|logit| << sum |x w|) that exceeds 1 ulp of the logit, so
    the 1-ulp count is reported, not asserted."""
    f32 = torch.nn.functional.linear(x.float(), w.float())
    ref = f32.bfloat16().float()
    ulp = ref.abs().clamp_min(1e-30) * 2.0 ** -7  # 1 bf16 ulp (upper bound)
    mag = torch.nn.functional.linear(x.float().abs(), w.float().abs())
    bound = ulp + x.shape[1] * 2.0 ** -24 * mag + 2.0 ** -126
    d = (lg - ref).abs()
    return int((d > ulp).any().item()), int((d > bound).any().item())


def route_many(n_per_m: int = 1000, graph_replays: int = 1000, seed: int = 0) -> dict:
    """Back-to-back launches, outputs kept, compared after one final sync."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    gw = (torch.randn(E, H, device=dev, generator=g) * 0.02).bfloat16()
    # a few duplicate rows: exact logit ties every launch
    gw[300] = gw[7]
    gw[301] = gw[7]
    gw[400] = gw[100]
    sgw = (torch.randn(1, H, device=dev, generator=g) * 0.02).bfloat16()
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    stats = {}
    for m in TOKENS:
        xs = torch.randn(n_per_m, m, H, device=dev, generator=g).bfloat16()
        xs[::7] *= 0  # all-zero inputs: every logit ties
        outs = [mf.moe_route(xs[i], gw, sgw, TOPK, counter) for i in range(n_per_m)]
        torch.cuda.synchronize()
        bad_ids = bad_w = bad_align = bad_lg = same_as_blas = ours_off = blas_off = ours_over_bound = 0
        max_w = 0.0
        max_lg = 0.0
        for i, (tw, ti, s_ids, e_ids, ntpp, lg, bs) in enumerate(outs):
            # exact check: routing of the kernel's own bf16 logits
            rw, rid = _ref_route(lg[:, :E].bfloat16())
            ok = torch.equal(ti, rid)
            bad_ids += int(not ok)
            d = (tw - rw).abs().max().item()
            max_w = max(max_w, d)
            bad_w += int(d > 1e-6)
            if i % 10 == 0 or not ok:
                bad_align += int(not _align_ok(ti, s_ids, e_ids, ntpp, bs))
            # vs cuBLAS logits (F.linear bf16, different summation order)
            blas = torch.nn.functional.linear(xs[i], torch.cat([gw, sgw]))
            dl = ((lg - blas.float()).abs() / blas.float().abs().clamp_min(1e-3)).max().item()
            max_lg = max(max_lg, dl)
            bad_lg += int(dl > 8e-3)
            same_as_blas += int(torch.equal(ti, _ref_route(blas[:, :E])[1]))
            # which one is off: both vs an fp32 GEMM rounded once to bf16
            o1, ob = _logits_bound(xs[i], torch.cat([gw, sgw]), lg)
            ours_off += o1
            ours_over_bound += ob
            blas_off += _logits_bound(xs[i], torch.cat([gw, sgw]), blas.float())[0]
        stats[f"eager_m{m}"] = dict(launches=n_per_m, wrong_ids=bad_ids, wrong_weights=bad_w,
                                    max_weight_abs_diff=max_w, wrong_align_sampled=bad_align,
                                    logits_max_rel_vs_cublas=max_lg, logits_over_1ulp=bad_lg,
                                    ids_same_as_cublas_routing=same_as_blas,
                                    launches_ours_over_1ulp_vs_fp32=ours_off,
                                    launches_ours_over_fp32_bound=ours_over_bound,
                                    launches_cublas_over_1ulp_vs_fp32=blas_off,
                                    counter_after=int(counter.item()))
        # CUDA graph: the counter reset must make replays independent
        x_static = xs[0].clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            mf.moe_route(x_static, gw, sgw, TOPK, counter)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gout = mf.moe_route(x_static, gw, sgw, TOPK, counter)
        keep = []
        for r in range(graph_replays):
            x_static.copy_(xs[r % n_per_m])
            graph.replay()
            keep.append((gout[1].clone(), gout[0].clone(), gout[5].clone()))
        torch.cuda.synchronize()
        # Routing errors and logit deviations are counted apart: the routing
        # of the kernel's own logits is exact (guaranteed), the logits are
        # within the fp32-summation bound (guaranteed) but not always within
        # 1 bf16 ulp of a once-rounded fp32 GEMM (cancellation; the first
        # record had 1 / 5 / 4 / 16 such replays at M = 1 / 2 / 4 / 8, the
        # same launches as eager).
        wrong_ids = wrong_w = over_ulp = over_bound = 0
        for r, (ti, tw, lg) in enumerate(keep):
            rw, rid = _ref_route(lg[:, :E].bfloat16())
            wrong_ids += int(not torch.equal(ti, rid))
            wrong_w += int((tw - rw).abs().max().item() > 1e-6)
            o1, ob = _logits_bound(xs[r % n_per_m], torch.cat([gw, sgw]), lg)
            over_ulp += o1
            over_bound += ob
        stats[f"graph_m{m}"] = dict(replays=graph_replays, wrong_ids=wrong_ids, wrong_weights=wrong_w,
                                    logits_over_1ulp_vs_fp32=over_ulp, logits_over_fp32_bound=over_bound,
                                    counter_after=int(counter.item()))
    return stats


def padding_check(n: int = 200, seed: int = 2) -> dict:
    """VLLM_MOE_SKIP_PADDING on the GPU: batches of 3 padded to 4 and of 5
    padded to 8 (the runner's persistent mask, captured in a graph): padded
    rows get id -1 and no alignment slot; real rows route as unpadded."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    gw = (torch.randn(E, H, device=dev, generator=g) * 0.02).bfloat16()
    sgw = (torch.randn(1, H, device=dev, generator=g) * 0.02).bfloat16()
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    mask = torch.zeros(16, dtype=torch.bool, device=dev)
    out = {}
    for rows, real in ((4, 3), (8, 5)):
        mask.zero_()
        mask[real:rows] = True
        x_static = torch.zeros(rows, H, device=dev, dtype=torch.bfloat16)
        mf.moe_route(x_static, gw, sgw, TOPK, counter, is_padding=mask[:rows])
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gout = mf.moe_route(x_static, gw, sgw, TOPK, counter, is_padding=mask[:rows])
        bad = 0
        for _ in range(n):
            x = torch.randn(rows, H, device=dev, generator=g).bfloat16()
            x[real:] = 0
            x_static.copy_(x)
            graph.replay()
            tw, ti, s_ids, e_ids, ntpp, lg, bs = gout
            plain = mf.moe_route(x, gw, sgw, TOPK, counter)
            ok = bool((ti[real:] == -1).all()) and bool((tw[real:] == 0).all())
            ok &= torch.equal(ti[:real], plain[1][:real])
            ok &= _align_ok(ti, s_ids, e_ids, ntpp, bs)
            bad += int(not ok)
        out[f"pad_{real}_of_{rows}"] = dict(replays=n, wrong=bad, counter_after=int(counter.item()))
    return out


def shared_check(seed: int = 1) -> dict:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    out = {}
    for grp in (0, 128):
        u_gu = torch.randint(0, 64, (2 * I, H), device=dev, generator=g, dtype=torch.int32)
        u_dn = torch.randint(0, 64, (H, I), device=dev, generator=g, dtype=torch.int32)
        ng_gu, ng_dn = (1, 1) if grp == 0 else (H // grp, I // grp)
        s_gu = (torch.rand(2 * I, ng_gu, device=dev, generator=g) * 0.002 + 0.0005).bfloat16()
        s_dn = (torch.rand(H, ng_dn, device=dev, generator=g) * 0.002 + 0.0005).bfloat16()
        p_gu = mf.int6_to_planes(mf.int6_pack_dense(u_gu), H)
        p_dn = mf.int6_to_planes(mf.int6_pack_dense(u_dn), I)
        assert torch.equal(mf.planes_to_u(p_gu, H), u_gu)
        for m in TOKENS:
            x = torch.randn(m, H, device=dev, generator=g).bfloat16()
            routed = (torch.randn(m, TOPK, H, device=dev, generator=g) * 0.05).bfloat16()
            sg = torch.randn(m, device=dev, generator=g).bfloat16().float()
            act = mf.shared_gate_up_silu(x, p_gu, s_gu, H)
            o = mf.shared_down_final(act, p_dn, s_dn, routed, sg)
            ref_o, ref_a = mf.ref_shared_block(x, u_gu, s_gu, u_dn, s_dn, sg, routed)
            rel = lambda a, b: ((a.float() - b).abs().max() / b.abs().max()).item()  # noqa: E731
            out[f"g{grp}_m{m}"] = dict(act_max_rel=rel(act, ref_a), out_max_rel=rel(o, ref_o))
    return out


@requires_cuda
def test_route_many_launches():
    s = route_many(n_per_m=300, graph_replays=300)
    for k, v in s.items():
        # guaranteed: exact routing of the kernel's logits, exact alignment,
        # the counter reset, logits within the fp32-summation bound; NOT
        # guaranteed (reported only): logits within 1 bf16 ulp of fp32
        assert v["wrong_ids"] == 0 and v["wrong_weights"] == 0, (k, v)
        assert v.get("wrong_align_sampled", 0) == 0, (k, v)
        assert v.get("launches_ours_over_fp32_bound", v.get("logits_over_fp32_bound")) == 0, (k, v)
        assert v["counter_after"] == 0


@requires_cuda
def test_route_skips_padding_rows_in_graphs():
    for k, v in padding_check(n=50).items():
        assert v["wrong"] == 0 and v["counter_after"] == 0, (k, v)


@requires_cuda
def test_shared_expert_real_shapes():
    for k, v in shared_check().items():
        assert v["act_max_rel"] < 1e-2 and v["out_max_rel"] < 1e-2, (k, v)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--n", type=int, default=1000, help="eager launches per token count")
    ap.add_argument("--replays", type=int, default=1000, help="graph replays per token count")
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "route": route_many(a.n, a.replays),
           "padding": padding_check(), "shared": shared_check(), "command": " ".join(sys.argv)}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
