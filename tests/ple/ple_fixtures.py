"""Tiny synthetic Qwen4Exp PLE checkpoints shared by the tests/ple tests."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# 2 PLE layers (1-based ids 2 and 4 -> dense ids 0, 1), 4 heads of 8 dims,
# primes near 50 so each table has ~210 rows, 4 checkpoint shards per layer.
TEXT_CONFIG = dict(
    num_hidden_layers=4,
    hidden_size=64,
    ple_layer_ids=[2, 4],
    ple_embed_dim=32,
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=50,
    make_ngram_vocab_size_divisible_by=8,
    split_ngram_parts=4,
    vocab_size=1000,
    eos_token_id=7,
)


def table_shards(layout, seed=0, dtype=torch.bfloat16):
    """{checkpoint name: tensor} of every table shard, random values."""
    gen = torch.Generator().manual_seed(seed)
    shards = {}
    for dense_id, layer_id in enumerate(layout.ple_layer_ids):
        rows, step = layout.rows[dense_id], layout.shard_rows(dense_id)
        for k in range(layout.split_ngram_parts):
            n = max(0, min(step, rows - k * step))
            name = (
                f"model.language_model.layers.{layer_id - 1}.ple.ple_embedding."
                f"ngram_embedding.shard_{k}.weight"
            )
            shards[name] = torch.randn(n, layout.head_dim, generator=gen).to(dtype)
    return shards


def write_checkpoint(directory: Path, shards: dict, text_config=None, extra=None):
    """config.json + the shards split over two safetensors files."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "qwen4_exp", "text_config": text_config or TEXT_CONFIG}
    (directory / "config.json").write_text(json.dumps(cfg))
    names = sorted(shards)
    half = len(names) // 2
    other = {"model.language_model.norm.weight": torch.ones(4)}
    other.update(extra or {})
    save_file({n: shards[n] for n in names[:half]} | other,
              str(directory / "model-00001-of-00002.safetensors"))
    save_file({n: shards[n] for n in names[half:]},
              str(directory / "model-00002-of-00002.safetensors"))


def expected_table_bytes(layout, shards) -> bytes:
    """The file content by definition: shards in layer then shard order."""
    parts = []
    for dense_id, layer_id in enumerate(layout.ple_layer_ids):
        for k in range(layout.split_ngram_parts):
            for name, t in shards.items():
                if name.endswith(f"layers.{layer_id - 1}.ple.ple_embedding."
                                 f"ngram_embedding.shard_{k}.weight"):
                    parts.append(t.to(torch.bfloat16).view(torch.int16).numpy()
                                 .tobytes())
    return b"".join(parts)
