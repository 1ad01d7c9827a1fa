#!/usr/bin/env python3
"""Copy/compute overlap of the vit-stream scheduler (patch 0610, VLLM_VIT_STREAM).

Builds N ViT-shaped blocks (width 1152, MLP 4304, 16 heads, BF16: 29 MiB each,
as in Qwen4Exp's 27-block ViT) and times, with CUDA events, for several patch
counts: all block copies alone (host pinned -> GPU), all blocks computing with
resident weights, and the streamed forward (ViTBlockStreamer, two slots).
Per block it also records copy and compute intervals on their own streams and
reports whether copy i+1 overlapped compute i.

  python scripts/bench/bench_vit_stream.py --json out.json
  (without vLLM installed: --module-path path/to/vit_stream.py)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import types

import torch
from torch import nn
from torch.nn import functional as F


def load_streamer(module_path: str | None):
    try:
        from vllm.models.qwen4_exp.nvidia import vit_stream
        return vit_stream
    except ImportError:
        if module_path is None:
            raise SystemExit("vLLM (with patch 0610) is not importable: pass "
                             "--module-path .../vllm/models/qwen4_exp/nvidia/vit_stream.py")
    import logging
    if "vllm.logger" not in sys.modules:  # the module only needs init_logger
        shim = types.ModuleType("vllm.logger")
        shim.init_logger = logging.getLogger
        sys.modules.setdefault("vllm", types.ModuleType("vllm"))
        sys.modules["vllm.logger"] = shim
    spec = importlib.util.spec_from_file_location("vit_stream", module_path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vit_stream"] = mod  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


class Block(nn.Module):
    """Qwen3_VisionBlock's compute shape (pre-norm attention + MLP)."""

    def __init__(self, dim=1152, heads=16, mlp=4304):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1 = nn.Linear(dim, mlp)
        self.fc2 = nn.Linear(mlp, dim)

    def forward(self, x):
        t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(t, 3, self.heads, -1).unbind(1)
        a = F.scaled_dot_product_attention(q.transpose(0, 1)[None],
                                           k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None])
        x = x + self.proj(a[0].transpose(0, 1).reshape(t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


def _time(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def measure(depth=27, tokens=(1024, 4096, 16384), mod=None, seed=0):
    """Returns a dict of timings (ms); needs CUDA."""
    mod = mod or load_streamer(None)
    dev = torch.device("cuda")
    torch.manual_seed(seed)
    resident = nn.ModuleList(Block() for _ in range(depth)).to(dev, torch.bfloat16)
    streamed = nn.ModuleList(Block() for _ in range(depth)).to(torch.bfloat16)
    streamed.load_state_dict({k: v.cpu() for k, v in resident.state_dict().items()})
    st = mod.ViTBlockStreamer(streamed, dev)
    side = st.side

    # Per-block interval events (timing only; they order nothing).
    marks: dict = {}
    real_copy = st.ops.copy

    def copy(dst, src, stream, block, slot):
        a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        a.record(stream)
        real_copy(dst, src, stream, block, slot)
        b.record(stream)
        marks[("copy", block)] = (a, b)

    st.ops.copy = copy
    for i, blk in enumerate(streamed):
        def timed(x, _i=i, _f=type(blk).forward.__get__(blk)):
            a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            a.record()
            y = _f(x)
            b.record()
            marks[("compute", _i)] = (a, b)
            return y

        blk.forward = timed  # install() wraps this one with before/after
    st.install()

    host = [p.host for p in st.packs]
    slots = st.slots
    out = {"depth": depth, "block_mib": st.slot_bytes / 2**20,
           "device": torch.cuda.get_device_name(), "rows": []}

    def copy_all():
        with torch.cuda.stream(side):
            for i, h in enumerate(host):
                slots[i % 2][: h.numel()].copy_(h, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    t_copy = _time(copy_all)
    for t in tokens:
        x = torch.randn(t, 1152, device=dev, dtype=torch.bfloat16)

        def run_res():
            y = x
            for b in resident:
                y = b(y)
            return y

        def run_str():
            y = x
            for b in streamed:
                y = b(y)
            return y

        with torch.inference_mode():
            t_res = _time(run_res)
            t_str = _time(run_str)
            same = torch.equal(run_res(), run_str())
            marks.clear()
            run_str()
            torch.cuda.synchronize()
        overl = 0
        for i in range(depth - 1):
            (ca, cb), (ka, kb) = marks[("copy", i + 1)], marks[("compute", i)]
            # copy i+1 starts before compute i ends and ends after it starts
            t0 = marks[("copy", 0)][0]
            c0, c1 = t0.elapsed_time(ca), t0.elapsed_time(cb)
            k0, k1 = t0.elapsed_time(ka), t0.elapsed_time(kb)
            overl += int(c0 < k1 and c1 > k0)
        out["rows"].append({
            "patches": t, "copy_all_ms": round(t_copy, 3),
            "compute_resident_ms": round(t_res, 3),
            "streamed_ms": round(t_str, 3),
            "serial_sum_ms": round(t_copy + t_res, 3),
            "hidden_ms": round(t_copy + t_res - t_str, 3),
            "blocks_with_copy_overlapping_prev_compute": overl,
            "identical_to_resident": same,
        })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=27)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--module-path", default=None)
    ap.add_argument("--json", default=None, help="write results here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    res = measure(a.depth, a.tokens, load_streamer(a.module_path))
    res["command"] = "python " + " ".join(sys.argv)
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
