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

  python3 scripts/bench/make_upstream_kit.py --out /work/main/.devkit-upstream
  (device) cd .devkit-upstream && python3 bench_upstream_baselines.py \\
      --moe-c _moe_C_stable_libtorch.abi3.so.xz --json $OUT/upstream_baselines.json

  python3 scripts/bench/make_upstream_kit.py --so _C --out /work/main/.devkit-hcc
  (device) cd .devkit-hcc && python3 bench_upstream_baselines.py --hc-c \\
      --c-so _C_stable_libtorch.abi3.so.xz --json $OUT/upstream_baselines_hc.json
"""

import argparse
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


def build(vdir: Path, out: Path, pack_so: bool = True, which: str = "_moe_C") -> dict:
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
        dst = out / (so + ".xz")
        man["so"][so] = {"sha256": _sha(src), "bytes": src.stat().st_size, "packed": pack_so}
        if pack_so:
            sha = man["so"][so]["sha256"]
            old = out / "MANIFEST.json"
            same = (dst.exists() and old.exists()
                    and json.loads(old.read_text()).get("so", {}).get(so, {}).get("sha256") == sha)
            if not same:  # _moe_C 45 -> 38 MB, _C 78 -> ~54 MB: a minute or two on 2 cores
                with open(src, "rb") as f, lzma.open(dst, "wb", preset=6) as g:
                    shutil.copyfileobj(f, g)
            man["so"][so]["xz_bytes"] = dst.stat().st_size
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
    a = p.parse_args()
    man = build(_vllm_dir(a.vllm), Path(a.out), not a.no_so, a.so)
    print(f"kit in {a.out}: {sorted(x.name for x in Path(a.out).iterdir())}\n{json.dumps(man)}")


if __name__ == "__main__":
    main()
