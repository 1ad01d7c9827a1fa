"""scripts/bench/make_upstream_kit.py and bench_upstream_baselines.py on CPU (both kits,
_moe_C and --so _C, and --hc-c --dry-run):
the kit builds from the patched vllm this suite runs on, its modules import
with vllm unimportable (the device machine has none), and both scripts answer
--help on a bare python3 (argparse before the heavy imports)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "scripts/bench"

PROBE = r"""
import importlib.abc, json, sys
class NoVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "vllm":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoVllm())
sys.argv = ["bench_upstream_baselines.py"]
import bench_upstream_baselines as b
mf, hk, up = b.load_series()
import upstream_humming as uh, vllm_utils_humming as vh
print(json.dumps({"mods": [m.__name__ for m in (mf, hk, up)],
                  "fns": [hasattr(mf, "moe_route"), hasattr(hk, "hc_int8_mix"),
                          hasattr(up, "_hc_gate_mix")],
                  "humming": [hasattr(uh.HummingLinearKernel, "process_weights_after_loading"),
                              hasattr(uh.HummingLinearKernel, "apply_weights"),
                              callable(uh.prepare_humming_linear_layer_config),
                              vh._EXPORTS["humming_forward"]]}))
"""


def _vllm_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec and spec.origin
    v = Path(spec.origin).parent
    if not (v / "models/qwen4_exp/nvidia/ops/moe_fused.py").exists():
        pytest.skip("0500-moe-fused not applied to this vllm")
    return v


@pytest.mark.parametrize("script", ["bench_upstream_baselines.py", "make_upstream_kit.py"])
def test_help_on_bare_python(script):
    r = subprocess.run([sys.executable, "-S", str(BENCH / script), "--help"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout


def test_kit_builds_and_imports_without_vllm(tmp_path):
    v = _vllm_dir()
    out = tmp_path / "kit"
    r = subprocess.run([sys.executable, str(BENCH / "make_upstream_kit.py"), "--vllm", str(v),
                        "--out", str(out), "--no-so"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    man = json.loads((out / "MANIFEST.json").read_text())
    assert man["vllm_version"] == "0.30.0"
    so = man["so"]["_moe_C_stable_libtorch.abi3.so"]
    assert so["bytes"] == (v / "_moe_C_stable_libtorch.abi3.so").stat().st_size
    assert len(so["sha256"]) == 64 and so["packed"] is False
    assert not (out / "_moe_C_stable_libtorch.abi3.so.xz").exists()
    # Humming (0.30.0's INT6 shared-expert kernel) travels with the _moe_C kit
    assert man["humming"]["version"] == "0.1.12" and (out / "humming/forward.py").exists()
    assert "from vllm." not in (out / "upstream_humming.py").read_text()
    p = subprocess.run([sys.executable, "-c", PROBE], cwd=out, capture_output=True, text=True,
                       timeout=120, env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"mods": ["moe_fused", "hc_int8", "upstream_hc"], "fns": [True, True, True],
                   "humming": [True, True, True, "humming.forward:humming_forward"]}


def test_table_renders_from_the_committed_results():
    res = REPO / "scripts/bench/results/upstream_baselines.json"
    r = subprocess.run([sys.executable, "-S", str(BENCH / "bench_upstream_baselines.py"), "--table", str(res)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| ")]
    data = json.loads(res.read_text())
    # every kernel of the JSON has a row, plus the 4 whole-block rows and the header
    assert len(rows) == 1 + len(data["kernels"]) + 4
    assert all("STAND-IN" in ln for ln in rows if "standin" in ln)


def test_humming_table_renders_and_is_in_the_readme():
    """The MoE block with upstream's real INT6 shared expert (Humming, as 0.30.0 calls
    it): the run used Humming, its GEMMs matched the fp32 reference of the same INT6
    values, and every README row of the MoE block comes from this file."""
    res = REPO / "scripts/bench/results/upstream_baselines_humming.json"
    data = json.loads(res.read_text())
    assert data["complete"] and not data["errors"]
    assert data["upstream_shared_expert"].startswith("humming INT6")
    for m, part in data["moe"].items():
        c = part["check"]
        assert c["topk_ids_equal"], m
        assert c["humming_gate_up_max_rel_diff"] < 0.01 and c["humming_down_max_rel_diff"] < 0.01, (m, c)
        assert "upstream_bf16_standin" in part["block_graph_us"], m
    r = subprocess.run([sys.executable, "-S", str(BENCH / "bench_upstream_baselines.py"), "--table", str(res)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| ")]
    assert len(rows) == 1 + len(data["kernels"]) + 2  # --skip hc: only the MoE block rows
    assert any("shared_humming_int6" in ln for ln in rows)
    assert all("STAND-IN" in ln for ln in rows if "standin" in ln)
    readme = (REPO / "README.md").read_text()
    assert all(ln in readme for ln in rows), [ln for ln in rows if ln not in readme]


def test_c_kit_packs_only_c(tmp_path):
    """--so _C: the `_C` extension's entry only (a kit carries one of the two)."""
    v = _vllm_dir()
    out = tmp_path / "kit"
    r = subprocess.run([sys.executable, str(BENCH / "make_upstream_kit.py"), "--vllm", str(v), "--so", "_C",
                        "--out", str(out), "--no-so"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    man = json.loads((out / "MANIFEST.json").read_text())
    assert list(man["so"]) == ["_C_stable_libtorch.abi3.so"]
    assert "humming" not in man and not (out / "humming").exists()
    assert man["so"]["_C_stable_libtorch.abi3.so"]["bytes"] == (v / "_C_stable_libtorch.abi3.so").stat().st_size
    assert not list(out.glob("*.xz"))
    h = subprocess.run([sys.executable, "-S", "bench_upstream_baselines.py", "--help"], cwd=out,
                       capture_output=True, text=True, timeout=30)
    assert h.returncode == 0 and "--hc-c" in h.stdout, h.stderr


def test_hc_c_dry_run_packs_like_upstream():
    """The GPTQ packing, Marlin padding and scale permutation round-trip on CPU,
    and the tiny shapes reproduce the sm_90 selection (down: no Machete)."""
    r = subprocess.run([sys.executable, str(BENCH / "bench_upstream_baselines.py"), "--hc-c", "--dry-run"],
                       capture_output=True, text=True, timeout=120,
                       env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["dry_run"] == "ok"
    down, up = got["shapes"]["down"], got["shapes"]["up"]
    assert (down["n"], down["marlin_n"], down["machete_ok"]) == (80, 128, False)
    assert up["machete_ok"] and up["allspark_ok"] and down["allspark_ok"]


def test_hc_c_table_renders_from_the_committed_results():
    res = REPO / "scripts/bench/results/upstream_baselines_hc.json"
    data = json.loads(res.read_text())
    assert data["mode"] == "hc_c" and data["complete"] and not data["errors"]
    r = subprocess.run([sys.executable, "-S", str(BENCH / "bench_upstream_baselines.py"), "--table", str(res)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| ")]
    assert len(rows) == len(data["kernels"]) + 2  # one row per kernel, plus the 2 block rows
    assert not any("STAND-IN" in ln for ln in rows)
    # every README row of the GatedResidual comes from this file
    readme = (REPO / "README.md").read_text()
    assert all(ln in readme for ln in rows)
