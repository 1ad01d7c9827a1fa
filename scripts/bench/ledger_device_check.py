#!/usr/bin/env python3
"""Measure, on a GPU, the real pinned and device bytes of the ledger's pieces
that run without vLLM, against scripts/kv_capacity.py's figures:

  QSA K/V pool (0210): one rank's pool at --kv-cache-memory-bytes, pinned by
    the pool; measured: its mapping's Size/Rss in /proc/self/smaps, torch
    reporting it pinned, and torch's pinned cache (must stay untouched).
  ViT blocks (0610): 27 stand-in blocks with the real Qwen3_VisionBlock
    parameter names/shapes from vision_config (no vLLM here to build the real
    one; tests/qsa/test_kv_ledger.py checks the shapes against it), put
    through upstream's device_loading_context round trip (Linear params to
    the GPU and back into torch pin_memory), then ViTBlockStreamer: its pool
    (smaps), its slots (torch.cuda.memory_allocated delta), torch's pinned
    cache before/after release_repinned_copies; and, for comparison, what the
    previous code did (one torch pin_memory buffer per block).
  Staging arena (0220) and row-cache state (0250): memory_allocated deltas.

Run from the kit (make_ledger_device_kit.py):
  python3 ledger_device_check.py --json $OUT/ledger.json
"""

import argparse
import json
import os
import sys
import time

SMAPS_KEYS = ("Size", "Rss", "Locked")


def smaps_of(addr: int) -> dict:
    """Size/Rss/Locked (bytes) of the mapping that starts at addr."""
    out, hit = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo = int(head.split("-")[0], 16)
                if hit:
                    break
                hit = lo == addr
            elif hit and head.rstrip(":") in SMAPS_KEYS:
                out[head.rstrip(":")] = int(line.split()[1]) * 1024
    return out


def status(keys=("VmRSS", "VmLck", "VmPin")) -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k = line.split(":")[0]
            if k in keys:
                out[k] = int(line.split()[1]) * 1024
    return out


