#!/usr/bin/env python3
"""Cold compile + load time of every 0500 MoE variant the startup warmup
(0900) builds for one MoE geometry: route + shared-expert GEMVs for M = 1..8,
the INT6 bit-plane GEMM for M = 1, 9, 16 (its classes), real shapes, a fresh
TRITON_CACHE_DIR. Needs a CUDA GPU; runs without vLLM with moe_fused.py on
PYTHONPATH (device kit).

  python3 scripts/bench/moe_warmup_time.py --json scripts/bench/results/moe_warmup_time_h200.json
"""
import argparse
import json
import os
import sys
import tempfile
import time

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--json", help="write the results here (default: $OUT/moe_warmup_time_h200.json if $OUT)")
args = ap.parse_args()
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # cold: nothing cached

import torch  # noqa: E402

try:
    from vllm.models.qwen4_exp.nvidia.ops import moe_fused as mf
except ImportError:  # bare torch + triton machine
    import moe_fused as mf

if not torch.cuda.is_available():
    sys.exit("needs a CUDA GPU (the time measured is the GPU compile + module load)")
E, TOPK, H, I = 512, 10, 2560, 640
dev = "cuda"
gw = torch.zeros(E, H, device=dev, dtype=torch.bfloat16)
sgw = torch.zeros(1, H, device=dev, dtype=torch.bfloat16)
p_gu = torch.zeros(2 * I, H * 3 // 16, device=dev, dtype=torch.int32)
p_dn = torch.zeros(H, I * 3 // 16, device=dev, dtype=torch.int32)
s_gu = torch.ones(2 * I, 1, device=dev, dtype=torch.bfloat16)
s_dn = torch.ones(H, 1, device=dev, dtype=torch.bfloat16)
counter = torch.zeros(1, dtype=torch.int32, device=dev)
torch.cuda.synchronize()
res = {}
def timed(name, fn):
    t0 = time.perf_counter(); fn(); torch.cuda.synchronize(); t1 = time.perf_counter()
    fn(); torch.cuda.synchronize(); t2 = time.perf_counter()
    res[name] = dict(first_s=round(t1 - t0, 3), second_s=round(t2 - t1, 5))
t_all = time.perf_counter()
for m in range(1, 9):
    x = torch.zeros(m, H, device=dev, dtype=torch.bfloat16)
    def one(x=x, m=m):
        tw, ti, s, e, n, lg, bs = mf.moe_route(x, gw, sgw, TOPK, counter)
        act = mf.shared_gate_up_silu(x, p_gu, s_gu, H)
        mf.shared_down_final(act, p_dn, s_dn, torch.zeros(m, TOPK, H, device=dev, dtype=torch.bfloat16), lg[:, E])
    timed(f"decode_m{m}", one)
for m in (1, 9, 16):
    x = torch.zeros(m, H, device=dev, dtype=torch.bfloat16)
    a = torch.zeros(m, I, device=dev, dtype=torch.bfloat16)
    timed(f"int6_gemm_m{m}", lambda x=x, a=a: (mf.int6_planes_linear(x, p_gu, s_gu, H), mf.int6_planes_linear(a, p_dn, s_dn, I)))
total = time.perf_counter() - t_all
variants = {k: len(getattr(mf, k).device_caches[0][0]) for k in ("_moe_route_kernel", "_shared_gate_up_silu_kernel", "_shared_down_final_kernel", "_int6_planes_gemm_kernel")}
out = dict(device=torch.cuda.get_device_name(), triton=__import__("triton").__version__, total_s=round(total, 2), variants=variants, per_step=res, command=" ".join(sys.argv))
print(json.dumps(out, indent=1))
dest = args.json or (os.path.join(os.environ["OUT"], "moe_warmup_time_h200.json") if "OUT" in os.environ else None)
if dest:
    with open(dest, "w") as f:
        json.dump(out, f, indent=1)
