#!/usr/bin/env python3
"""Build the self-contained kit for the hyper-connection GPU benchmarks and
checks on a machine without vLLM (the device machine): ops/hc_int8.py of
patch 0400 (imports only torch and triton), upstream 0.30.0 ops/hc.py (its
few vllm imports are stubbed by bench_hc_fused.load_upstream_hc), the
benchmark scripts, tests/hc/test_hc_fused_gpu.py and a run.sh.

  python3 scripts/vllm_patches.py tree /tmp/tree
  python3 scripts/bench/make_hc_device_kit.py --tree /tmp/tree --out .devkit-hc
  (device) bash .devkit-hc/run.sh     # $OUT/hc_prefill_h200.json, log, pytest.log
"""

import argparse
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
OPS = "vllm/models/qwen4_exp/nvidia/ops"

RUN_SH = """#!/bin/bash
# (device) bash run.sh [bench args]: writes $OUT/hc_prefill_h200.json, $OUT/log, $OUT/pytest.log
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONUNBUFFERED=1 python3 bench_hc_prefill.py --kernels hc_int8.py --upstream-hc upstream_hc.py \\
  --sweep --json "$OUT/hc_prefill_h200.json" "$@" 2>&1 | tee "$OUT/log"
HC_INT8_PATH=hc_int8.py timeout 120 python3 -m pytest -x -q test_hc_fused_gpu.py 2>&1 \\
  | tail -15 | tee "$OUT/pytest.log"
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", required=True, type=Path,
                    help="patched vllm tree (scripts/vllm_patches.py tree DIR)")
    ap.add_argument("--out", required=True, type=Path, help="kit directory (replaced)")
    args = ap.parse_args()
    src = args.tree / OPS / "hc_int8.py"
    if not src.exists():
        raise SystemExit(f"{src} missing: build the tree with scripts/vllm_patches.py tree DIR")
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    shutil.copy(src, args.out / "hc_int8.py")
    # Upstream's glue kernels as released (no patch of the series edits them).
    upstream = subprocess.run(["git", "-C", str(args.tree), "show", f"pristine:{OPS}/hc.py"],
                              check=True, capture_output=True).stdout
    (args.out / "upstream_hc.py").write_bytes(upstream)
    for f in (HERE / "bench_hc_prefill.py", HERE / "bench_hc_fused.py",
              HERE / "cuda_graph_timing.py", REPO / "tests/hc/test_hc_fused_gpu.py"):
        shutil.copy(f, args.out / f.name)
    (args.out / "run.sh").write_text(RUN_SH)
    print(f"kit in {args.out}: " + ", ".join(sorted(p.name for p in args.out.iterdir())))


if __name__ == "__main__":
    main()
