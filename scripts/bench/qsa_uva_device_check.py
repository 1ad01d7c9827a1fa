"""Device check for issue 5 (0210-pinned-pool, 0220-qsa-kv-offload).

Runs from the kit that make_qsa_device_kit.py builds (no vLLM needed):
  python3 scripts/bench/make_qsa_device_kit.py --tree /tmp/tree-5 --kit staging --out _device/issue5
  (device) cd _device/issue5 && python3 qsa_uva_device_check.py   # JSON to $OUT
Writes $OUT/qsa_uva_check.json; results: scripts/bench/results/qsa_uva_h200*.json
(run4: with section 3).

1. exact-size pool: anonymous mmap + the upstream pin_tensor (cudaHostRegister),
   is_pinned, a UVA device pointer (cudaHostGetDevicePointer, what vLLM's
   get_cuda_view_from_cpu_tensor uses for a pinned tensor), GPU read + write;
   time to pin 8 GiB; does cudaHostRegister honour RLIMIT_MEMLOCK?
2. the QSA sparse kernel reading K/V from host RAM over UVA equals the VRAM
   path bit for bit (decode rows with split-K + merge, and prefill rows), and
   the staged prefill (arena) path equals both; timings with CUDA events.
3. the staging dedup (mark / prefix sum / compact / rewrite) equals the first
   version's torch.unique at 512 x 2,051; its peak allocation against
   qsa_capacity.stage_transient_bytes at 244 blocks of 12,144 tokens (and the
   first version's peak); after warmup_staging + the arena's attention warmup,
   batches of other sizes and split parts at every offset compile nothing.
"""

import json
import os
import resource
import subprocess
import sys
import time

import torch

import pinned_host_pool as php
import qsa_host_kv as qhk
from dev_stubs import timed
from qsa_ops import qsa_sparse_paged_attention

OUT = os.environ.get("OUT", ".")
res = {"command": "cd _device/issue5 && python3 qsa_uva_device_check.py "
                   "(kit: scripts/bench/make_qsa_device_kit.py --tree <patched tree> --kit staging --out _device/issue5)",
       "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
cudart = torch.cuda.cudart()


def _device_ptr(host_ptr: int) -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.hostGetDevicePointer(host_ptr, 0))
    except Exception as e:  # noqa: BLE001
        res["device_ptr_fallback"] = repr(e)[:200]
        return host_ptr  # with UVA a registered range has the same address


class _CAI:
    def __init__(self, ptr, shape, typestr):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape,
                                         "typestr": typestr, "version": 3}


def uva_view(t: torch.Tensor) -> torch.Tensor:
    """Device view of a pinned host tensor (same call as vLLM's C op)."""
    flat = torch.as_tensor(_CAI(_device_ptr(t.data_ptr()), (t.nbytes,), "|u1"), device="cuda")
    return flat.view(t.dtype).view(t.shape) if t.dim() else flat


# ---- 1. pool ----
res["rlimit_memlock"] = resource.getrlimit(resource.RLIMIT_MEMLOCK)
res["mem_available_gib"] = php.read_mem_available() / 2**30
nbytes = 64 * 2**20 + 4096 + 5
pool = php.allocate_pinned_host_pool(nbytes, what="check", rank_label="dev")
t = pool.tensor
res["pool_exact_nbytes"] = t.nbytes == nbytes
res["pool_is_pinned"] = bool(t.is_pinned())
t.copy_(torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8))
v = uva_view(t)
res["uva_sum_matches"] = int(v.sum(dtype=torch.int64)) == int(t.sum(dtype=torch.int64))
v[-1] = 9
torch.cuda.synchronize()
res["uva_write_lands"] = int(t[-1]) == 9
del v
pool.release()

os.environ["VLLM_PINNED_POOL"] = "0"
import dev_stubs

dev_stubs.VLLM_PINNED_POOL = False
g = php.allocate_pinned_host_buffer(4096 + 3, what="gate off")
res["gate_off_torch_pinned"] = bool(g.is_pinned()) and g.nbytes == 4099
dev_stubs.VLLM_PINNED_POOL = True

