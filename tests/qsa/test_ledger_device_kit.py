"""scripts/bench/make_ledger_device_kit.py builds from the patched vllm this
suite runs on, and the kit's modules and check script import with vllm
unimportable, as on the device machine (the check itself needs CUDA)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import importlib.abc, sys

class NoVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "vllm":
            raise ImportError("no vllm on the device machine: " + name)
        return None

sys.meta_path.insert(0, NoVllm())
import kv_capacity, pinned_host_pool, qsa_host_kv, qsa_row_cache, vit_stream
import ledger_device_check
cfg = kv_capacity.load_config(kv_capacity.DEFAULT_CONFIG)
assert cfg["vision_config"]["depth"] == 27
print("ok")
"""


def test_kit_builds_and_imports_without_vllm(tmp_path):
    import vllm

    root = Path(vllm.__file__).parent.parent
    kit = tmp_path / "kit"
    subprocess.run([sys.executable, str(REPO / "scripts/bench/make_ledger_device_kit.py"),
                    "--tree", str(root), "--out", str(kit)], check=True, capture_output=True)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=kit, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
