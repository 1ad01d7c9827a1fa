#!/usr/bin/env python3
"""Quantize the MTP routed experts of a checkpoint to INT4 g128 (SPEC §7).

RTN, symmetric, group size 128 along the input dim; per group the clip value
that minimises the squared reconstruction error is searched over fractions of
the group's absmax (absmax itself is one candidate, so the result is never
worse than plain absmax RTN). The MTP experts then take 1.17 GiB instead of
~4.7 GiB in bf16, which is what lets the draft head live on rank 2's GPU.

The checkpoint is only read. The output directory gets exactly the three files
that compose/mtp.yaml mounts over the checkpoint:
  config.json                    quantization_config + an int4 group for them
  model.safetensors.index.json   weight_map pointing them at mtp-int4.safetensors
  mtp-int4.safetensors           weight_packed (int32) / weight_scale / weight_shape
in compressed-tensors "pack-quantized" format (what vLLM's compressed-tensors
loader reads: q+8 nibbles, 8 per int32 along the input dim, value i at bits 4i).

  python3 scripts/make_mtp_int4.py CKPT_DIR OUT_DIR [--dry-run]
"""

import argparse
import copy
import json
import re
import sys
from pathlib import Path

import torch

OUT_CONFIG = "config.json"
OUT_INDEX = "model.safetensors.index.json"
OUT_WEIGHTS = "mtp-int4.safetensors"
GROUP_SIZE = 128
QMIN, QMAX = -8, 7
# Default: the routed experts of the MTP head (not its shared expert).
DEFAULT_PATTERN = r"^mtp\..*\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$"
GROUP_NAME = "mtp_int4_g128"


def clip_fractions(steps: int) -> torch.Tensor:
    """Candidate clip values as fractions of absmax, 1.0 (= absmax) included."""
    return torch.linspace(1.0, 0.5, steps)