big = 8 * 2**30
if php.read_mem_available() > big + 8 * 2**30:
    t0 = time.perf_counter()
    p8 = php.allocate_pinned_host_pool(big, what="8 GiB timing", rank_label="dev")
    res["pin_8gib_s"] = time.perf_counter() - t0
    res["pin_8gib_exact"] = p8.tensor.nbytes == big and bool(p8.tensor.is_pinned())
    p8.release()

# cudaHostRegister under a 1 MiB RLIMIT_MEMLOCK (fresh process, no flock check)
probe = r'''
import resource, mmap, numpy as np, torch
resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))
torch.cuda.init()
m = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
t = torch.from_numpy(np.frombuffer(m, dtype=np.uint8))
err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 0)
print("REGISTER_RESULT", int(err.value))
'''
r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
res["register_64mib_under_1mib_memlock"] = (r.stdout.strip().splitlines() or ["?"])[-1] + (
    "" if r.returncode == 0 else f" rc={r.returncode} {r.stderr[-300:]}")

# ---- 2. QSA kernel: host K/V over UVA vs VRAM vs staged ----
torch.manual_seed(0)
H_KV, GROUP, D = 2, 8, 256
BS, NB = 12_144, 8
TOPK = 2048 + 3
kv_host_bytes = NB * BS * H_KV * 2 * D * 2
backing = php.allocate_pinned_host_pool(kv_host_bytes, what="qsa host kv", rank_label="dev")
host_views = qhk.host_kv_layer_views(backing.tensor, 1, NB, BS, H_KV, D)
host_kv = host_views[0]
host_kv.copy_(torch.randn(host_kv.shape, dtype=torch.bfloat16))
uva_kv = uva_view(backing.tensor).view(torch.bfloat16)
uva_kv = uva_kv.view(NB, BS, H_KV, 2 * D).transpose(1, 2)
vram_kv = host_kv.to("cuda")
width = 22
table = torch.full((2, width), -1, dtype=torch.int32, device="cuda")
table[0, :4] = torch.tensor([3, 0, 6, 1], dtype=torch.int32)
table[1, :4] = torch.tensor([5, 2, 7, 4], dtype=torch.int32)
ctx = 4 * BS


def make(rows):
    q = torch.randn(rows, H_KV * GROUP, D, dtype=torch.bfloat16, device="cuda")
    gate = torch.randn(rows, H_KV * GROUP, D, dtype=torch.bfloat16, device="cuda")
    t2r = (torch.arange(rows, device="cuda") % 2).to(torch.int32)
    # sorted distinct positions per row, like a causal top-k
    idx = torch.sort(torch.rand(rows, ctx, device="cuda").topk(TOPK, dim=1).indices, dim=1).values
    packed = torch.cat([idx.to(torch.int32),
                        torch.full((rows, 1), TOPK, dtype=torch.int32, device="cuda")], 1)
    return q, gate, packed.contiguous(), t2r


def run(kv, q, gate, packed, t2r, prefill):
    k, vv = kv.transpose(1, 2).split(D, dim=-1)
    out = torch.empty_like(q)
    qsa_sparse_paged_attention(q, k, vv, packed, table, t2r, prefill, out, output_gate=gate)
    return out


