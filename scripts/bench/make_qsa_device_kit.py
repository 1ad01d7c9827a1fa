#!/usr/bin/env python3
"""Build a self-contained kit for the QSA GPU checks and benchmarks on a
machine without vLLM (the device machine): copies of the patched modules a
kit exercises, taken from a patched vllm tree, with their few vllm imports
pointed at dev_stubs.py (logger, the upstream pin_tensor copied verbatim,
the VLLM_PINNED_POOL gate, the UVA view, CUDA-event timing), plus the scripts.

Kits:
  staging   0210-pinned-pool + 0220-qsa-kv-offload: pinned_host_pool.py,
            qsa_host_kv.py, ops/qsa.py, ops/qsa_row_cache.py (the arena
            writers drop 0250's tags); qsa_uva_device_check.py,
            bench_qsa_staging.py
  rowcache  0250-qsa-row-cache: ops/qsa.py, ops/qsa_row_cache.py; the
            randomized-step simulator, test_qsa_row_cache_gpu.py,
            bench_qsa_row_cache.py

  python3 scripts/vllm_patches.py tree /tmp/tree
  python3 scripts/bench/make_qsa_device_kit.py --tree /tmp/tree --kit staging --out _device/qsa
  (device) cd _device/qsa && python3 bench_qsa_staging.py --json $OUT/x.json
  python3 scripts/bench/make_qsa_device_kit.py --tree /tmp/tree --kit rowcache --out _device/rowcache
  (device) cd _device/rowcache && python3 test_qsa_row_cache_gpu.py --json $OUT/check.json
"""

import argparse
import ast
import re
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
NV = "models/qwen4_exp/nvidia"

# One substitution list for every kit: a pattern that a module lacks is a no-op.
SUBS = [
    (r"^from vllm\.logger import init_logger$", "from dev_stubs import init_logger"),
    (r"^    from vllm\.v1\.simple_kv_offload\.cuda_mem_ops import pin_tensor$",
     "    from dev_stubs import pin_tensor"),
    (r"^    import vllm\.envs as envs$", "    import dev_stubs as envs"),
    (r"^    from vllm\.v1\.worker\.pinned_host_pool import", "    from pinned_host_pool import"),
    (r"^        from vllm\.utils\.torch_utils import get_accelerator_view_from_cpu_tensor$",
     "        from dev_stubs import get_accelerator_view_from_cpu_tensor"),
    (r"^from vllm\.model_executor\.warmup\.jit_warmup_triton_helper import \($",
     "from dev_stubs import ("),
    # only allocate_host_resident_kv uses it, which the kits never call
    (r"^    from vllm\.v1\.kv_cache_interface import \($", "    from dev_stubs import ("),
    (r"^from vllm\.triton_utils import HAS_TRITON, tl, triton$",
     "import triton\nimport triton.language as tl\nHAS_TRITON = True"),
    (r"^from vllm\.triton_utils import tl, triton$", "import triton\nimport triton.language as tl"),
    (r"^from \.qsa import ", "from qsa_ops import "),
    # 0220's arena writers drop 0250's row-cache tags; 0250 finds a layer's arena
    (r"^    from \.ops import qsa_row_cache$", "    import qsa_row_cache"),
    (r"^(\s+)from \.\.qsa_host_kv import ", r"\1from qsa_host_kv import "),
]

KITS = {
    "staging": {
        "modules": [("v1/worker/pinned_host_pool.py", "pinned_host_pool.py"),
                    (f"{NV}/qsa_host_kv.py", "qsa_host_kv.py"),
                    (f"{NV}/ops/qsa.py", "qsa_ops.py"),
                    (f"{NV}/ops/qsa_row_cache.py", "qsa_row_cache.py"),
                    ("models/qwen4_exp/common/qsa_capacity.py", "qsa_capacity.py")],
        "files": [HERE / "qsa_uva_device_check.py", HERE / "bench_qsa_staging.py"],
        "strict": True,
    },
    "rowcache": {
        "modules": [(f"{NV}/ops/qsa.py", "qsa_ops.py"),
                    (f"{NV}/ops/qsa_row_cache.py", "qsa_row_cache.py")],
        "files": [REPO / "tests/qsa/qsa_row_cache_sim.py",
                  REPO / "tests/qsa/test_qsa_row_cache_gpu.py", HERE / "bench_qsa_row_cache.py"],
        "strict": False,
    },
}


def port(text: str, src: str, strict: bool) -> str:
    for pat, rep in SUBS:
        text = re.sub(pat, rep, text, flags=re.M)
    # strict: no vllm import left at all (the kit calls everything it copies);
    # else function-local imports of serving hooks the kit never calls may stay
    pat = r"^\s*(from|import) (vllm|\.)" if strict else r"^(from|import) (vllm|\.)"
    left = [ln for ln in text.splitlines() if re.match(pat, ln)]
    if left:
        raise SystemExit(f"{src}: unhandled vllm import(s): {left}; add a rule to SUBS")
    return text


def build(tree: Path, kit: str, out: Path) -> list[str]:
    v = tree / "vllm"
    if not v.is_dir():
        raise SystemExit(f"{tree}: no vllm/ here; make one with `scripts/vllm_patches.py tree DIR`")
    out.mkdir(parents=True, exist_ok=True)
    spec = KITS[kit]
    for src, dst in spec["modules"]:
        (out / dst).write_text(port((v / src).read_text(), src, spec["strict"]))
    mem_ops = (v / "v1/simple_kv_offload/cuda_mem_ops.py").read_text()
    fn = next(n for n in ast.parse(mem_ops).body
              if isinstance(n, ast.FunctionDef) and n.name == "pin_tensor")
    # the warmup helpers the kernels' warmup functions take, verbatim
    helper = (v / "model_executor/warmup/jit_warmup_triton_helper.py").read_text()
    warm = []
    for n in ast.parse(helper).body:
        if getattr(n, "name", None) in ("TritonWarmupTensor", "triton_scalar_specialization_rep"):
            decorators = "".join(f"@{ast.get_source_segment(helper, d)}\n" for d in n.decorator_list)
            warm.append(decorators + ast.get_source_segment(helper, n))
    (out / "dev_stubs.py").write_text((HERE / "qsa_device_stubs.py.in").read_text() + "\n\n"
                                      + ast.get_source_segment(mem_ops, fn) + "\n\n\n"
                                      + "\n\n\n".join(warm) + "\n")
    for f in spec["files"]:
        shutil.copy(f, out / f.name)
    return sorted(p.name for p in out.iterdir())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", required=True, help="patched tree (scripts/vllm_patches.py tree)")
    p.add_argument("--kit", choices=sorted(KITS), default="staging")
    p.add_argument("--out", required=True, help="kit folder to write")
    a = p.parse_args()
    names = build(Path(a.tree), a.kit, Path(a.out))
    print(f"kit {a.kit} in {a.out}: {' '.join(names)}")


if __name__ == "__main__":
    main()
