"""0250-qsa-row-cache on a real GPU (skips without CUDA): the randomized
decode steps of qsa_row_cache_sim at the real sizes (2 KV heads x 256, 16
query heads, selection width 2,051, 12,144-token blocks = lines per layer,
22-column block tables, up to 12 rows: 64 splits + the merge kernel), host
K/V in pinned memory read over UVA, every step torch.equal against the
uncached upstream kernel and every tagged line checked against the host.
A second run uses 61 lines per layer, so hundreds of programs of one launch
claim, fill and hit the same lines (the races the interpreter cannot show).

Also runs as a script on a machine without vLLM (device kit:
scripts/bench/make_qsa_device_kit.py --kit rowcache):
  python3 test_qsa_row_cache_gpu.py --steps 1000 --json $OUT/rowcache_gpu_check.json
"""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch

from qsa_row_cache_sim import Shape, run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REAL = dict(num_blocks=48, page_size=12144, kv_heads=2, head_dim=256, q_heads=16, topk=2051,
            lines=12144, layers=2, table_width=22, max_requests=4, max_rows=12,
            max_rows_per_request=3, shared_prefix=4, overlap=0.72, arena_overwrite_p=0.02,
            epoch_limit=200)


class _CAI:
    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (nbytes,),
                                         "typestr": "|u1", "version": 3}


def pinned_uva(shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Pinned host bf16 tensor of random rows and its device (UVA) view: with
    unified addressing a pinned range has the same address on the device
    (what vLLM's get_cuda_view_from_cpu_tensor returns)."""
    host = torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)
    assert host.is_pinned()
    view = torch.as_tensor(_CAI(host.data_ptr(), host.nbytes), device="cuda")
    view = view.view(torch.bfloat16).view(shape)
    view.copy_(torch.randn(shape, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    return host, view


def check(steps: int, lines: int, seed: int, budget_s: float | None = None) -> dict:
    t0 = time.monotonic()
    out = run(steps, Shape(**{**REAL, "lines": lines}), device="cuda", seed=seed,
              make_host=pinned_uva, time_budget_s=budget_s)
    out["lines"] = lines
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


@pytest.mark.parametrize("lines", [12144, 61])
def test_random_steps_real_sizes(lines):
    out = check(200, lines, seed=lines)
    assert out["equal"] == out["steps"] == 200
    assert out["hits"] > 0 and out["arena_overwrites"] >= 1


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop a run after this many seconds (the step count is recorded)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    import triton

    res = {"command": " ".join(["python3", *sys.argv]), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "shape": REAL, "runs": []}
    for lines, seed in ((12144, 1), (61, 2)):
        try:
            res["runs"].append(check(a.steps, lines, seed, a.budget_s))
        except AssertionError as e:  # the first mismatch stops a run
            res["runs"].append({"lines": lines, "error": str(e)})
    res["ok"] = all("error" not in r and r["equal"] == r["steps"] for r in res["runs"])
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