def host_cache():
    import torch

    s = torch.cuda.host_memory_stats()
    # owned = in use + cached (torch 2.11-2.13 key names), active = in use
    return {"reserved": int(s.get("allocated_bytes.current", s.get("reserved_bytes.current", 0))),
            "allocated": int(s.get("active_bytes.current", 0))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-cache-memory-bytes", type=int, default=783_000_000)
    p.add_argument("--skip-kv-pool", action="store_true", help="skip the 22.6 GiB pool")
    p.add_argument("--json", default=None)
    a = p.parse_args()

    import torch
    from torch import nn

    import kv_capacity as kc
    import pinned_host_pool as php
    import qsa_host_kv
    import qsa_row_cache
    import vit_stream as vs

    cfg = kc.load_config(kc.DEFAULT_CONFIG)
    vcfg = cfg["vision_config"]
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
           "kv_cache_memory_bytes": a.kv_cache_memory_bytes, "items": []}

    def item(name, ledger, measured, method, tol=0, **extra):
        ok = abs(measured - ledger) <= tol
        res["items"].append({"name": name, "ledger_bytes": ledger, "measured_bytes": measured,
                             "diff_bytes": measured - ledger, "tolerance_bytes": tol, "ok": ok,
                             "method": method, **extra})
        print(f"{'OK ' if ok else 'BAD'} {name:<40} ledger {ledger:>15,}  measured "
              f"{measured:>15,}  ({method})", flush=True)

    dev = torch.device("cuda")
    torch.cuda.init()
    lay = kc.capacity_layout(cfg, pp_size=3, max_model_len=262144, prefix_caching=True)
    cap = kc.usable_capacity(lay, a.kv_cache_memory_bytes, 262144)
    expandable = "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower()
    res["expandable_segments"] = expandable
    led = kc.ledger(cfg, lay, cap, pp_size=3, mtp=False, vit=True, expandable_segments=expandable)
    rows = {r["name"]: r["bytes_per_rank"] for r in led["rows"]}

    # ---- 0210: one rank's QSA K/V pool ----
    if not a.skip_kv_pool:
        n = cap["pinned_host_bytes_per_rank"][0]
        before = host_cache()
        t0 = time.perf_counter()
        pool = php.allocate_pinned_host_pool(n, what="QSA host K/V (ledger check)",
                                             lower_hint="--kv-cache-memory-bytes",
                                             lock_path=os.path.join(os.getcwd(), "pool.lock"))
        secs = time.perf_counter() - t0
        sm = smaps_of(pool.tensor.data_ptr())
        item("QSA K/V pool, rank 0 (smaps Rss)", rows["QSA K/V pool"][0], sm.get("Rss", -1),
             "/proc/self/smaps Rss of the pool's mapping", smaps=sm,
             is_pinned=bool(pool.tensor.is_pinned()), pin_seconds=round(secs, 2),
             torch_pinned_cache_delta=host_cache()["reserved"] - before["reserved"],
             status=status())
        pool.release()

    # ---- 0610: ViT blocks ----
    d, f = vcfg["hidden_size"], vcfg["intermediate_size"]

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear_fc1 = nn.Linear(d, f)
            self.linear_fc2 = nn.Linear(f, d)

    class Block(nn.Module):  # Qwen3_VisionBlock's parameters, same order
        def __init__(self):
            super().__init__()
            self.norm1 = nn.LayerNorm(d)
            self.norm2 = nn.LayerNorm(d)
            self.attn = Attn()
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn.proj(self.attn.qkv(self.norm1(x))[..., :d])
            return x + self.mlp.linear_fc2(torch.nn.functional.gelu(self.mlp.linear_fc1(self.norm2(x))))

    with torch.device("meta"):
        shape_check = [p.numel() * 2 for p in Block().parameters()]
    assert shape_check == kc.vit_block_param_nbytes(vcfg), "stand-in block != ledger shapes"
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block().to(torch.bfloat16) for _ in range(vcfg["depth"]))
    ref_blocks = [{k: v.clone() for k, v in b.state_dict().items()} for b in blocks]
    base = host_cache()
    # upstream device_loading_context (model_loader/utils.py) for each module
    # with a quant method (the Linears): to the GPU for the post-load pass,
    # then back into a new torch pin_memory tensor.
    for m in blocks.modules():
        if isinstance(m, nn.Linear):
            for prm in m.parameters():
                prm.data = prm.data.to(dev)
            for prm in m.parameters():
                prm.data = torch.empty_like(prm.data, device="cpu", pin_memory=True).copy_(prm.data)
    repinned = host_cache()
    res["vit_repinned_by_device_loading_context"] = {
        "torch_pinned_cache_reserved": repinned["reserved"] - base["reserved"],
        "torch_pinned_allocated": repinned["allocated"] - base["allocated"]}
    torch.cuda.synchronize()
    dev0, rsv0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    st = vs.ViTBlockStreamer(blocks, dev)
    st.install()
    torch.cuda.synchronize()
    slots = torch.cuda.memory_allocated() - dev0
    slots_reserved = torch.cuda.memory_reserved() - rsv0
    after = host_cache()
    sm = smaps_of(st.host_buffer.data_ptr())
    item("ViT blocks pool (smaps Size)", rows["ViT blocks pool"][0], sm.get("Size", -1),
         "/proc/self/smaps Size of the pool's mapping", smaps=sm,
         pool_nbytes=st.host_buffer.nbytes, is_pinned=bool(st.host_buffer.is_pinned()))
    item("ViT blocks pool (exact nbytes)", kc.vit_pool_bytes(vcfg), st.host_buffer.nbytes,
         "host_buffer.nbytes")
    item("ViT re-pinned copies left in torch's cache", rows[
        "ViT copies re-pinned by device_loading_context"][0],
         after["reserved"] - base["reserved"], "torch.cuda.host_memory_stats reserved delta",
         released_bytes=st.repinned_freed)
    item("ViT GPU slots", rows["ViT GPU slots"][0], slots,
         "torch.cuda.memory_allocated delta", requested=2 * st.slot_bytes,
         reserved_delta=slots_reserved)
    # the streamed blocks compute what the resident ones do
    x = torch.randn(64, d, device=dev, dtype=torch.bfloat16)
    y = x
    for b in blocks:
        y = b(y)
    res_blocks = [Block().to(torch.bfloat16) for _ in range(vcfg["depth"])]
    y_ref = x
    for b, sd in zip(res_blocks, ref_blocks):
        b.load_state_dict(sd)
        y_ref = b.to(dev)(y_ref)
    res["vit_streamed_equals_resident"] = bool(torch.equal(y, y_ref))
    print("ViT streamed == resident:", res["vit_streamed_equals_resident"], flush=True)
    del res_blocks, y_ref

    # previous 0610: one torch pin_memory buffer per block
    torch._C._host_emptyCache()
    b0 = host_cache()
    old = [torch.empty(st.packs[i].host.numel(), dtype=torch.uint8, pin_memory=True)
           for i in range(len(st.packs))]
    res["vit_previous_per_block_pin_memory"] = {
        "requested": sum(t.numel() for t in old),
        "torch_pinned_cache_reserved": host_cache()["reserved"] - b0["reserved"]}
    del old
    torch._C._host_emptyCache()

    # ---- 0220 staging arena and 0250 row-cache state ----
    for mtp in (False, True):
        lay_m = kc.capacity_layout(cfg, pp_size=3, partition="16,17,15" if mtp else None,
                                   max_model_len=262144, prefix_caching=True, num_spec=int(mtp))
        layers = max(lay_m["qsa_layers_per_rank"])
        tag = " (MTP)" if mtp else ""
        torch.cuda.synchronize()
        m0, r0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        arena = qsa_host_kv.QSAStagingArena(layers, lay_m["block_size"], cfg["num_key_value_heads"],
                                            cfg["head_dim"], dev)
        m1 = torch.cuda.memory_allocated()
        item("QSA staging arena" + tag, kc.cuda_block_bytes(lay_m["staging_arena_bytes"], expandable),
             m1 - m0, "torch.cuda.memory_allocated delta", requested=arena.nbytes,
             reserved_delta=torch.cuda.memory_reserved() - r0)
        rc = qsa_row_cache.QSARowCache(arena.buffer)
        torch.cuda.synchronize()
        m2 = torch.cuda.memory_allocated()
        item("QSA row-cache state" + tag,
             sum(kc.cuda_block_bytes(n, expandable)
                 for n in kc.row_cache_tensor_bytes(layers, lay_m["block_size"])),
             m2 - m1, "torch.cuda.memory_allocated delta",
             requested=kc.row_cache_state_bytes(layers, lay_m["block_size"]))
        del rc, arena
    res["torch_host_memory_stats_keys"] = sorted(torch.cuda.host_memory_stats())[:40]
    res["all_ok"] = all(i["ok"] for i in res["items"])
    res["command"] = " ".join(sys.argv)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=2)
    print("all ok:", res["all_ok"])
    return 0 if res["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
