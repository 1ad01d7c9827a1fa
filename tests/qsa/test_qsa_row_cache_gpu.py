"""0250-qsa-row-cache on a real GPU (skips without CUDA): the randomized
decode steps of qsa_row_cache_sim at the real sizes (2 KV heads x 256, 16
query heads, selection width 2,051, 12,144-token blocks = lines per layer,
22-column block tables, up to 12 rows: 64 splits + the merge kernel), host
K/V in pinned memory read over UVA, every step torch.equal against the
uncached upstream kernel and every tagged line checked against the host.
A second run uses 62 lines per layer, so hundreds of programs of one launch
claim, fill and hit the same lines (the races the interpreter cannot show).
variant_check: after warmup_row_cache (what startup runs), decode batches
of 1..12 rows at unaligned buffer offsets and stores of any size compile
no new variant of any row-cache kernel.

Also runs as a script on a machine without vLLM (device kit:
scripts/bench/make_qsa_device_kit.py --kit rowcache):
  python3 test_qsa_row_cache_gpu.py --steps 1000 --json $OUT/rowcache_gpu_check.json
"""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch

from qsa_row_cache_sim import Shape, run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REAL = dict(num_blocks=48, page_size=12144, kv_heads=2, head_dim=256, q_heads=16, topk=2051,
            lines=12144, layers=2, table_width=22, max_requests=4, max_rows=12,
            max_rows_per_request=3, shared_prefix=4, overlap=0.72, arena_overwrite_p=0.02,
            epoch_limit=200)


class _CAI:
    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (nbytes,),
                                         "typestr": "|u1", "version": 3}


def pinned_uva(shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Pinned host bf16 tensor of random rows and its device (UVA) view: with
    unified addressing a pinned range has the same address on the device
    (what vLLM's get_cuda_view_from_cpu_tensor returns)."""
    host = torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)
    assert host.is_pinned()
    view = torch.as_tensor(_CAI(host.data_ptr(), host.nbytes), device="cuda")
    view = view.view(torch.bfloat16).view(shape)
    view.copy_(torch.randn(shape, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    return host, view


def check(steps: int, lines: int, seed: int, budget_s: float | None = None) -> dict:
    t0 = time.monotonic()
    out = run(steps, Shape(**{**REAL, "lines": lines}), device="cuda", seed=seed,
              make_host=pinned_uva, time_budget_s=budget_s)
    out["lines"] = lines
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


@pytest.mark.parametrize("lines", [12144, 62])
def test_random_steps_real_sizes(lines):
    out = check(200, lines, seed=lines)
    assert out["equal"] == out["steps"] == 200
    assert out["hits"] > 0 and out["arena_overwrites"] >= 1


def variant_check() -> dict:
    """warmup_row_cache compiles every variant serving can hit: count each
    row-cache kernel's compiled variants after it, run decode batches of
    1..12 rows from row slices at offsets 0..3 of larger buffers (token_to_req
    and indices then start at 4-byte, not 16-byte, alignment) and stores of
    1..300 slots, count again; outputs equal the upstream kernel's."""
    try:
        from vllm.models.qwen4_exp.nvidia.ops import qsa as ops
        from vllm.models.qwen4_exp.nvidia.ops import qsa_row_cache as rc
    except ImportError:  # device kit
        import qsa_ops as ops
        import qsa_row_cache as rc
    r = dict(REAL)
    heads, dim, page, topk = r["kv_heads"], r["head_dim"], r["page_size"], r["topk"]
    g = torch.Generator(device="cpu").manual_seed(5)
    kv_host, kv_view = pinned_uva((r["num_blocks"], page, heads, 2 * dim))
    kv_cache = kv_view.transpose(1, 2)
    arena = torch.empty(5 * 9776, heads, 2 * dim, dtype=torch.bfloat16, device="cuda")
    cache = rc.QSARowCache(arena, 4)  # MTP ranks 0/1: 4 x 12,220 lines
    table = torch.randint(0, r["num_blocks"], (r["max_requests"], r["table_width"]),
                          generator=g).to(torch.int32).cuda()
    kernels = {"invalidate": rc._qsa_row_cache_invalidate_kernel,
               "plan": rc._qsa_row_cache_plan_kernel,
               "splitk": rc._qsa_row_cache_splitk_kernel,
               "merge": rc._qsa_merge_splitk_kernel}

    def variants():
        return {k: sum(len(c[0]) for c in f.device_caches.values()) for k, f in kernels.items()}

    warmed = rc.warmup_row_cache(cache, kv_cache, table, num_query_heads=r["q_heads"],
                                 selection_width=topk - 1)
    before = variants()
    equal = True
    k, v = kv_cache.transpose(1, 2).split(dim, dim=-1)
    for rows in range(1, rc.ROW_CACHE_MAX_ROWS + 1):
        off = rows % 4
        q = torch.randn(rows + off, r["q_heads"], dim, generator=g).bfloat16().cuda()[off:]
        gate = torch.randn(rows, r["q_heads"], dim, generator=g).bfloat16().cuda()
        idx = torch.randint(0, r["table_width"] * page, (rows + off, topk), generator=g)
        idx[:, -1] = topk - 1
        idx = idx.to(torch.int32).cuda()[off:]
        t2r = torch.randint(0, r["max_requests"], (rows + off,), generator=g)
        t2r = t2r.to(torch.int32).cuda()[off:]
        for layer in range(cache.num_layers):
            slots = torch.randint(0, r["num_blocks"] * page, (1 + 25 * rows + off,),
                                  generator=g).cuda()[off:]
            cache.invalidate(layer, slots)
            for _ in range(2):  # miss-fill, then hits
                out = torch.empty_like(q)
                cache.attention(layer, q, k, v, idx, table, t2r, out, output_gate=gate)
                ref = torch.empty_like(q)
                ops.qsa_sparse_paged_attention(q, k, v, idx, table, t2r, False, ref,
                                               output_gate=gate)
                equal &= bool(torch.equal(out, ref))
                cache.invalidate(layer, slots[:0])
    torch.cuda.synchronize()
    after = variants()
    del kv_host
    return {"warmed_configs": warmed, "variants_after_warmup": before,
            "variants_after_steps": after, "no_new_variants": before == after,
            "equal": equal, "num_lines": cache.num_lines,
            "variant_keys": {k: sorted(v) for k, v in rc.row_cache_variant_keys(
                topk - 1, heads).items()}}


def test_variant_check():
    out = variant_check()
    assert out["no_new_variants"] and out["equal"], out


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop a run after this many seconds (the step count is recorded)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    import triton

    res = {"command": " ".join(["python3", *sys.argv]), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "shape": REAL, "runs": []}
    for lines, seed in ((12144, 1), (62, 2)):
        try:
            res["runs"].append(check(a.steps, lines, seed, a.budget_s))
        except AssertionError as e:  # the first mismatch stops a run
            res["runs"].append({"lines": lines, "error": str(e)})
    try:
        res["variants"] = variant_check()
    except Exception:  # noqa: BLE001  (keep the step runs)
        import traceback

        res["variants"] = {"error": traceback.format_exc()[-3000:],
                           "no_new_variants": False, "equal": False}
    res["ok"] = all("error" not in r and r["equal"] == r["steps"] for r in res["runs"]) and (
        res["variants"]["no_new_variants"] and res["variants"]["equal"])
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
