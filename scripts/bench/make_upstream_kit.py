#!/usr/bin/env python3
"""Build the device kit for bench_upstream_baselines.py: upstream's real
kernels vs the series' fused ones on a machine without vLLM.

The upstream kernels are the pinned wheel's own compiled extension,
vllm/_moe_C_stable_libtorch.abi3.so (vLLM 0.30.0, commit gced6857af per
vllm/_version.py), copied xz-compressed out of the installed package: it is
built against torch's stable libtorch ABI, so torch.ops.load_library loads it
on the device's torch (2.11, CUDA 13) as is, the same code the image runs,
with no rebuild. `--so _C` packs vllm/_C_stable_libtorch.abi3.so instead
(AllSpark, Machete, Marlin and their weight repack ops, for
bench_upstream_baselines.py --hc-c): 78 MB -> about 54 MB xz, so a kit carries
one of the two, never both (a device call carries at most 64 MiB).

Also copied: the series' kernel modules (ops/moe_fused.py of 0500, ops/hc_int8.py
of 0400; neither imports vllm), upstream's ops/hc.py as upstream_hc.py (loaded
with stubs by bench_hc_fused.load_upstream_hc), and the bench scripts.
MANIFEST.json records the sha256 of each .so and the vllm version/commit.

Humming (the `_moe_C` kit): 0.30.0 runs this checkpoint's INT6 shared expert
through the `humming` package (humming-kernels, a JIT CUDA GEMM library;
HummingLinearKernel is the only mixed-precision kernel that accepts uint6b32).
The kit copies the installed package as is (pure Python + its prebuilt
launcher/NVRTC helper, 2.2 MB; the device has no network) and writes
upstream_humming.py: vLLM's own HummingLinearKernel methods and the
humming_utils.py functions they call, copied verbatim out of the wheel (its
lazy facade vllm/utils/humming.py as vllm_utils_humming.py), with the two env
flags at their 0.30.0 defaults. --no-humming leaves it out.

  python3 scripts/bench/make_upstream_kit.py --out /work/main/.devkit-upstream
  (device) cd .devkit-upstream && python3 bench_upstream_baselines.py \\
      --moe-c _moe_C_stable_libtorch.abi3.so.xz --skip hc \\
      --json $OUT/upstream_baselines_humming.json

  python3 scripts/bench/make_upstream_kit.py --so _C --out /work/main/.devkit-hcc
  (device) cd .devkit-hcc && python3 bench_upstream_baselines.py --hc-c \\
      --c-so _C_stable_libtorch.abi3.so.xz --json $OUT/upstream_baselines_hc.json
"""

import argparse
import ast
import hashlib
import json
import lzma
import re
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
OPS = "models/qwen4_exp/nvidia/ops"
MODULES = [(f"{OPS}/moe_fused.py", "moe_fused.py"), (f"{OPS}/hc_int8.py", "hc_int8.py"),
           (f"{OPS}/hc.py", "upstream_hc.py")]
SCRIPTS = ["bench_upstream_baselines.py", "bench_hc_fused.py", "cuda_graph_timing.py"]
SOS = {"_moe_C": "_moe_C_stable_libtorch.abi3.so", "_C": "_C_stable_libtorch.abi3.so"}
HUMMING_UTILS = "model_executor/layers/quantization/utils/humming_utils.py"
HUMMING_KERNEL = "model_executor/kernels/linear/mixed_precision/humming.py"
HUMMING_FNS = ["convert_linear_layer_to_humming_standard", "prepare_humming_linear_layer_config",
               "get_humming_linear_compute_config", "apply_humming_linear"]
HUMMING_HEAD = '''"""vLLM 0.30.0's Humming linear path, copied verbatim out of the pinned
wheel by make_upstream_kit.py (nothing here is written by the series):
HummingLinearKernel's process_weights_after_loading / apply_weights
(vllm/{kernel}) and the functions they call
(vllm/{utils}); vllm.utils.humming (the lazy
facade) is vllm_utils_humming.py. Stubs: envs (the two flags read, at their
0.30.0 defaults) and MPLinearKernel.__init__ (the fields the methods read)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch

LinearBase = torch.nn.Module
envs = SimpleNamespace(VLLM_BATCH_INVARIANT=False, VLLM_HUMMING_USE_F16_ACCUM=False)


class MPLinearKernel:
    def __init__(self, c, w_q_param_name, w_s_param_name, w_zp_param_name=None):
        self.config = c
        self.w_q_name = w_q_param_name
        self.w_s_name = w_s_param_name
        self.w_zp_name = w_zp_param_name
'''


def _humming_dir(arg):
    if arg:
        return Path(arg)
    import importlib.util

    spec = importlib.util.find_spec("humming")
    return Path(spec.origin).parent if spec and spec.origin else None


