#!/usr/bin/env python3
"""Quantize the MTP routed experts of a checkpoint to INT4 g128 (SPEC §7) and
write a model directory that vLLM serves instead of the checkpoint.

RTN, symmetric, group size 128 along the input dim; per group the clip value
that minimises the squared reconstruction error is searched over fractions of
the group's absmax (absmax itself is one candidate). The error is measured
with the scale as it is stored (bf16), so the stored result is never worse
than plain absmax RTN. The MTP experts then take 1.17 GiB instead of ~4.7 GiB
in bf16, which is what lets the draft head live on rank 2's GPU.

The checkpoint is only read, and nothing is mounted into it. OUT becomes a
complete model directory:
  config.json                    quantization_config + an INT4 group for them
  model.safetensors.index.json   the checkpoint's index; the experts' bf16
                                 names and their packed names -> mtp-int4
  mtp-int4.safetensors           weight_packed (int32) / weight_scale / weight_shape
  everything else                a symlink to CHECKPOINT_MOUNT/<name> (shards,
                                 tokenizer, generation config, chat template...)
compose/mtp.yaml mounts the checkpoint at /models/qwen3.8-flash-next (the
default CHECKPOINT_MOUNT) and OUT at /models/mtp-overlay, and serves the
latter; on the host the symlinks dangle, which is expected. vLLM (patch 0120,
VLLM_SAFETENSORS_INDEX_FILTER) reads each tensor only from the file the index
assigns it to, so the bf16 experts in the shards are never loaded.

Weights are in compressed-tensors "pack-quantized" format (what vLLM's
compressed-tensors loader reads: q+8 nibbles, 8 per int32 along the input
dim, value i at bits 4i).

  python3 scripts/serve-tools/make_mtp_int4.py CKPT_DIR OUT_DIR [--dry-run] [--json]
"""

import argparse
import copy
import json
import os
import re
import sys
from pathlib import Path

OUT_CONFIG = "config.json"
OUT_INDEX = "model.safetensors.index.json"
OUT_WEIGHTS = "mtp-int4.safetensors"
OWN_FILES = (OUT_CONFIG, OUT_INDEX, OUT_WEIGHTS)
GROUP_SIZE = 128
QMIN, QMAX = -8, 7
# Default: the routed experts of the MTP head (not its shared expert).
DEFAULT_PATTERN = r"^mtp\..*\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$"
GROUP_NAME = "mtp_int4_g128"
DEFAULT_MOUNT = "/models/qwen3.8-flash-next"
WHERE_TO_RUN = (
    "it needs torch and safetensors. Run it in the image (the checkpoint is "
    "mounted there at /models/qwen3.8-flash-next):\n"
    "  set -a; . ./.env; set +a\n"
    '  docker compose run --rm --no-deps -v "$MTP_INT4_DIR":/out --entrypoint python3 vllm \\\n'
    "    /opt/vllm-3x3090/scripts/serve-tools/make_mtp_int4.py /models/qwen3.8-flash-next /out\n"
    "or with the project's venv (made by scripts/test.sh): "
    '.venv/bin/python scripts/serve-tools/make_mtp_int4.py "$MODEL_DIR" "$MTP_INT4_DIR"'
)


def clip_fractions(steps: int):
    """Candidate clip values as fractions of absmax, 1.0 (= absmax) first."""
    import torch

    return torch.linspace(1.0, 0.5, steps)


def quantize_rtn(w, group_size: int = GROUP_SIZE, steps: int = 20,
                 search: bool = True, scale_dtype=None):
    """w [out, in] -> (q int8 [out, in] in [-8, 7], scale [out, in/g]).

    scale = clip / 7 rounded to scale_dtype (default bf16, what is stored),
    and q is computed with that rounded scale: the error the search minimises
    is the error of the stored values. The returned scale is fp32 holding
    values exactly representable in scale_dtype.
    """
    import torch

    if scale_dtype is None:
        scale_dtype = torch.bfloat16
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    out, inp = w.shape
    if inp % group_size:
        raise ValueError(f"input dim {inp} is not a multiple of group size {group_size}")
    g = w.float().reshape(out, inp // group_size, group_size)
    absmax = g.abs().amax(dim=-1).clamp_min(1e-12)  # [out, G]
    fracs = clip_fractions(steps) if search else torch.ones(1)
    best_err = best_scale = best_q = None
    for f in fracs:
        scale = (absmax * f / QMAX).to(scale_dtype).float().clamp_min(1e-30)
        q = torch.clamp(torch.round(g / scale[..., None]), QMIN, QMAX)
        err = ((q * scale[..., None] - g) ** 2).sum(-1)
        if best_err is None:
            best_err, best_scale, best_q = err, scale, q
        else:
            better = err < best_err  # ties keep the larger clip (absmax first)
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, scale, best_scale)
            best_q = torch.where(better[..., None], q, best_q)
    return best_q.reshape(out, inp).to(torch.int8), best_scale