arena = qhk.QSAStagingArena(4, BS, H_KV, D, "cuda")
res["arena_mib"] = arena.nbytes / 2**20
cases = {}
for rows, prefill in ((1, False), (4, False), (64, True), (512, True)):
    q, gate, packed, t2r = make(rows)
    ref = run(vram_kv, q, gate, packed, t2r, prefill)
    uva = run(uva_kv, q, gate, packed, t2r, prefill)
    st = torch.empty_like(q)
    qhk.staged_sparse_attention(qsa_sparse_paged_attention, q, uva_kv, D, packed, table, t2r,
                                prefill, st, gate, arena)
    sel_rows = packed[:, :-1].long() + (t2r.long() * 4 * BS)[:, None]
    c_unique = int(torch.unique(sel_rows).numel())
    c = {"uva_equals_vram": bool(torch.equal(uva, ref)),
         "staged_equals_vram": bool(torch.equal(st, ref)),
         "nonzero": bool(ref.abs().sum() > 0),
         "distinct_rows_selected": c_unique, "arena_rows": arena.rows,
         "vram_ms": timed(lambda: run(vram_kv, q, gate, packed, t2r, prefill)),
         "uva_ms": timed(lambda: run(uva_kv, q, gate, packed, t2r, prefill))}
    c["staged_ms"] = timed(lambda: qhk.staged_sparse_attention(
        qsa_sparse_paged_attention, q, uva_kv, D, packed, table, t2r, prefill, st, gate, arena))
    cases[f"rows{rows}_{'prefill' if prefill else 'decode'}"] = c
res["qsa"] = cases

# bind_host_kv_layers: real pool + UVA views for 2 layers, write via the view,
# read back on the host
from types import SimpleNamespace

layers = [SimpleNamespace(num_kv_heads=H_KV, head_dim=D) for _ in range(2)]
arena2 = qhk.bind_host_kv_layers(layers, num_blocks=3, block_size=BS, arena_layers=4,
                                 device="cuda")
layers[1].kv_cache[2, 1, BS - 1, -1] = 3.0
torch.cuda.synchronize()
host_last = layers[1].qsa_host_kv_backing.view(torch.bfloat16)[-1].item()
res["bind_host_kv"] = {"is_cuda_view": layers[0].kv_cache.is_cuda,
                       "backing_pinned": bool(layers[0].qsa_host_kv_backing.is_pinned()),
                       "write_lands_in_host": host_last == 3.0,
                       "arena_mib": arena2.nbytes / 2**20}


# ---- 3. staging dedup: equality, peak memory, no new variants ----
import qsa_capacity as qc
from qsa_ops import (
    _qsa_merge_splitk_kernel,
    _qsa_sparse_paged_gqa_splitk_kernel,
    warmup_qsa_sparse_paged_attention,
)


def reference_stage(kv_cache, packed, tbl, t2r):
    """The first version's dedup (int64 arithmetic + torch.unique)."""
    bs = kv_cache.shape[2]
    topk = packed.shape[1] - 1
    idx = packed[:, :topk].long()
    nreq, w = tbl.shape
    req = t2r.long()
    safe_idx = idx.clamp_min(0)
    page = safe_idx // bs
    valid = ((req >= 0) & (req < nreq))[:, None] & (idx >= 0) & (page < w)
    physical = tbl[req.clamp(0, nreq - 1)[:, None], page.clamp_max(w - 1)].long()
    valid &= (physical >= 0) & (physical < kv_cache.shape[0])
    slots = physical * bs + safe_idx % bs
    unique, inverse = torch.unique(slots[valid], sorted=True, return_inverse=True)
    new_idx = torch.full_like(packed, -1)
    new_idx[:, topk] = packed[:, topk]
    new_idx[:, :topk][valid] = inverse.to(torch.int32)
    return unique, new_idx


