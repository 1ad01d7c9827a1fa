"""Test session setup shared by every test.

TRITON_INTERPRET=1 with CUDA_VISIBLE_DEVICES="" lets upstream and our Triton
kernels run on the CPU (vllm/triton_utils/importing.py otherwise swaps in
placeholders when no driver is active). Both must be set before triton is
imported, hence here. GPU-only tests skip themselves (see `requires_cuda`).
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
for p in (TESTS, REPO / "scripts", REPO / "scripts" / "client", REPO / "scripts" / "serve-tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