def dequantize(q, scale, group_size: int = GROUP_SIZE):
    out, inp = q.shape
    g = q.float().reshape(out, inp // group_size, group_size)
    return (g * scale.float()[..., None]).reshape(out, inp)


def pack_int4(q):
    """int8 [out, in] in [-8, 7] -> int32 [out, in/8], compressed-tensors layout."""
    import torch

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
    return {"metadata": {}, "weight_map": {k: "model.safetensors"
                                           for k in _safetensors_keys(single)}}


def _safetensors_keys(path: Path) -> list[str]:
    """Tensor names from a safetensors header (stdlib only)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return [k for k in header if k != "__metadata__"]


def module_regex(names: list[str]) -> str:
    """A vLLM compressed-tensors target matching exactly these modules."""
    mods = sorted(n[: -len(".weight")] for n in names)
    return "re:^(" + "|".join(re.escape(m) for m in mods) + ")$"


def _ignore_matches(entry: str, module: str) -> bool:
    """As vLLM's compressed-tensors ignore check (is_equal_or_regex_match)."""
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return entry == module


def _unignore(entry: str, mods: list[str]) -> str | None:
    """The ignore entry, changed so that it matches none of mods (None: drop it).

    A plain name that is one of mods is dropped. A regex (re:) that matches
    some of mods gets a negative lookahead for exactly those module names, so
    it keeps ignoring everything else it did (e.g. "re:.*mtp.*" keeps the MTP
    attention and shared expert unquantized).
    """
    hit = [m for m in mods if _ignore_matches(entry, m)]
    if not hit:
        return entry
    if not entry.startswith("re:"):
        return None
    alt = "|".join(re.escape(m) for m in sorted(hit))
    return f"re:(?!(?:{alt})$)(?:{entry[3:]})"


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
    group = {
        "targets": [module_regex(names)],
        "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                    "strategy": "group", "group_size": group_size,
                    "dynamic": False, "actorder": None, "observer": "minmax"},
        "input_activations": None,
        "output_activations": None,
        "format": "pack-quantized",
    }
    # First: vLLM takes the first group whose target matches a layer name, so
    # an existing group with a regex over the experts must not come before it.
    others = {k: v for k, v in (qc.get("config_groups") or {}).items() if k != GROUP_NAME}
    qc["config_groups"] = {GROUP_NAME: group, **others}
    mods = sorted(n[: -len(".weight")] for n in names)
    if qc.get("ignore"):
        kept = (_unignore(x, mods) for x in qc["ignore"])
        qc["ignore"] = [x for x in kept if x is not None]
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


def build_index(index: dict, names: list[str]) -> dict:
    """The overlay index: every name keeps its shard, except the quantized
    experts. Their bf16 names stay listed, assigned to mtp-int4.safetensors
    (which does not hold them): that is what tells vLLM (0120) to skip the
    bf16 copies in the shards; the packed names are assigned there too."""
    new_index = copy.deepcopy(index)
    new_index.setdefault("metadata", {})
    wm = new_index["weight_map"]
    for n in names:
        wm[n] = OUT_WEIGHTS
        base = n[: -len(".weight")]
        for suffix in ("weight_packed", "weight_scale", "weight_shape"):
            wm[f"{base}.{suffix}"] = OUT_WEIGHTS
    return new_index


def linked_names(ckpt: Path) -> list[str]:
    """Every entry of the checkpoint directory except the files OUT writes."""
    return sorted(p.name for p in ckpt.iterdir() if p.name not in OWN_FILES)


