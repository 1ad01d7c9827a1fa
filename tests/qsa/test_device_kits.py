"""scripts/bench/make_qsa_device_kit.py: every kit builds from the patched
vllm this suite runs on and imports without vLLM. The device machine has no
vLLM; a patched module that grows a vllm (or relative) import the builder
does not rewrite would only fail there, mid-run (0250 added a function-local
`from .ops import qsa_row_cache` to 0220's arena writers, which the staging
bench calls)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "scripts/bench/make_qsa_device_kit.py"
SCRIPTS = {"bench_qsa_staging", "qsa_uva_device_check", "bench_qsa_row_cache",
           "test_qsa_row_cache_gpu", "qsa_fp8_device_check", "bench_upstream_baselines"}


def _vllm_root() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec and spec.origin
    root = Path(spec.origin).parent.parent
    if not (root / "vllm/models/qwen4_exp/nvidia/ops/qsa_row_cache.py").exists():
        pytest.skip("0250-qsa-row-cache not applied to this vllm")
    return root


# Imports every module of the kit with vllm unimportable, as on the device
# (not the scripts: they need CUDA at the top level), then runs the arena writers' row-cache hook the staging bench calls.
PROBE = r"""
import glob, importlib, importlib.abc, json, sys

class NoVllm(importlib.abc.MetaPathFinder):  # the device machine has no vLLM
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "vllm":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoVllm())
skip = set(json.loads(sys.argv[1]))
mods = sorted(f[:-3] for f in glob.glob("*.py") if f[:-3] not in skip)
for m in mods:
    importlib.import_module(m)
if "qsa_host_kv" in mods:
    import qsa_host_kv
    class Arena:  # no row cache attached: the hook must be a no-op, not an ImportError
        pass
    qsa_host_kv._row_cache_overwritten(Arena())
for s in skip:
    try:
        compile(open(s + ".py").read(), s + ".py", "exec")
    except FileNotFoundError:
        pass
print(json.dumps({"mods": mods, "vllm": sorted(k for k in sys.modules if k.split(".")[0] == "vllm")}))
"""


@pytest.mark.parametrize("kit,want", [
    ("staging", {"dev_stubs", "pinned_host_pool", "qsa_host_kv", "qsa_ops", "qsa_row_cache",
                 "qsa_capacity", "qsa_fp8"}),
    ("rowcache", {"dev_stubs", "qsa_ops", "qsa_row_cache", "qsa_row_cache_sim", "qsa_fp8"}),
    ("fp8", {"dev_stubs", "pinned_host_pool", "qsa_host_kv", "qsa_ops", "qsa_row_cache",
             "qsa_capacity", "qsa_fp8", "qsa_ops_v033"}),
])
def test_kit_builds_and_imports_without_vllm(kit, want, tmp_path):
    out = tmp_path / kit
    extra = []
    if kit == "fp8":
        # STAND-IN for the vllm-0.33.0 wheel (not downloadable in CI): a zip
        # holding this tree's ops/qsa.py under 0.33.0's member name, plus
        # 0.33.0's one extra vllm import, so the port of that member runs.
        import zipfile

        member = "vllm/models/qwen4_exp/nvidia/ops/qsa.py"
        text = (_vllm_root() / member).read_text().replace(
            "\nimport torch\n", "\nimport torch\n\nfrom vllm.platforms import current_platform\n", 1)
        wheel = tmp_path / "vllm-0.33.0-standin.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(member, text)
        extra = ["--v033-wheel", str(wheel)]
    subprocess.run([sys.executable, str(TOOL), "--tree", str(_vllm_root()), "--kit", kit,
                    "--out", str(out), *extra], check=True, capture_output=True, text=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ""}
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(sorted(SCRIPTS))], cwd=out,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(got["mods"]) == want
    assert got["vllm"] == [], f"kit imported vllm: {got['vllm']}"
    # dev_stubs carries the upstream pin_tensor, copied from the tree
    assert "def pin_tensor(" in (out / "dev_stubs.py").read_text()


def test_unhandled_import_is_refused(tmp_path):
    root = _vllm_root()
    tree = tmp_path / "tree"
    for rel in ("v1/worker/pinned_host_pool.py", "v1/simple_kv_offload/cuda_mem_ops.py",
                "models/qwen4_exp/nvidia/qsa_host_kv.py", "models/qwen4_exp/nvidia/ops/qsa.py",
                "models/qwen4_exp/nvidia/ops/qsa_fp8.py",
                "models/qwen4_exp/nvidia/ops/qsa_row_cache.py"):
        dst = tree / "vllm" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text((root / "vllm" / rel).read_text())
    host_kv = tree / "vllm/models/qwen4_exp/nvidia/qsa_host_kv.py"
    host_kv.write_text(host_kv.read_text() + "\n\ndef f():\n    from vllm.config import VllmConfig\n")
    r = subprocess.run([sys.executable, str(TOOL), "--tree", str(tree), "--kit", "staging",
                        "--out", str(tmp_path / "kit")], capture_output=True, text=True)
    assert r.returncode != 0 and "from vllm.config import VllmConfig" in r.stderr
