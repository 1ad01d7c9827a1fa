#!/usr/bin/env python3
"""Extract the Qwen4Exp PLE n-gram table from a checkpoint into the raw file
that VLLM_PLE_MMAP_PATH expects (format: vllm/ple_table_format.py).

    python scripts/serve-tools/make_ple_table.py --checkpoint DIR --out FILE
    python scripts/serve-tools/make_ple_table.py --checkpoint DIR --out FILE --verify

The table is streamed from the safetensors files in --chunk-kib pieces
(never in RAM as a whole: it is 95.37 GiB for the production model and the
target machine has ~125 GiB with the server running), written to
FILE.tmp-<pid> and renamed to FILE only when complete. --verify checks an
existing FILE: its size against the model config, and its sha256 against
the sha256 of the same bytes streamed from the checkpoint.
Needs only the standard library and numpy (tqdm for a progress bar when
installed; no torch), and the patched vllm's vllm/ple_table_format.py
(patch 0100). --help works on any python3.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import struct
import sys
from dataclasses import dataclass


class _Bar:
    """tqdm when installed, else a line on stderr every 5 % (bare python3)."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n, self.next = total, desc, 0, 0.05
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc)
        except ImportError:
            self.bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()

    def update(self, n: int) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.total and self.n / self.total >= self.next:
            print(f"{self.desc}: {self.n / self.total:.0%} ({self.n >> 30} of {self.total >> 30} GiB)",
                  file=sys.stderr, flush=True)
            self.next = self.n / self.total + 0.05


