#!/usr/bin/env python3
"""Build a self-contained kit for the QSA GPU checks and benchmarks on a
machine without vLLM (the device machine): copies of the patched modules a
kit exercises, taken from a patched vllm tree, with their few vllm imports
pointed at dev_stubs.py (logger, the upstream pin_tensor copied verbatim,
the VLLM_PINNED_POOL gate, the UVA view, CUDA-event timing), plus the scripts.

Kits:
  staging   0210-pinned-pool + 0220-qsa-kv-offload: pinned_host_pool.py,
            qsa_host_kv.py, ops/qsa.py, ops/qsa_row_cache.py (the arena
            writers drop 0250's tags), ops/qsa_fp8.py (0260, which both
            import); qsa_uva_device_check.py,
            bench_qsa_staging.py
  rowcache  0250-qsa-row-cache: ops/qsa.py, ops/qsa_fp8.py, ops/qsa_row_cache.py; the
            randomized-step simulator, test_qsa_row_cache_gpu.py,
            bench_qsa_row_cache.py
  fp8       0260-qsa-kv-fp8: the staging modules + ops/qsa_fp8.py, vLLM
            0.33.0's ops/qsa.py read from its wheel (--v033-wheel, as
            qsa_ops_v033.py), optionally the pinned wheel's compiled _C
            (--with-c: its reshape_and_cache_flash, xz, about 54 MB);
            qsa_fp8_device_check.py, bench_qsa_row_cache.py and
            bench_qsa_staging.py (their selection generators)

  python3 scripts/vllm_patches.py tree /tmp/tree
  python3 scripts/bench/make_qsa_device_kit.py --tree /tmp/tree --kit staging --out _device/qsa
  (device) cd _device/qsa && python3 bench_qsa_staging.py --json $OUT/x.json
  python3 scripts/bench/make_qsa_device_kit.py --tree /tmp/tree --kit rowcache --out _device/rowcache
  (device) cd _device/rowcache && python3 test_qsa_row_cache_gpu.py --json $OUT/check.json
  python3 scripts/bench/make_qsa_device_kit.py --tree /tmp/tree --kit fp8 \
      --v033-wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl --with-c --out _device/fp8
  (device) cd _device/fp8 && python3 qsa_fp8_device_check.py \
      --c-so _C_stable_libtorch.abi3.so.xz --json $OUT/qsa_fp8_h200.json
"""

import argparse
import ast
import re
import shutil
import zipfile
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
    # 0260-qsa-kv-fp8: the FP8 kernel module (top level in the row cache,
    # function-local in ops/qsa.py); 0.33.0's ops/qsa.py asks the platform
    (r"^(\s*)from \.qsa_fp8 import ", r"\1from qsa_fp8 import "),
    (r"^from vllm\.platforms import current_platform$", "from dev_stubs import current_platform"),
    # 0220's arena writers drop 0250's row-cache tags; 0250 finds a layer's arena
    (r"^    from \.ops import qsa_row_cache$", "    import qsa_row_cache"),
    (r"^(\s+)from \.\.qsa_host_kv import ", r"\1from qsa_host_kv import "),
]

KITS = {
    "staging": {
        "modules": [("v1/worker/pinned_host_pool.py", "pinned_host_pool.py"),
                    (f"{NV}/qsa_host_kv.py", "qsa_host_kv.py"),
                    (f"{NV}/ops/qsa.py", "qsa_ops.py"),
                    (f"{NV}/ops/qsa_fp8.py", "qsa_fp8.py"),
                    (f"{NV}/ops/qsa_row_cache.py", "qsa_row_cache.py"),
                    ("models/qwen4_exp/common/qsa_capacity.py", "qsa_capacity.py")],
        "files": [HERE / "qsa_uva_device_check.py", HERE / "bench_qsa_staging.py"],
        "strict": True,
    },
    "rowcache": {
        "modules": [(f"{NV}/ops/qsa.py", "qsa_ops.py"),
                    (f"{NV}/ops/qsa_fp8.py", "qsa_fp8.py"),
                    (f"{NV}/ops/qsa_row_cache.py", "qsa_row_cache.py")],
        "files": [REPO / "tests/qsa/qsa_row_cache_sim.py",
                  REPO / "tests/qsa/test_qsa_row_cache_gpu.py", HERE / "bench_qsa_row_cache.py"],
        "strict": False,
    },
    "fp8": {
        "modules": [("v1/worker/pinned_host_pool.py", "pinned_host_pool.py"),
                    (f"{NV}/qsa_host_kv.py", "qsa_host_kv.py"),
                    (f"{NV}/ops/qsa.py", "qsa_ops.py"),
                    (f"{NV}/ops/qsa_fp8.py", "qsa_fp8.py"),
                    (f"{NV}/ops/qsa_row_cache.py", "qsa_row_cache.py"),
                    ("models/qwen4_exp/common/qsa_capacity.py", "qsa_capacity.py")],
        "files": [HERE / "qsa_fp8_device_check.py", HERE / "bench_qsa_row_cache.py",
                  HERE / "bench_qsa_staging.py", HERE / "bench_upstream_baselines.py"],
        "strict": True,
    },
}
V033_MEMBER = f"vllm/{NV}/ops/qsa.py"


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


def add_v033(wheel: Path, out: Path) -> None:
    """vLLM 0.33.0's ops/qsa.py (the FP8 kernel the series backports), read
    from the release wheel, its vllm imports pointed at dev_stubs."""
    with zipfile.ZipFile(wheel) as z:
        text = z.read(V033_MEMBER).decode()
    (out / "qsa_ops_v033.py").write_text(port(text, f"{wheel.name}:{V033_MEMBER}", True))


def add_c(out: Path) -> None:
    """The pinned wheel's compiled _C (stable libtorch ABI, loads on the device's
    torch as is), xz-compressed as make_upstream_kit.py packs it: its
    reshape_and_cache_flash writes FP8 bytes."""
    import sys

    sys.path.insert(0, str(HERE))
    from make_upstream_kit import SOS, _vllm_dir, xz_pack

    src = _vllm_dir(None) / SOS["_C"]
    xz_pack(src, out / (src.name + ".xz"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", required=True, help="patched tree (scripts/vllm_patches.py tree)")
    p.add_argument("--kit", choices=sorted(KITS), default="staging")
    p.add_argument("--out", required=True, help="kit folder to write")
    p.add_argument("--v033-wheel", help="fp8 kit: the vllm-0.33.0 wheel (python3 -m pip download "
                   "vllm==0.33.0 --no-deps -d DIR)")
    p.add_argument("--with-c", action="store_true",
                   help="fp8 kit: pack the installed pinned vllm's _C (the real cache write)")
    a = p.parse_args()
    if a.kit == "fp8" and not a.v033_wheel:
        p.error("--kit fp8 needs --v033-wheel (the 0.33.0 wheel its kernel is compared with)")
    names = build(Path(a.tree), a.kit, Path(a.out))
    if a.v033_wheel:
        add_v033(Path(a.v033_wheel), Path(a.out))
    if a.with_c:
        add_c(Path(a.out))
    names = sorted(p.name for p in Path(a.out).iterdir())
    print(f"kit {a.kit} in {a.out}: {' '.join(names)}")


if __name__ == "__main__":
    main()