def quantize_rtn(w: torch.Tensor, group_size: int = GROUP_SIZE, steps: int = 20,
                 search: bool = True):
    """w [out, in] -> (q int8 [out, in] in [-8, 7], scale fp32 [out, in/g]).

    scale = clip / 7 (so +clip maps to +7 exactly); the searched clip is the
    candidate with the lowest sum of squared errors in each group.
    """
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    out, inp = w.shape
    if inp % group_size:
        raise ValueError(f"input dim {inp} is not a multiple of group size {group_size}")
    g = w.float().reshape(out, inp // group_size, group_size)
    absmax = g.abs().amax(dim=-1).clamp_min(1e-12)  # [out, G]
    fracs = clip_fractions(steps) if search else torch.ones(1)
    best_err = None
    best_scale = None
    for f in fracs:
        scale = absmax * f / QMAX
        q = torch.clamp(torch.round(g / scale[..., None]), QMIN, QMAX)
        err = ((q * scale[..., None] - g) ** 2).sum(-1)
        if best_err is None:
            best_err, best_scale = err, scale
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, scale, best_scale)
    q = torch.clamp(torch.round(g / best_scale[..., None]), QMIN, QMAX)
    return q.reshape(out, inp).to(torch.int8), best_scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, group_size: int = GROUP_SIZE):
    out, inp = q.shape
    g = q.float().reshape(out, inp // group_size, group_size)
    return (g * scale.float()[..., None]).reshape(out, inp)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [out, in] in [-8, 7] -> int32 [out, in/8], compressed-tensors layout."""
    out, inp = q.shape
    if inp % 8:
        raise ValueError("input dim must be a multiple of 8 to pack int4")
    u = (q.to(torch.int32) + 8).reshape(out, inp // 8, 8)
    shifts = torch.arange(8, dtype=torch.int32) * 4
    return (u << shifts).sum(dim=-1, dtype=torch.int32)


def _read_index(ckpt: Path) -> dict:
    idx = ckpt / OUT_INDEX
    if idx.exists():
        return json.loads(idx.read_text())
    single = ckpt / "model.safetensors"
    if not single.exists():
        raise SystemExit(f"{ckpt}: neither {OUT_INDEX} nor model.safetensors found; "
                         "pass the checkpoint directory")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}


def module_regex(names: list[str]) -> str:
    """A vLLM compressed-tensors target matching exactly these modules."""
    mods = sorted(n[: -len(".weight")] for n in names)
    return "re:^(" + "|".join(re.escape(m) for m in mods) + ")$"


def build_config(cfg: dict, names: list[str], group_size: int) -> dict:
    cfg = copy.deepcopy(cfg)
    holder = cfg["text_config"] if "quantization_config" not in cfg and "text_config" in cfg \
        and "quantization_config" in cfg["text_config"] else cfg
    qc = holder.get("quantization_config")
    if qc is None:
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
              "config_groups": {}, "ignore": []}
    elif qc.get("quant_method") != "compressed-tensors":
        raise SystemExit(f"checkpoint quantization is {qc.get('quant_method')!r}; this "
                         "tool only adds a group to a compressed-tensors config")
    qc.setdefault("config_groups", {})
    qc["config_groups"][GROUP_NAME] = {
        "targets": [module_regex(names)],
        "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                    "strategy": "group", "group_size": group_size,
                    "dynamic": False, "actorder": None, "observer": "minmax"},
        "input_activations": None,
        "output_activations": None,
        "format": "pack-quantized",
    }
    mods = {n[: -len(".weight")] for n in names}
    if qc.get("ignore"):
        qc["ignore"] = [x for x in qc["ignore"] if x not in mods]
    holder["quantization_config"] = qc
    return cfg


def plan(ckpt: Path, pattern: str):
    index = _read_index(ckpt)
    rx = re.compile(pattern)
    names = sorted(n for n in index["weight_map"] if rx.search(n))
    if not names:
        raise SystemExit(f"no weight matches --pattern {pattern!r} in {ckpt}; "
                         "check the names in model.safetensors.index.json")
    return index, names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="checkpoint directory (read only)")
    ap.add_argument("out", type=Path, help="output directory for the 3 override files")
    ap.add_argument("--pattern", default=DEFAULT_PATTERN,
                    help="regex of the weight names to quantize (default: MTP routed experts)")
    ap.add_argument("--group-size", type=int, default=GROUP_SIZE)
    ap.add_argument("--clip-steps", type=int, default=20,
                    help="clip candidates from 1.0 to 0.5 x absmax (default 20)")
    ap.add_argument("--dry-run", action="store_true", help="print what would be written")
    args = ap.parse_args(argv)

    ckpt = args.checkpoint
    cfg_path = ckpt / OUT_CONFIG
    if not cfg_path.exists():
        raise SystemExit(f"{cfg_path} not found; pass the checkpoint directory")
    if args.out.resolve() == ckpt.resolve():
        raise SystemExit("OUT must differ from the checkpoint: the checkpoint is never changed")
    index, names = plan(ckpt, args.pattern)
    cfg = build_config(json.loads(cfg_path.read_text()), names, args.group_size)
    new_index = copy.deepcopy(index)
    for n in names:
        del new_index["weight_map"][n]
        base = n[: -len(".weight")]
        for suffix in ("weight_packed", "weight_scale", "weight_shape"):
            new_index["weight_map"][f"{base}.{suffix}"] = OUT_WEIGHTS

    if args.dry_run:
        print(f"would quantize {len(names)} tensors (INT4 g{args.group_size}, symmetric, "
              f"clip search {args.clip_steps} steps), e.g. {names[0]}")
        for f in (OUT_CONFIG, OUT_INDEX, OUT_WEIGHTS):
            print(f"would write {args.out / f}")
        return 0

    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(index["weight_map"][n], []).append(n)
    sse = ref = 0.0
    with tqdm(total=len(names), desc="int4 g%d" % args.group_size, unit="tensor") as bar:
        for fname, fnames in by_file.items():
            with safe_open(str(ckpt / fname), framework="pt") as f:
                for n in fnames:
                    w = f.get_tensor(n)
                    sdtype = w.dtype if w.dtype in (torch.float16, torch.bfloat16) \
                        else torch.bfloat16
                    q, scale = quantize_rtn(w, args.group_size, args.clip_steps)
                    wd = dequantize(q, scale.to(sdtype), args.group_size)
                    sse += float(((wd - w.float()) ** 2).sum())
                    ref += float((w.float() ** 2).sum())
                    base = n[: -len(".weight")]
                    tensors[f"{base}.weight_packed"] = pack_int4(q)
                    tensors[f"{base}.weight_scale"] = scale.to(sdtype).contiguous()
                    tensors[f"{base}.weight_shape"] = torch.tensor(list(w.shape),
                                                                   dtype=torch.int64)
                    bar.update(1)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out / OUT_WEIGHTS), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    new_index.setdefault("metadata", {})
    (args.out / OUT_INDEX).write_text(json.dumps(new_index, indent=2) + "\n")
    (args.out / OUT_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    print(f"wrote {args.out} ({len(names)} tensors, {total / 2**30:.3f} GiB, "
          f"relative squared error {sse / max(ref, 1e-30):.3e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
