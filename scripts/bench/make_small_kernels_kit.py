#!/usr/bin/env python3
"""Build a self-contained kit for bench_small_kernels.py on a machine without
vLLM (the device machine: torch 2.11, triton 3.6): the small kernels of the
series, copied VERBATIM out of a patched vllm tree, with only triton imports
in front of them (no vllm stub is needed: the kernels are copied by AST, their
launchers are re-stated in the bench with the production launch arguments).

  0650  get_aligned_state_indices_multi_group_kernel  (v1/worker/mamba_utils.py)
  0100  _ple_ngram_ids_kernel                         (models/qwen4_exp/nvidia/ops/ple.py)
  0500  ops/moe_fused.py, the whole module (it imports only torch and triton):
        _int6_planes_gemm_kernel via int6_planes_linear

  python3 scripts/vllm_patches.py tree /tmp/tree      # or a venv's patched site-packages
  python3 scripts/bench/make_small_kernels_kit.py --tree /tmp/tree --out .devkit-kmore
  (device) cd .devkit-kmore && python3 bench_small_kernels.py --json $OUT/small_kernels_h200.json
"""

import argparse
import ast
import importlib.util
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
NV = "models/qwen4_exp/nvidia"
HEADER = "import triton\nimport triton.language as tl\n\n\n"
# (source module, kernel names) -> small_kernels.py
EXTRACT = [("v1/worker/mamba_utils.py", ["get_aligned_state_indices_multi_group_kernel"]),
           (f"{NV}/ops/ple.py", ["_ple_ngram_ids_kernel"])]
WHOLE = [(f"{NV}/ops/moe_fused.py", "moe_fused.py")]
FILES = [HERE / "bench_small_kernels.py", HERE / "cuda_graph_timing.py"]


def default_tree() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no vllm importable: pass --tree (scripts/vllm_patches.py tree DIR)")
    return Path(list(spec.submodule_search_locations)[0]).parent


def extract(text: str, names: list[str], src: str) -> list[str]:
    found = {}
    for n in ast.parse(text).body:
        if isinstance(n, ast.FunctionDef) and n.name in names:
            deco = "".join(f"@{ast.get_source_segment(text, d)}\n" for d in n.decorator_list)
            found[n.name] = f"# from vllm/{src}, verbatim\n" + deco + ast.get_source_segment(text, n)
    missing = set(names) - set(found)
    if missing:
        raise SystemExit(f"{src}: {sorted(missing)} not found; is the tree patched (0100/0650)?")
    return [found[n] for n in names]


def build(tree: Path, out: Path) -> list[str]:
    v = tree / "vllm"
    if not v.is_dir():
        raise SystemExit(f"{tree}: no vllm/ here; make one with `scripts/vllm_patches.py tree DIR`")
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    for src, names in EXTRACT:
        parts += extract((v / src).read_text(), names, src)
    (out / "small_kernels.py").write_text(HEADER + "\n\n\n".join(parts) + "\n")
    for src, dst in WHOLE:
        text = (v / src).read_text()
        bad = [ln for ln in text.splitlines() if ln.startswith(("from vllm", "import vllm", "from ."))]
        if bad:
            raise SystemExit(f"{src}: imports {bad}; the kit copies it whole, so stub them")
        (out / dst).write_text(text)
    for f in FILES:
        shutil.copy(f, out / f.name)
    return sorted(p.name for p in out.iterdir() if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", type=Path, help="folder holding a patched vllm/ (default: the importable vllm's)")
    p.add_argument("--out", required=True, type=Path, help="kit folder to write")
    a = p.parse_args()
    names = build(a.tree or default_tree(), a.out)
    print(f"kit in {a.out}: {' '.join(names)}")


if __name__ == "__main__":
    main()
