#!/usr/bin/env python3
"""Build the kit for scripts/bench/ledger_device_check.py on a machine
without vLLM: the patched modules whose allocations the ledger counts
(0210 pinned_host_pool.py, 0610 vit_stream.py, 0220 qsa_host_kv.py with
ops/qsa.py, 0250 ops/qsa_row_cache.py), ported with make_qsa_device_kit's
rules (its dev_stubs.py), plus scripts/kv_capacity.py and its model config,
so the check compares what the code allocates with the ledger's figures.

  python3 scripts/vllm_patches.py tree /tmp/tree
  python3 scripts/bench/make_ledger_device_kit.py --tree /tmp/tree --out _device/ledger
  (device) cd _device/ledger && python3 ledger_device_check.py --json $OUT/ledger.json
"""

import argparse
import re
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
NV = "models/qwen4_exp/nvidia"

MODULES = [("v1/worker/pinned_host_pool.py", "pinned_host_pool.py"),
           (f"{NV}/vit_stream.py", "vit_stream.py"),
           (f"{NV}/qsa_host_kv.py", "qsa_host_kv.py"),
           (f"{NV}/ops/qsa.py", "qsa_ops.py"),
           (f"{NV}/ops/qsa_fp8.py", "qsa_fp8.py"),
           (f"{NV}/ops/qsa_row_cache.py", "qsa_row_cache.py")]
# vit_stream imports the pool inside a method (deeper than the shared rule's
# four spaces).
EXTRA_SUBS = [(r"^(\s+)from vllm\.v1\.worker\.pinned_host_pool import", r"\1from pinned_host_pool import")]


def build(tree: Path, out: Path) -> list[str]:
    sys.path.insert(0, str(HERE))
    import make_qsa_device_kit as mk

    v = tree / "vllm"
    if not v.is_dir():
        raise SystemExit(f"{tree}: no vllm/ here; make one with `scripts/vllm_patches.py tree DIR`")
    out.mkdir(parents=True, exist_ok=True)
    for src, dst in MODULES:
        text = (v / src).read_text()
        for pat, rep in EXTRA_SUBS:
            text = re.sub(pat, rep, text, flags=re.M)
        # not strict: function-local imports of serving hooks the check never
        # calls (vit_path's envs, kv_cache_flag_hint's config) may stay
        (out / dst).write_text(mk.port(text, src, strict=False))
    mk_out = out / "_stubs"
    mk.build.__globals__["KITS"]["_ledger_stubs"] = {"modules": [], "files": [], "strict": False}
    mk.build(tree, "_ledger_stubs", mk_out)
    shutil.move(str(mk_out / "dev_stubs.py"), out / "dev_stubs.py")
    shutil.rmtree(mk_out)
    shutil.copy(REPO / "scripts/kv_capacity.py", out / "kv_capacity.py")
    (out / "data").mkdir(exist_ok=True)
    shutil.copy(REPO / "scripts/data/qwen4_exp_flash_next_config.json", out / "data")
    shutil.copy(HERE / "ledger_device_check.py", out / "ledger_device_check.py")
    return sorted(p.name for p in out.iterdir())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", required=True, help="patched tree (scripts/vllm_patches.py tree)")
    p.add_argument("--out", required=True, help="kit folder to write")
    a = p.parse_args()
    print(f"kit in {a.out}: {' '.join(build(Path(a.tree), Path(a.out)))}")


if __name__ == "__main__":
    main()
