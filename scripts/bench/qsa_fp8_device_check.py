#!/usr/bin/env python3
"""FP8 QSA K/V over host RAM (0260-qsa-kv-fp8) on a GPU, in one run.

Checks (each reported, the run exits 1 when one fails):
  decode      the PTX byte decode (0.33.0's) == the plain-Triton decode the
              CPU tests run, over all 256 e4m3 codes
  write       vLLM 0.30.0's own reshape_and_cache_flash ("fp8_e4m3", the
              layer's scale tensors, the pinned wheel's compiled _C) writes
              through the split K/V views of a host (UVA) page the bytes
              quantize_kv_e4m3 gives (only with --c-so)
  upstream    the series' FP8 attention == vLLM 0.33.0's qsa_sparse_paged_
              attention (its ops/qsa.py, read from the 0.33.0 wheel by the
              kit builder) on the same uint8 host cache, bit for bit, at
              decode and prefill row counts; 0.33.0's sm_90/sm_80/sm_120
              tables switched off, so both take the table a 3090 takes
  accuracy    FP8 output vs the bf16 kernel on the unquantized K/V and vs a
              float64 reference of the dequantized K/V (max abs error,
              relative to the output's RMS, cosine)
  staged      staged prefill (uint8 arena) == direct FP8 over UVA
  rowcache    randomized decode steps through the row cache == the
              uncached FP8 kernel (stores and invalidation in between)
Timings (CUDA events, CUDA graphs for decode), bf16 vs FP8 in this one run:
  decode per layer, 1 row: all rows from host, row cache at 0/72/100 %
  step overlap, all-VRAM floor; staged prefill of 512 query rows
  (clustered selections, 4 blocks of context) and its gather alone.
Shapes are the model's: 2 KV heads x 256, 16 query heads, 2,051 selected
rows, 12,144-token blocks, 22 blocks per request.

  python3 scripts/vllm_patches.py tree /tmp/tree
  python3 scripts/bench/make_qsa_device_kit.py --tree /tmp/tree --kit fp8 \\
      --v033-wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl --with-c --out KIT
  (device) cd KIT && python3 qsa_fp8_device_check.py --c-so _C_stable_libtorch.abi3.so.xz \\
      --json $OUT/qsa_fp8_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here (rewritten after every part)")
    ap.add_argument("--c-so", help="the pinned wheel's _C_stable_libtorch.abi3.so(.xz): "
                    "checks the real cache write")
    ap.add_argument("--v033", default="qsa_ops_v033.py",
                    help="vLLM 0.33.0's ops/qsa.py as the kit ported it")
    ap.add_argument("--rowcache-steps", type=int, default=400)
    ap.add_argument("--steps", type=int, default=100, help="timed decode steps per case")
    ap.add_argument("--iters", type=int, default=5, help="timed staged-prefill calls")
    ap.add_argument("--skip-timing", action="store_true")
    return ap.parse_args()


A = parse()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import qsa_fp8  # noqa: E402
import qsa_host_kv as qhk  # noqa: E402
import qsa_row_cache as rc  # noqa: E402
from dev_stubs import get_accelerator_view_from_cpu_tensor as uva_view  # noqa: E402
from bench_qsa_staging import selection  # noqa: E402  (its random / clustered top-k)
from dev_stubs import timed  # noqa: E402
from qsa_ops import _select_config, qsa_sparse_paged_attention  # noqa: E402

KVH, D, QH, TOPK, BS, WIDTH = 2, 256, 16, 2051, 12144, 22
RES = {"command": "cd KIT && python3 qsa_fp8_device_check.py " + " ".join(sys.argv[1:]),
       "kit": "python3 scripts/bench/make_qsa_device_kit.py --tree <patched tree> --kit fp8 "
              "--v033-wheel <vllm-0.33.0 wheel> --with-c --out KIT",
       "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
       "shape": dict(kv_heads=KVH, head_dim=D, q_heads=QH, topk=TOPK, block=BS, width=WIDTH),
       "checks": {}, "timing": {}}
OK = True
HOLD = []  # pinned host tensors behind the UVA views (the views keep no reference)


def save():
    if A.json:
        with open(A.json, "w") as f:
            json.dump(RES, f, indent=1)


def check(name, ok, **info):
    global OK
    OK &= bool(ok)
    RES["checks"][name] = {"ok": bool(ok), **info}
    print(name, json.dumps(RES["checks"][name]), flush=True)
    save()


def host_pages(num_blocks, dtype):
    """One host K/V layer [blocks, heads, block, 2D] in pinned RAM, its UVA view."""
    host = torch.empty(num_blocks * BS * KVH * 2 * D * dtype.itemsize, dtype=torch.uint8,
                       pin_memory=True)
    HOLD.append(host)
    dev = uva_view(host)
    return qhk.host_kv_layer_views(dev, 1, num_blocks, BS, KVH, D, dtype)[0]


def split(kv):
    return kv.transpose(1, 2).split(D, dim=-1)


def fill(kv8, kvbf, k_scale, v_scale, gen):
    """Random K/V (K ~ N(0, 2), V ~ N(0, 1)): bf16 pages and their e4m3 bytes."""
    raw = torch.randn(kvbf.transpose(1, 2).shape, device="cuda", generator=gen)
    raw[..., :D] *= 2
    kvbf.transpose(1, 2).copy_(raw.bfloat16())
    src = kvbf.transpose(1, 2).float()
    kv8.transpose(1, 2)[..., :D].copy_(qsa_fp8.quantize_kv_e4m3(src[..., :D], k_scale))
    kv8.transpose(1, 2)[..., D:].copy_(qsa_fp8.quantize_kv_e4m3(src[..., D:], v_scale))


_maybe_dequant = qsa_fp8._maybe_dequant


@triton.jit
def _decode_both(x_ptr, asm_ptr, ref_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    t = tl.load(x_ptr + o)
    tl.store(asm_ptr + o, _maybe_dequant(t))
    b = t.to(tl.uint16)
    tl.store(ref_ptr + o, (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True))


def load_v033():
    import importlib.util

    spec = importlib.util.spec_from_file_location("qsa_ops_v033", A.v033)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # The 3090 (sm_86) takes 0.33.0's default table, as the series does;
    # this machine would pick the sm_90 one.
    mod._is_sm90 = mod._is_sm80 = mod._is_sm120 = lambda: False
    return mod


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)

    # ---- decode: PTX vs plain Triton, all 256 codes -------------------------
    codes = torch.arange(256, device="cuda", dtype=torch.int32).to(torch.uint8)
    got, ref = torch.empty(256, dtype=torch.float16, device="cuda"), torch.empty(
        256, dtype=torch.float16, device="cuda")
    _decode_both[(1,)](codes, got, ref, N=256)
    e4m3 = codes.view(torch.float8_e4m3fn).float()
    finite = ~torch.isnan(e4m3)
    check("decode", torch.equal(got.view(torch.int16), ref.view(torch.int16))
          and torch.equal(got.float()[finite] * 256, e4m3[finite]),
          codes=256, nan_codes_decode_to=[float(got[127]) * 256, float(got[255]) * 256])

    # ---- a host cache (fp8 + bf16) with one 262k request per row ------------
    nb = WIDTH + 2
    kv8, kvbf = host_pages(nb, torch.uint8), host_pages(nb, torch.bfloat16)
    fill(kv8, kvbf, 1.0, 1.0, gen)
    vram8 = kv8.clone()
    table = torch.randperm(nb, device="cuda", generator=gen)[:WIDTH].to(torch.int32)[None, :]

    # ---- the real cache write (vLLM 0.30.0's _C) ------------------------------
    if A.c_so:
        try:
            from bench_upstream_baselines import load_vllm_ext

            load_vllm_ext(A.c_so, "_C", "--c-so", "make_qsa_device_kit.py --with-c")
            n = 4096
            key = (torch.randn(n, KVH, D, device="cuda", generator=gen) * 40).bfloat16()
            val = torch.randn(n, KVH, D, device="cuda", generator=gen).bfloat16()
            slots = torch.randperm(nb * BS, device="cuda", generator=gen)[:n]
            for ks, vs in ((1.0, 1.0), (0.5, 2.0)):
                page = host_pages(nb, torch.uint8)
                kc, vc = split(page)
                torch.ops._C_cache_ops.reshape_and_cache_flash(
                    key, val, kc, vc, slots, "fp8_e4m3",
                    torch.tensor(ks, device="cuda"), torch.tensor(vs, device="cuda"))
                torch.cuda.synchronize()
                rows = page.transpose(1, 2).reshape(nb * BS, KVH, 2 * D)[slots]
                want_k = qsa_fp8.quantize_kv_e4m3(key.float(), ks)
                want_v = qsa_fp8.quantize_kv_e4m3(val.float(), vs)
                k_eq = (rows[..., :D] == want_k).float().mean().item()
                v_eq = (rows[..., D:] == want_v).float().mean().item()
                # any byte that differs is one e4m3 step from ours (ties)
                step = (qsa_fp8.dequantize_kv_e4m3(rows[..., :D], ks)
                        - qsa_fp8.dequantize_kv_e4m3(want_k, ks)).abs().max().item()
                check(f"write_k{ks}_v{vs}", k_eq > 0.999 and v_eq > 0.999,
                      k_bytes_equal=k_eq, v_bytes_equal=v_eq, max_k_diff=step,
                      saturated_k=int((key.float().abs() / ks > 448).sum()))
                del page
                HOLD.pop()
        except Exception as e:  # noqa: BLE001 - reported, the rest still runs
            check("write", False, error=repr(e))

    # ---- upstream 0.33.0 equality, accuracy ---------------------------------
    v033 = load_v033()
    ctx = WIDTH * BS
    k8, v8 = split(kv8)
    kb, vb = split(kvbf)
    for ks, vs in ((1.0, 1.0), (0.5, 2.0)):
        if (ks, vs) != (1.0, 1.0):
            fill(kv8, kvbf, ks, vs, gen)
        for rows, prefill in ((1, False), (2, False), (4, False), (12, False), (64, True),
                              (512, True)):
            q = torch.randn(rows, QH, D, device="cuda", generator=gen).bfloat16()
            gate = torch.randn(rows, QH, D, device="cuda", generator=gen).bfloat16()
            t2r = torch.zeros(rows, dtype=torch.int32, device="cuda")
            packed = selection(rows, ctx, "random", gen)
            ours, up, bf = (torch.empty_like(q) for _ in range(3))
            qsa_sparse_paged_attention(q, k8, v8, packed, table, t2r, prefill, ours,
                                       output_gate=gate, k_scale=ks, v_scale=vs)
            v033.qsa_sparse_paged_attention(q, k8, v8, packed, table, t2r, prefill, up,
                                            output_gate=gate, k_scale=ks, v_scale=vs)
            qsa_sparse_paged_attention(q, kb, vb, packed, table, t2r, prefill, bf,
                                       output_gate=gate)
            cfg = _select_config(rows, KVH, prefill, TOPK)
            info = {"rows": rows, "prefill": prefill, "k_scale": ks, "v_scale": vs,
                    "config": cfg, "v033_config": v033._select_config(rows, KVH, prefill,
                                                                       TOPK)}
            d = (ours.float() - bf.float())
            rms = bf.float().pow(2).mean().sqrt().item()
            info["vs_bf16_max_abs"] = d.abs().max().item()
            info["vs_bf16_max_abs_over_rms"] = info["vs_bf16_max_abs"] / rms
            info["vs_bf16_cosine"] = torch.nn.functional.cosine_similarity(
                ours.float().flatten(), bf.float().flatten(), dim=0).item()
            if rows <= 4:
                # float64 reference of the dequantized rows the kernel reads
                sel = packed[:, :TOPK].long()
                page, off = table[0, sel // BS].long(), sel % BS
                rows_kv = kv8.transpose(1, 2)[page, off]  # [rows, TOPK, heads, 2D]
                kd = qsa_fp8.dequantize_kv_e4m3(rows_kv[..., :D], ks).double()
                vd = qsa_fp8.dequantize_kv_e4m3(rows_kv[..., D:], vs).double()
                qg = q.double().view(rows, KVH, QH // KVH, D)
                s = torch.einsum("rhgd,rnhd->rhgn", qg, kd) * D**-0.5
                o = torch.einsum("rhgn,rnhd->rhgd", torch.softmax(s, -1), vd)
                o = o.reshape(rows, QH, D) * torch.sigmoid(gate.double())
                info["vs_f64_dequant_max_abs"] = (ours.double() - o).abs().max().item()
                info["bf16_vs_f64_dequant_max_abs"] = (bf.double() - o).abs().max().item()
            check(f"upstream_r{rows}_k{ks}_v{vs}", torch.equal(ours, up), **info)

    # ---- staged prefill == direct (uint8 arena) -----------------------------
    arena8 = qhk.QSAStagingArena(4, BS, KVH, D, "cuda", torch.uint8)
    for rows, ctx_blocks in ((512, 4), (512, 21), (64, 21)):
        q = torch.randn(rows, QH, D, device="cuda", generator=gen).bfloat16()
        gate = torch.randn(rows, QH, D, device="cuda", generator=gen).bfloat16()
        t2r = torch.zeros(rows, dtype=torch.int32, device="cuda")
        tbl = torch.full((1, WIDTH), -1, dtype=torch.int32, device="cuda")
        tbl[0, :ctx_blocks] = table[0, :ctx_blocks]
        packed = selection(rows, ctx_blocks * BS, "clustered", gen)
        direct, staged = torch.empty_like(q), torch.empty_like(q)
        qsa_sparse_paged_attention(q, k8, v8, packed, tbl, t2r, True, direct, output_gate=gate,
                                   k_scale=0.5, v_scale=2.0)
        qhk.staged_sparse_attention(qsa_sparse_paged_attention, q, kv8, D, packed, tbl, t2r,
                                    True, staged, gate, arena8, k_scale=0.5, v_scale=2.0)
        check(f"staged_r{rows}_ctx{ctx_blocks}", torch.equal(direct, staged))

    # ---- row cache: randomized steps ----------------------------------------
    cache = rc.QSARowCache(arena8.token_rows, 1)
    cache.count_hits = True
    g = torch.Generator().manual_seed(1)
    tbl = table[:, :WIDTH].expand(rc.ROW_CACHE_MAX_ROWS, WIDTH).contiguous()
    prev = None
    mismatches = 0
    flat = kv8.transpose(1, 2).reshape(nb * BS, KVH, 2 * D)
    t0 = time.time()
    for step in range(A.rowcache_steps):
        rows = int(torch.randint(1, rc.ROW_CACHE_MAX_ROWS + 1, (1,), generator=g))
        q = torch.randn(rows, QH, D, generator=g).bfloat16().cuda()
        gate = torch.randn(rows, QH, D, generator=g).bfloat16().cuda()
        t2r = torch.arange(rows, dtype=torch.int32).cuda()
        idx = torch.randint(0, 3 * BS, (rows, TOPK), generator=g).to(torch.int32)
        if prev is not None:
            keep = int(torch.randint(0, TOPK + 1, (1,), generator=g))
            idx[:, :keep] = prev[0, :keep]
        prev = idx
        packed = torch.cat([idx, torch.full((rows, 1), TOPK, dtype=torch.int32)], 1).cuda()
        out, ref = torch.empty_like(q), torch.empty_like(q)
        cache.attention(0, q, k8, v8, packed, tbl[:rows], t2r, out, output_gate=gate,
                        k_scale=0.5, v_scale=2.0)
        qsa_sparse_paged_attention(q, k8, v8, packed, tbl[:rows], t2r, False, ref,
                                   output_gate=gate, k_scale=0.5, v_scale=2.0)
        mismatches += int(not torch.equal(out, ref))
        slots = torch.randint(0, nb * BS, (rows,), generator=g).cuda()
        flat[slots] = torch.randint(0, 120, (rows, KVH, 2 * D), generator=g).to(
            torch.uint8).cuda()
        cache.invalidate(0, slots)
    hits, lookups = cache.stats[0].tolist()
    check("rowcache", mismatches == 0, steps=A.rowcache_steps, mismatches=mismatches,
          hit_rate=round(hits / max(1, lookups), 4), seconds=round(time.time() - t0, 1))
    if A.skip_timing:
        return

    # ---- timing: decode per layer, bf16 vs fp8 -------------------------------
    from bench_qsa_row_cache import selections

    fill(kv8, kvbf, 1.0, 1.0, gen)
    vrambf, vram8 = kvbf.clone(), kv8.clone()
    arenabf = qhk.QSAStagingArena(4, BS, KVH, D, "cuda", torch.bfloat16)
    rows = 1
    tbl = table.contiguous()
    t2r = torch.zeros(rows, dtype=torch.int32, device="cuda")
    q = torch.randn(rows, QH, D, device="cuda", generator=gen).bfloat16()
    gate = torch.randn(rows, QH, D, device="cuda", generator=gen).bfloat16()
    out = torch.empty_like(q)
    slot_mapping = (tbl[:, -1].long() * BS + BS - 1).contiguous()
    warm, steps = 20, A.steps
    n = warm + steps
    cpu_gen = torch.Generator().manual_seed(2)
    for overlap in (0.0, 0.72, 1.0):
        sel = selections(rows, n, overlap, ctx - 1, cpu_gen)
        idx = torch.cat([sel.to(torch.int32), torch.full((n, rows, 1), TOPK, dtype=torch.int32)],
                        -1).cuda()
        case = {"rows": rows, "overlap": overlap}
        for name, kv, vram, arena, sc in (("bf16", kvbf, vrambf, arenabf, {}),
                                         ("fp8", kv8, vram8, arena8,
                                          dict(k_scale=1.0, v_scale=1.0))):
            cache = rc.QSARowCache(arena.token_rows, 4)

            def graph_time(fn, setup=None):
                if setup:
                    setup()
                for i in range(n):
                    fn(i)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for i in range(warm, n):
                        fn(i)
                times = []
                for _ in range(3):
                    if setup:
                        setup()
                    for i in range(warm):
                        fn(i)
                    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
                    s.record()
                    graph.replay()
                    e.record()
                    torch.cuda.synchronize()
                    times.append(s.elapsed_time(e) * 1e3 / steps)
                return round(sorted(times)[1], 1)

            def direct(i, kv=kv):
                k, v = split(kv)
                qsa_sparse_paged_attention(q, k, v, idx[i], tbl, t2r, False, out,
                                           output_gate=gate, **sc)

            def cached(i, kv=kv, cache=cache):
                cache.invalidate(0, slot_mapping)
                k, v = split(kv)
                cache.attention(0, q, k, v, idx[i], tbl, t2r, out, output_gate=gate, **sc)

            if overlap == 0.0:
                case[f"{name}_host_us"] = graph_time(direct)
                case[f"{name}_vram_us"] = graph_time(lambda i, vram=vram: direct(i, vram))
            case[f"{name}_cached_us"] = graph_time(cached, lambda c=cache: c.tags.fill_(-1))
        case["fp8_over_bf16_cached"] = round(case["fp8_cached_us"] / case["bf16_cached_us"], 3)
        if overlap == 0.0:
            case["fp8_over_bf16_host"] = round(case["fp8_host_us"] / case["bf16_host_us"], 3)
        RES["timing"][f"decode_1row_overlap{overlap}"] = case
        print(json.dumps(case), flush=True)
        save()

    # ---- timing: staged prefill, 512 rows ------------------------------------
    rows, ctx_blocks = 512, 4
    q = torch.randn(rows, QH, D, device="cuda", generator=gen).bfloat16()
    gate = torch.randn(rows, QH, D, device="cuda", generator=gen).bfloat16()
    t2r = torch.zeros(rows, dtype=torch.int32, device="cuda")
    tb = torch.full((1, WIDTH), -1, dtype=torch.int32, device="cuda")
    tb[0, :ctx_blocks] = table[0, :ctx_blocks]
    packed = selection(rows, ctx_blocks * BS, "clustered", gen)
    out = torch.empty_like(q)
    case = {"rows": rows, "ctx_blocks": ctx_blocks, "pattern": "clustered",
            "distinct": int(torch.unique(packed[:, :-1]).numel())}
    for name, kv, arena, sc in (("bf16", kvbf, arenabf, {}),
                                ("fp8", kv8, arena8, dict(k_scale=1.0, v_scale=1.0))):
        case[f"{name}_staged_ms"] = timed(lambda kv=kv, arena=arena, sc=sc:
                                          qhk.staged_sparse_attention(
                                              qsa_sparse_paged_attention, q, kv, D, packed, tb,
                                              t2r, True, out, gate, arena, **sc), A.iters)
        case[f"{name}_stage_only_ms"] = timed(lambda kv=kv, arena=arena: qhk.stage_selected_rows(
            kv, packed, tb, t2r, arena), A.iters)
        case[f"{name}_uva_ms"] = timed(lambda kv=kv, sc=sc: qsa_sparse_paged_attention(
            q, *split(kv), packed, tb, t2r, True, out, output_gate=gate, **sc), A.iters)
    case["fp8_over_bf16_staged"] = round(case["fp8_staged_ms"] / case["bf16_staged_ms"], 3)
    case["fp8_over_bf16_stage_only"] = round(case["fp8_stage_only_ms"]
                                             / case["bf16_stage_only_ms"], 3)
    RES["timing"]["staged_prefill_512"] = case
    print(json.dumps(case), flush=True)
    save()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        RES["interrupted"] = True
    RES["all_ok"] = OK
    save()
    print("all_ok", OK)
    sys.exit(0 if OK else 1)
