#!/usr/bin/env python3
"""Build the self-contained kit for the 0250-qsa-row-cache GPU check and
benchmark on a machine without vLLM: ops/qsa.py (the upstream split-K and
merge kernels, the uncached reference) as qsa_ops.py and
ops/qsa_row_cache.py as qsa_row_cache.py, copied from a patched vllm tree
with their vllm imports pointed at plain triton / the kit, plus the
randomized-step simulator, the GPU check and the benchmark.

  python3 scripts/bench/make_qsa_row_cache_kit.py --tree /work/dev-rowcache --out <repo>/_device/rowcache
  (device) cd _device/rowcache && python3 test_qsa_row_cache_gpu.py --json $OUT/check.json
           python3 bench_qsa_row_cache.py --json $OUT/bench.json
"""

import argparse
import re
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

SUBS = [
    (r"^from vllm\.model_executor\.warmup\.jit_warmup_triton_helper import \($",
     "from dev_stubs import ("),
    (r"^from vllm\.triton_utils import HAS_TRITON, tl, triton$",
     "import triton\nimport triton.language as tl\nHAS_TRITON = True"),
    (r"^from vllm\.triton_utils import tl, triton$", "import triton\nimport triton.language as tl"),
    (r"^from \.qsa import ", "from qsa_ops import "),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", required=True, help="patched tree (scripts/vllm_patches.py tree)")
    p.add_argument("--out", required=True, help="kit folder to write")
    a = p.parse_args()
    ops = Path(a.tree) / "vllm/models/qwen4_exp/nvidia/ops"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for src, dst in (("qsa.py", "qsa_ops.py"), ("qsa_row_cache.py", "qsa_row_cache.py")):
        text = (ops / src).read_text()
        for pat, rep in SUBS:
            text = re.sub(pat, rep, text, flags=re.M)
        # only the function-local imports of the serving hooks may remain
        top = [ln for ln in text.splitlines()
               if re.match(r"^(from|import) (vllm|\.)", ln)]
        if top:
            raise SystemExit(f"{src}: unhandled import(s): {top}")
        (out / dst).write_text(text)
    shutil.copy(HERE / "qsa_device_stubs.py.in", out / "dev_stubs.py")
    for f in (REPO / "tests/qsa/qsa_row_cache_sim.py", REPO / "tests/qsa/test_qsa_row_cache_gpu.py",
              HERE / "bench_qsa_row_cache.py"):
        shutil.copy(f, out / f.name)
    print(f"kit in {out}")


if __name__ == "__main__":
    main()
