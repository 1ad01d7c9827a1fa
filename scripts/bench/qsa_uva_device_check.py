"""Device check for issue 5 (0210-pinned-pool, 0220-qsa-kv-offload).

Runs from the kit that make_qsa_device_kit.py builds (no vLLM needed):
  python3 scripts/bench/make_qsa_device_kit.py --tree /tmp/tree-5 --kit staging --out _device/issue5
  (device) cd _device/issue5 && python3 qsa_uva_device_check.py   # JSON to $OUT
Results: scripts/bench/results/qsa_uva_h200*.json.

1. exact-size pool: anonymous mmap + the upstream pin_tensor (cudaHostRegister),
   is_pinned, a UVA device pointer (cudaHostGetDevicePointer, what vLLM's
   get_cuda_view_from_cpu_tensor uses for a pinned tensor), GPU read + write;
   time to pin 8 GiB; does cudaHostRegister honour RLIMIT_MEMLOCK?
2. the QSA sparse kernel reading K/V from host RAM over UVA equals the VRAM
   path bit for bit (decode rows with split-K + merge, and prefill rows), and
   the staged prefill (arena) path equals both; timings with CUDA events.
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
res["ok"] = all([res["pool_exact_nbytes"], res["pool_is_pinned"], res["uva_sum_matches"],
                 res["uva_write_lands"]] + [c["uva_equals_vram"] and c["staged_equals_vram"]
                                            for c in cases.values()]
                + [res["bind_host_kv"]["write_lands_in_host"]])
print(json.dumps(res, indent=1))
with open(os.path.join(OUT, "qsa_uva_h200_run2.json"), "w") as f:
    json.dump(res, f, indent=1)
