#!/usr/bin/env bash
# The project's one test command (README "Test"; .ci/run calls exactly this).
#
# From a fresh clone: creates .venv with the image's stack (vllm 0.30.0, the
# CUDA build of torch 2.13.0, torchvision 0.28.0, triton 3.7.1: every module
# imports without a GPU), applies patches/series into the venv's vllm with the
# project's apply tool (reverting an older series first), verifies it, runs
# pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_3X3090_VENV:-.venv}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" - <<'PYEOF' 2>/dev/null
import importlib.metadata as md
want = {"vllm": "0.30.0", "torch": "2.13.0", "torchvision": "0.28.0", "triton": "3.7.1"}
for name, ver in want.items():
    got = md.version(name)
    assert got.split("+")[0] == ver, (name, got)
assert "+cpu" not in md.version("torch")
import pytest, yaml  # noqa: F401
PYEOF
then
  echo "== installing the pinned stack into $VENV (about 4 minutes, 8 GiB)"
  # A machine-local find-links folder may hold a torch 2.13.0+cpu wheel, which
  # sorts above the CUDA build; with it torchvision fails to load. Keep it out.
  nolinks=$(mktemp -d)
  PIP_FIND_LINKS="$nolinks" "$VENV/bin/pip" install -q \
    "torch==2.13.0" "torchvision==0.28.0" "triton==3.7.1" "vllm==0.30.0" \
    numpy safetensors compressed-tensors xgrammar tqdm pytest pyyaml
  rmdir "$nolinks" || true
fi

SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "== applying patches/series to $SITE"
if [ -f "$SITE/vllm/_vllm_3x3090/manifest.json" ]; then
  if "$VENV/bin/python" scripts/vllm_patches.py apply --check "$SITE" >/dev/null 2>&1; then
    echo "   already carries this series"
  else
    echo "   carries another series: reverting it first"
    "$VENV/bin/python" scripts/vllm_patches.py revert "$SITE" ||
      { echo "   revert failed: reinstalling vllm 0.30.0 from scratch";
        rm -rf "$SITE/vllm" "$SITE"/vllm-*.dist-info;
        PIP_FIND_LINKS=$(mktemp -d) "$VENV/bin/pip" install -q --no-deps "vllm==0.30.0"; }
    "$VENV/bin/python" scripts/vllm_patches.py apply "$SITE"
  fi
else
  "$VENV/bin/python" scripts/vllm_patches.py apply "$SITE"
fi
"$VENV/bin/python" scripts/vllm_patches.py apply --check "$SITE"

echo "== pytest"
exec "$VENV/bin/python" -m pytest -q "$@"