def _check_out(out: Path, links: list[str]) -> None:
    """OUT may hold only what an earlier run wrote (its files, symlinks)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise SystemExit(f"{out} exists and is not a directory")
    foreign = [p.name for p in out.iterdir()
               if p.name not in OWN_FILES and not p.is_symlink()
               and not p.name.startswith(".mtp-int4-tmp")]
    if foreign:
        raise SystemExit(f"{out} holds files this tool did not write ({', '.join(foreign[:5])}); "
                         "pass an empty or new directory")


def write_links(out: Path, links: list[str], mount: str) -> None:
    keep = set(links)
    for p in out.iterdir():  # symlinks of an earlier run to names now gone
        if p.is_symlink() and p.name not in keep:
            p.unlink()
    for name in links:
        dst = out / name
        if dst.is_symlink() or dst.exists():
            dst.unlink()
        os.symlink(f"{mount.rstrip('/')}/{name}", dst)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".mtp-int4-tmp-{path.name}")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="checkpoint directory (read only)")
    ap.add_argument("out", type=Path, help="output model directory (MTP_INT4_DIR)")
    ap.add_argument("--checkpoint-mount", default=DEFAULT_MOUNT,
                    help="where the checkpoint is mounted when OUT is served: the "
                         f"symlinks point there (default {DEFAULT_MOUNT}, compose's mount)")
    ap.add_argument("--pattern", default=DEFAULT_PATTERN,
                    help="regex of the weight names to quantize (default: MTP routed experts)")
    ap.add_argument("--group-size", type=int, default=GROUP_SIZE)
    ap.add_argument("--clip-steps", type=int, default=20,
                    help="clip candidates from 1.0 to 0.5 x absmax (default 20)")
    ap.add_argument("--dry-run", action="store_true", help="print what would be written")
    ap.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    args = ap.parse_args(argv)

    ckpt = args.checkpoint
    cfg_path = ckpt / OUT_CONFIG
    if not cfg_path.exists():
        raise SystemExit(f"{cfg_path} not found; pass the checkpoint directory")
    if args.out.resolve() == ckpt.resolve():
        raise SystemExit("OUT must differ from the checkpoint: the checkpoint is never changed")
    index, names = plan(ckpt, args.pattern)
    cfg = build_config(json.loads(cfg_path.read_text()), names, args.group_size)
    new_index = build_index(index, names)
    links = linked_names(ckpt)
    _check_out(args.out, links)
    mount = args.checkpoint_mount.rstrip("/") or "/"
    resolves = Path(mount).resolve() == ckpt.resolve()
    summary = {"out": str(args.out), "quantized": len(names), "group_size": args.group_size,
               "symlinks": len(links), "checkpoint_mount": mount,
               "symlinks_resolve_here": resolves}

    if args.dry_run:
        print(f"would quantize {len(names)} tensors (INT4 g{args.group_size}, symmetric, "
              f"clip search {args.clip_steps} steps), e.g. {names[0]}")
        for f in OWN_FILES:
            print(f"would write {args.out / f}")
        print(f"would link {len(links)} checkpoint entries as {args.out}/<name> -> {mount}/<name>")
        if args.json:
            print(json.dumps({**summary, "dry_run": True}))
        return 0

    try:
        import torch
        from safetensors import safe_open
        from safetensors.torch import save_file
    except ImportError as e:
        raise SystemExit(f"make_mtp_int4.py: {e.name or e} is missing: {WHERE_TO_RUN}") from None
    try:
        from tqdm import tqdm
    except ImportError:  # progress as plain lines
        tqdm = None

    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(index["weight_map"][n], []).append(n)
    sse = ref = 0.0
    done = 0
    bar = tqdm(total=len(names), desc=f"int4 g{args.group_size}", unit="tensor") if tqdm else None
    for fname, fnames in by_file.items():
        with safe_open(str(ckpt / fname), framework="pt") as f:
            for n in fnames:
                w = f.get_tensor(n)
                sdtype = w.dtype if w.dtype in (torch.float16, torch.bfloat16) \
                    else torch.bfloat16
                q, scale = quantize_rtn(w, args.group_size, args.clip_steps,
                                        scale_dtype=sdtype)
                wd = dequantize(q, scale, args.group_size)
                sse += float(((wd - w.float()) ** 2).sum())
                ref += float((w.float() ** 2).sum())
                base = n[: -len(".weight")]
                tensors[f"{base}.weight_packed"] = pack_int4(q)
                tensors[f"{base}.weight_scale"] = scale.to(sdtype).contiguous()
                tensors[f"{base}.weight_shape"] = torch.tensor(list(w.shape),
                                                               dtype=torch.int64)
                done += 1
                if bar is not None:
                    bar.update(1)
                elif done % 100 == 0 or done == len(names):
                    print(f"int4 g{args.group_size}: {done}/{len(names)} tensors", flush=True)
    if bar is not None:
        bar.close()
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / f".mtp-int4-tmp-{OUT_WEIGHTS}"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, args.out / OUT_WEIGHTS)
    write_links(args.out, links, mount)
    # Index and config last: an interrupted run leaves no directory that
    # looks servable with stale weights.
    _write_text(args.out / OUT_CONFIG, json.dumps(cfg, indent=2) + "\n")
    _write_text(args.out / OUT_INDEX, json.dumps(new_index, indent=2) + "\n")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    rel = sse / max(ref, 1e-30)
    print(f"wrote {args.out} ({len(names)} tensors, {total / 2**30:.3f} GiB, "
          f"relative squared error {rel:.3e}; {len(links)} symlinks -> {mount}/)")
    if not resolves:
        print(f"the symlinks point at {mount}/, where compose/mtp.yaml mounts the checkpoint; "
              "on this host they dangle, which is expected (serve OUT through compose)")
    if args.json:
        print(json.dumps({**summary, "bytes": total, "relative_squared_error": rel}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