def load_table_format():
    """Load vllm/ple_table_format.py by path: importing the vllm package
    would import torch."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: vllm is not installed (needed for vllm/ple_table_format.py)")
    path = os.path.join(spec.submodule_search_locations[0], "ple_table_format.py")
    if not os.path.isfile(path):
        sys.exit(
            f"error: {path} is missing: this vllm lacks patch 0100-ple-pp-mmap "
            "(apply the series first)"
        )
    mod_spec = importlib.util.spec_from_file_location("ple_table_format", path)
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules["ple_table_format"] = module  # dataclasses look it up there
    mod_spec.loader.exec_module(module)
    return module


ptf = None  # vllm/ple_table_format.py, loaded in main() so --help always works

# bytes per element of the dtypes a table shard may be stored in
_DTYPE_SIZES = {"BF16": 2, "F16": 2, "F32": 4}


class TableError(Exception):
    """A problem the user must fix; main() prints it without a traceback."""


@dataclass(frozen=True)
class ShardRef:
    path: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def read_safetensors_header(path: str) -> tuple[dict, int]:
    """(tensor table, byte offset of the data section) of one safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise TableError(f"{path}: not a safetensors file (too short)")
        (header_len,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return header, 8 + header_len


def find_table_shards(checkpoint: str) -> dict[tuple[int, int], ShardRef]:
    files = sorted(glob.glob(os.path.join(checkpoint, "*.safetensors")))
    if not files:
        raise TableError(f"no *.safetensors files in {checkpoint}")
    shards: dict[tuple[int, int], ShardRef] = {}
    for path in files:
        header, data_start = read_safetensors_header(path)
        for name, info in header.items():
            key = ptf.parse_ple_shard_name(name)
            if key is None:
                continue
            begin, end = info["data_offsets"]
            shards[key] = ShardRef(
                path, info["dtype"], tuple(info["shape"]), data_start + begin,
                data_start + end,
            )
    return shards


def plan(checkpoint: str):
    """Layout and, per file row range, the shard that fills it, in file order."""
    try:
        layout = ptf.layout_from_checkpoint(checkpoint)
    except FileNotFoundError as exc:
        raise TableError(f"{checkpoint}: no config.json ({exc})") from exc
    except ValueError as exc:
        raise TableError(f"{checkpoint}: {exc}") from exc
    shards = find_table_shards(checkpoint)
    if not shards:
        raise TableError(
            f"checkpoint {checkpoint} has no PLE table tensors (expected names "
            "like model.layers.N.ple.ple_embedding.ngram_embedding.shard_K.weight); "
            "use the checkpoint that still contains the PLE table"
        )
    steps = []
    missing = []
    for dense_id, layer_id in enumerate(layout.ple_layer_ids):
        shard_rows = layout.shard_rows(dense_id)
        rows = layout.rows[dense_id]
        for k in range(layout.split_ngram_parts):
            expect = max(0, min(shard_rows, rows - k * shard_rows))
            ref = shards.get((layer_id, k))
            if ref is None:
                if expect:
                    missing.append(f"layer {layer_id} shard {k}")
                continue
            if ref.shape != (expect, layout.head_dim):
                raise TableError(
                    f"{ref.path}: PLE layer {layer_id} shard {k} has shape "
                    f"{list(ref.shape)}, expected [{expect}, {layout.head_dim}] "
                    "from config.json"
                )
            if ref.dtype not in _DTYPE_SIZES:
                raise TableError(
                    f"{ref.path}: PLE layer {layer_id} shard {k} has dtype "
                    f"{ref.dtype}; supported: {sorted(_DTYPE_SIZES)}"
                )
            if expect:
                steps.append((dense_id, k, ref))
    if missing:
        raise TableError(
            f"checkpoint {checkpoint} lacks {len(missing)} PLE table shard(s), "
            f"first: {missing[0]}"
        )
    return layout, steps


def to_bf16_bits(raw: bytes, dtype: str) -> bytes:
    """Row bytes as bf16 (round to nearest even, like torch's .to(bfloat16))."""
    if dtype == "BF16":
        return raw
    import numpy as np

    values = np.frombuffer(raw, dtype="<f2" if dtype == "F16" else "<f4")
    bits = values.astype(np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    rounded[np.isnan(values)] = 0x7FC0
    return rounded.astype("<u2").tobytes()


def stream_table(steps, chunk_bytes: int):
    """Yield (dense_id, shard, bf16 bytes) for the whole file, in file order."""
    for dense_id, k, ref in steps:
        scale = _DTYPE_SIZES[ref.dtype] // 2
        step = max(chunk_bytes // (2 * scale), 1) * 2 * scale
        with open(ref.path, "rb", buffering=0) as f:
            f.seek(ref.begin)
            left = ref.end - ref.begin
            while left:
                raw = f.read(min(step, left))
                if not raw:
                    raise TableError(f"{ref.path}: truncated inside shard {k}")
                left -= len(raw)
                yield dense_id, k, to_bf16_bits(raw, ref.dtype)


def build(args) -> int:
    layout, steps = plan(args.checkpoint)
    out = os.path.abspath(args.out)
    if os.path.exists(out) and not args.force:
        raise TableError(f"{out} exists; pass --force to overwrite it")
    out_dir = os.path.dirname(out)
    free = shutil.disk_usage(out_dir).free
    if free < layout.file_size:
        raise TableError(
            f"{out_dir} has {free} bytes free, the table needs {layout.file_size}"
        )
    tmp = f"{out}.tmp-{os.getpid()}"
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as f, _Bar(layout.file_size, "PLE table") as bar:
            for _, _, data in stream_table(steps, args.chunk_kib << 10):
                f.write(data)
                digest.update(data)
                bar.update(len(data))
            f.flush()
            os.fsync(f.fileno())
        size = os.path.getsize(tmp)
        if size != layout.file_size:
            raise TableError(f"wrote {size} bytes, expected {layout.file_size}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    print(
        f"wrote {out}: {layout.total_rows} rows x {layout.row_bytes} B = "
        f"{layout.file_size} bytes, sha256 {digest.hexdigest()}"
    )
    print(f"serve it: PLE_TABLE={out} in .env (compose), or VLLM_PLE_MMAP_PATH={out} for `vllm serve`; "
          f"check it later with --verify")
    return 0


def verify(args) -> int:
    layout, steps = plan(args.checkpoint)
    out = os.path.abspath(args.out)
    ptf.check_table_file(out, layout)  # exists, readable, exact size
    want, got = hashlib.sha256(), hashlib.sha256()
    first_bad = None
    with open(out, "rb") as f, _Bar(layout.file_size, "verify") as bar:
        for dense_id, k, data in stream_table(steps, args.chunk_kib << 10):
            have = f.read(len(data))
            want.update(data)
            got.update(have)
            if first_bad is None and have != data:
                first_bad = (layout.ple_layer_ids[dense_id], k)
            bar.update(len(data))
    if want.digest() != got.digest():
        layer_id, k = first_bad
        print(
            f"MISMATCH: {out} sha256 {got.hexdigest()} != checkpoint "
            f"{want.hexdigest()}; first difference in PLE layer {layer_id} "
            f"shard {k}. Rebuild: python scripts/serve-tools/make_ple_table.py "
            f"--checkpoint {args.checkpoint} --out {args.out} --force",
            file=sys.stderr,
        )
        return 1
    print(f"OK: {out} size {layout.file_size}, sha256 {got.hexdigest()}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory")
    parser.add_argument("--out", required=True, help="table file to write/verify")
    parser.add_argument("--force", action="store_true", help="overwrite --out")
    parser.add_argument(
        "--verify", action="store_true",
        help="check an existing --out (size + sha256 vs the checkpoint); no write",
    )
    parser.add_argument(
        "--chunk-kib", type=int, default=65536, help="read size in KiB (default 64 MiB)"
    )
    args = parser.parse_args(argv)
    global ptf
    if ptf is None:
        ptf = load_table_format()
    try:
        return verify(args) if args.verify else build(args)
    except (TableError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
