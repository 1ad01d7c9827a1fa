#!/usr/bin/env python3
"""Build the self-contained kit that qsa_uva_device_check.py runs from on a
GPU machine without vLLM: copies of the patched modules it exercises
(pinned_host_pool.py, qsa_host_kv.py, ops/qsa.py) from a patched vllm tree,
with their few vllm imports pointed at dev_stubs.py (logger, the upstream
pin_tensor copied verbatim, the VLLM_PINNED_POOL gate).

  python3 scripts/bench/make_qsa_device_kit.py --tree /tmp/tree-5 --out _device/issue5
"""

import argparse
import ast
import re
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", required=True, help="patched tree (scripts/vllm_patches.py tree)")
    p.add_argument("--out", required=True, help="kit folder to write")
    a = p.parse_args()
    v = Path(a.tree) / "vllm"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    subs = [
        (r"^from vllm\.logger import init_logger$", "from dev_stubs import init_logger"),
        (r"^    from vllm\.v1\.simple_kv_offload\.cuda_mem_ops import pin_tensor$",
         "    from dev_stubs import pin_tensor"),
        (r"^    import vllm\.envs as envs$", "    import dev_stubs as envs"),
        (r"^    from vllm\.v1\.worker\.pinned_host_pool import", "    from pinned_host_pool import"),
        (r"^        from vllm\.utils\.torch_utils import get_accelerator_view_from_cpu_tensor$",
         "        from dev_stubs import get_accelerator_view_from_cpu_tensor"),
        (r"^from vllm\.model_executor\.warmup\.jit_warmup_triton_helper import \($",
         "from dev_stubs import ("),
        # only allocate_host_resident_kv uses it, which the kit never calls
        (r"^    from vllm\.v1\.kv_cache_interface import \($", "    from dev_stubs import ("),
        (r"^from vllm\.triton_utils import HAS_TRITON, tl, triton$",
         "import triton\nimport triton.language as tl\nHAS_TRITON = True"),
    ]
    for src, dst in [("v1/worker/pinned_host_pool.py", "pinned_host_pool.py"),
                     ("models/qwen4_exp/nvidia/qsa_host_kv.py", "qsa_host_kv.py"),
                     ("models/qwen4_exp/nvidia/ops/qsa.py", "qsa_ops.py")]:
        text = (v / src).read_text()
        for pat, rep in subs:
            text = re.sub(pat, rep, text, flags=re.M)
        if "from vllm" in text or "import vllm" in text:
            left = [ln for ln in text.splitlines() if "vllm" in ln and "import" in ln]
            raise SystemExit(f"{src}: unhandled vllm import(s): {left}")
        (out / dst).write_text(text)
    mem_ops = (v / "v1/simple_kv_offload/cuda_mem_ops.py").read_text()
    fn = next(n for n in ast.parse(mem_ops).body
              if isinstance(n, ast.FunctionDef) and n.name == "pin_tensor")
    (out / "dev_stubs.py").write_text(
        (HERE / "qsa_device_stubs.py.in").read_text() + "\n\n" + ast.get_source_segment(mem_ops, fn) + "\n")
    for script in ("qsa_uva_device_check.py", "bench_qsa_staging.py"):
        shutil.copy(HERE / script, out / script)
    print(f"kit in {out}: run `python3 qsa_uva_device_check.py` or "
          "`python3 bench_qsa_staging.py --json $OUT/x.json` there")


if __name__ == "__main__":
    main()
