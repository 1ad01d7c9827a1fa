"""scripts/bench/make_small_kernels_kit.py builds the standalone kit from this
venv's patched vllm (kernels copied verbatim, no vllm import left), and the
kit's bench_small_kernels.py --dry-run launches each kernel (0650 aligned state
ids, 0100 PLE n-gram ids, 0500 INT6 planes GEMM) under the Triton interpreter at
tiny shapes and checks it against torch: the kit the device run used works."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "scripts/bench"


def test_help_on_bare_python():
    for s in ("bench_small_kernels.py", "make_small_kernels_kit.py"):
        r = subprocess.run([sys.executable, "-S", str(BENCH / s), "--help"], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0 and "--" in r.stdout, r.stderr


def test_kit_builds_and_dry_run_checks_every_kernel(tmp_path):
    pytest.importorskip("triton")
    kit = tmp_path / "kit"
    r = subprocess.run([sys.executable, str(BENCH / "make_small_kernels_kit.py"), "--out", str(kit)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    src = (kit / "small_kernels.py").read_text()
    assert "def get_aligned_state_indices_multi_group_kernel(" in src
    assert "def _ple_ngram_ids_kernel(" in src
    assert "def _int6_planes_gemm_kernel(" in (kit / "moe_fused.py").read_text()
    assert not [ln for ln in (src + (kit / "moe_fused.py").read_text()).splitlines()
                if ln.lstrip().startswith(("from vllm", "import vllm"))]
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "d.json"
    r = subprocess.run([sys.executable, "bench_small_kernels.py", "--dry-run", "--json", str(out)], cwd=kit,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(out.read_text())
    assert [c["kernel"] for c in d["cases"]] == ["aligned_state_ids", "ple_ngram_ids", "int6_gemm"]
    assert all(c["bytes_read"] > 0 for c in d["cases"])