def upstream_humming_source(vdir: Path) -> str:
    """upstream_humming.py: the wheel's own Humming linear code, verbatim."""
    utils = (vdir / HUMMING_UTILS).read_text()
    tree = ast.parse(utils)
    fns = {n.name: ast.get_source_segment(utils, n) for n in tree.body
           if isinstance(n, ast.FunctionDef) and n.name in HUMMING_FNS}
    missing = set(HUMMING_FNS) - set(fns)
    if missing:
        raise SystemExit(f"{vdir / HUMMING_UTILS}: no {sorted(missing)} (not vLLM 0.30.0?)")
    kern = (vdir / HUMMING_KERNEL).read_text()
    cls = next(n for n in ast.parse(kern).body
               if isinstance(n, ast.ClassDef) and n.name == "HummingLinearKernel")
    methods = [ast.get_source_segment(kern, m) for m in cls.body
               if isinstance(m, ast.FunctionDef)
               and m.name in ("process_weights_after_loading", "apply_weights")]
    body = "\n\n\n".join(fns[f] for f in HUMMING_FNS)
    body += "\n\n\nclass HummingLinearKernel(MPLinearKernel):\n" + "\n\n".join(
        "    " + m for m in methods) + "\n"  # a segment's first line lost its indent
    body = body.replace("from vllm.utils.humming import", "from vllm_utils_humming import")
    body = body.replace("from vllm.model_executor.layers.quantization.utils.humming_utils import",
                        "from upstream_humming import")
    left = [ln for ln in body.splitlines() if "vllm." in ln and "import" in ln]
    if left:
        raise SystemExit(f"upstream_humming.py: unhandled vllm import(s) {left}")
    return HUMMING_HEAD.format(kernel=HUMMING_KERNEL, utils=HUMMING_UTILS) + "\n\n" + body


def _vllm_dir(arg):
    if arg:
        return Path(arg)
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("vllm is not importable here: pass --vllm DIR (the patched package dir)")
    return Path(spec.origin).parent


def _sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def xz_pack(src: Path, dst: Path, old_sha: str | None = None) -> dict:
    """xz-compress one compiled extension into a kit (kept when ``dst`` already
    holds the same sha256); its manifest entry."""
    info = {"sha256": _sha(src), "bytes": src.stat().st_size, "packed": True}
    if not (dst.exists() and old_sha == info["sha256"]):
        # _moe_C 45 -> 38 MB, _C 78 -> ~54 MB: a minute or two on 2 cores
        with open(src, "rb") as f, lzma.open(dst, "wb", preset=6) as g:
            shutil.copyfileobj(f, g)
    info["xz_bytes"] = dst.stat().st_size
    return info


def build(vdir: Path, out: Path, pack_so: bool = True, which: str = "_moe_C",
          humming: Path | None = None) -> dict:
    if not (vdir / OPS / "moe_fused.py").exists() or not (vdir / OPS / "hc_int8.py").exists():
        raise SystemExit(f"{vdir}: no {OPS}/moe_fused.py / hc_int8.py: apply the series "
                         "(scripts/test.sh does) or pass --vllm of a patched tree")
    out.mkdir(parents=True, exist_ok=True)
    for src, dst in MODULES:
        shutil.copy(vdir / src, out / dst)
    for s in SCRIPTS:
        shutil.copy(HERE / s, out / s)
    ver = (vdir / "_version.py").read_text() if (vdir / "_version.py").exists() else ""
    man = {"vllm_version": (re.findall(r"__version__ = version = '([^']+)'", ver) or ["?"])[0],
           "vllm_commit": (re.findall(r"__commit_id__ = commit_id = '([^']+)'", ver) or ["?"])[0],
           "so": {}}
    for so in [SOS[which]]:
        src = vdir / so
        if pack_so:
            old = out / "MANIFEST.json"
            old_sha = (json.loads(old.read_text()).get("so", {}).get(so, {}).get("sha256")
                       if old.exists() else None)
            man["so"][so] = xz_pack(src, out / (so + ".xz"), old_sha)
        else:
            man["so"][so] = {"sha256": _sha(src), "bytes": src.stat().st_size, "packed": False}
    if humming is not None:
        if not (humming / "forward.py").exists():
            raise SystemExit(f"{humming}: not the humming package (pip install humming-kernels, "
                             "or --no-humming)")
        dst = out / "humming"
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(humming, dst, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(vdir / "utils/humming.py", out / "vllm_utils_humming.py")
        (out / "upstream_humming.py").write_text(upstream_humming_source(vdir))
        ver = (humming / "_version.py").read_text() if (humming / "_version.py").exists() else ""
        man["humming"] = {"version": (re.findall(r"__version__ = version = '([^']+)'", ver) or ["?"])[0],
                          "bytes": sum(f.stat().st_size for f in dst.rglob("*") if f.is_file())}
    (out / "MANIFEST.json").write_text(json.dumps(man, indent=1) + "\n")
    return man


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm", help="patched vllm package dir (default: the importable vllm)")
    p.add_argument("--out", required=True, help="kit folder to write")
    p.add_argument("--so", choices=sorted(SOS), default="_moe_C",
                   help="which extension to pack (one per kit: both exceed 64 MiB)")
    p.add_argument("--no-so", action="store_true", help="skip the .so (tests)")
    p.add_argument("--humming-dir", help="the humming package dir to copy (default: the importable "
                   "humming; the _moe_C kit only)")
    p.add_argument("--no-humming", action="store_true",
                   help="leave Humming out (the MoE bench then times only the bf16 stand-in)")
    a = p.parse_args()
    hdir = None
    if a.so == "_moe_C" and not a.no_humming:
        hdir = _humming_dir(a.humming_dir)
        if hdir is None:
            raise SystemExit("humming is not importable here: pass --humming-dir DIR "
                             "(site-packages/humming of humming-kernels 0.1.12) or --no-humming")
    man = build(_vllm_dir(a.vllm), Path(a.out), not a.no_so, a.so, hdir)
    print(f"kit in {a.out}: {sorted(x.name for x in Path(a.out).iterdir())}\n{json.dumps(man)}")


if __name__ == "__main__":
    main()