def peak_bytes(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out


dd = {}
stab = {}
try:
    q, gate, packed, t2r = make(512)
    t2r.zero_()  # one request: its 4 pages (48,576 rows) fit the arena
    packed[::7, 5] = -3  # invalid columns: negative index
    packed[::11, 9] = 5 * BS  # page 5: a hole in the table (-1)
    unique, want_idx = reference_stage(uva_kv, packed, table, t2r)
    staged = qhk.stage_selected_rows(uva_kv, packed, table, t2r, arena)
    dd["equals_torch_unique"] = staged is not None and bool(torch.equal(staged[1], want_idx))
    n = unique.numel()
    dd["arena_rows_equal"] = bool(torch.equal(
        arena.token_rows[:n], vram_kv.transpose(1, 2)[unique // BS, unique % BS]))
    dd["distinct"] = n
    dd["stage_ms"] = timed(lambda: qhk.stage_selected_rows(uva_kv, packed, table, t2r, arena))
    dd["torch_unique_stage_ms"] = timed(lambda: reference_stage(uva_kv, packed, table, t2r))
    # peak at the production slot space (783 MB: 244 blocks of 12,144 tokens);
    # the cache contents do not matter for the allocation, so it lives in VRAM
    big = torch.empty(244, BS, H_KV, 2 * D, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    mem = {}
    for rows in (1, 64, 512):
        qq, gg, pk, tr = make(rows)
        tr.zero_()  # fits the arena: the whole path runs
        measured, out = peak_bytes(lambda: qhk.stage_selected_rows(big, pk, table, tr, arena))
        old, _ = peak_bytes(lambda: reference_stage(big, pk, table, tr))
        mem[rows] = {"measured": measured, "fits": out is not None,
                     "stage_transient_bytes": qc.stage_transient_bytes(
                         rows, TOPK + 1, 244, BS, arena.rows, *table.shape),
                     "torch_unique_version": old}
    dd["peak_bytes_244_blocks"] = mem
    dd["transient_bound_holds"] = all(
        m["measured"] <= m["stage_transient_bytes"] for m in mem.values())
    del big


    def variants(fn):
        return sum(len(c[0]) for c in fn.device_caches.values())


    kernels = {k: getattr(qhk, k) for k in ("_qsa_stage_mark_kernel", "_qsa_stage_compact_kernel",
                                            "_qsa_stage_rows_kernel", "_qsa_stage_rewrite_kernel")}
    kernels["attention_splitk"] = _qsa_sparse_paged_gqa_splitk_kernel
    kernels["attention_merge"] = _qsa_merge_splitk_kernel
    # a fresh process would start empty; here earlier sections compiled some:
    # warm what startup warms, then count
    warmup_qsa_sparse_paged_attention(arena.kv_view, table, num_query_heads=H_KV * GROUP,
                                      selection_width=TOPK)
    qhk.warmup_staging(uva_kv, arena, table, max_rows=512, selection_width=TOPK)
    before = {k: variants(f) for k, f in kernels.items()}
    split_sizes = []
    real_attention = qsa_sparse_paged_attention


    def spy(q_, k, v, idx, tbl, tr, *a, **kw):
        split_sizes.append((q_.shape[0], tr.data_ptr() % 16, idx.data_ptr() % 16))
        return real_attention(q_, k, v, idx, tbl, tr, *a, **kw)


    for rows in (3, 22, 333, 511):
        qq, gg, pk, tr = make(rows)
        ref = run(vram_kv, qq, gg, pk, tr, True)
        st = torch.empty_like(qq)
        split_sizes.clear()
        qhk.staged_sparse_attention(spy, qq, uva_kv, D, pk, table, tr, True, st, gg, arena)
        stab[rows] = {"equal": bool(torch.equal(st, ref)), "parts": list(split_sizes)}
    after = {k: variants(f) for k, f in kernels.items()}
    dd["variants_before"] = before
    dd["variants_after"] = after
    dd["no_new_variants"] = before == after
    dd["split_runs"] = stab
    dd["all_parts_aligned"] = all(a == 0 and b == 0 for r in stab.values()
                                  for _, a, b in r["parts"])
except Exception:  # noqa: BLE001  (keep sections 1-2 and what ran)
    import traceback

    dd["error"] = traceback.format_exc()[-3000:]
res["staging_dedup"] = dd

res["ok"] = all([res["pool_exact_nbytes"], res["pool_is_pinned"], res["uva_sum_matches"],
                 res["uva_write_lands"]] + [c["uva_equals_vram"] and c["staged_equals_vram"]
                                            for c in cases.values()]
                + [res["bind_host_kv"]["write_lands_in_host"]]
                + [dd.get(k, False) for k in ("equals_torch_unique", "arena_rows_equal",
                                              "transient_bound_holds", "no_new_variants",
                                              "all_parts_aligned")]
                + [r["equal"] for r in stab.values()])
print(json.dumps(res, indent=1))
with open(os.path.join(OUT, "qsa_uva_check.json"), "w") as f:
    json.dump(res, f, indent=1)
