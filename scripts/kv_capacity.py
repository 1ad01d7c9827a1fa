#!/usr/bin/env python3
"""KV-cache capacity planner for Qwen3.8-Flash-Next (qwen4_exp) with QSA K/V offload.

Forward mode: from ``--kv-cache-memory-bytes`` print the blocks, the attention
block size, R (blocks one max-length request uses), how many max-length
requests fit, the pinned host RAM and the VRAM per PP rank.

Inverse mode: ``--ram-budget-gib G`` prints the largest flag value whose pinned
host memory (K/V pool + the streamed ViT blocks + the MTP draft embed) fits in G GiB; ``--want 4x262144`` prints the smallest flag value that
holds 4 requests of 262,144 tokens.

Nothing is a constant of the model: the mamba page comes from the gated
delta-net state shapes, the QSA VRAM bytes per token from the indexer fields,
the per-rank QSA layer counts from ``layer_types`` + the PP split (+ MTP layers
on the last rank), and R from the same group packing as
``vllm/v1/core/kv_cache_utils.py:_get_packed_kv_cache_groups`` (0.30.0).

Reproduces SPEC "Capacity model" (checked by tests/qsa/test_qsa_kv_capacity.py):
  550 MB  -> 171 blocks, R 42 / 61 -> 4.07 / 2.80 requests of 262,144
  783 MB  -> 244 blocks, R 61 -> 4.00;  MTP: 242 / 85 = 2.85; 550 MB MTP: 2.00
  page 3,207,168 B (MTP 3,227,648 B), block 12,144 (MTP 9,776) tokens,
  pinned ~= 93 x kv_cache_memory_bytes, 550 MB MTP -> 41.2 GiB.

The derivation section below (between the DERIVATION markers) is also carried
by the qsa-kv-offload patch as vllm/models/qwen4_exp/common/qsa_capacity.py;
the tests check both give the same results.

Pure Python (stdlib only), so it runs anywhere, without vllm or torch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parent / "data" / "qwen4_exp_flash_next_config.json"

# ---- DERIVATION (keep identical to vllm/models/qwen4_exp/common/qsa_capacity.py) ----

DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "float8_e4m3fn": 1, "fp8_e4m3": 1,
}

# Kernel block alignment of the attention block: FA/QSA kernels take
# MultipleOf(16) (nv/qsa.py:73-76); vLLM's hybrid alignment also uses 16.
BLOCK_ALIGN = 16

# VRAM bytes per token per QSA layer beyond the compressed indexer key.
# The article (SPEC §7) sizes the VRAM part of a QSA layer at 66 B/token
# ("5 layer x 66 B/token fit the 3,227,648 B page -> 9,776"); 0.30.0 stores
# idx_dim*dsz/ratio = 64 B of compressed key per token.  The 2 B/token (3 %)
# margin keeps the block the article measured its capacity with (12,144 /
# 9,776; at 64 B it would be 12,528 / 10,080), so R = 61/42/85 and the SPEC
# capacity figures hold.  The QSA part still fits the page either way.
QSA_VRAM_MARGIN_BYTES_PER_TOKEN = 2


def dtype_bytes(name: str) -> int:
    key = str(name).replace("torch.", "").lower()
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def text_config(config: dict) -> dict:
    """The language-model part of an HF config.json (nested text_config wins)."""
    merged = dict(config)
    merged.update(config.get("text_config") or {})
    return merged


def layer_types(cfg: dict) -> list[str]:
    """'full_attention' / 'linear_attention' per decoder layer (Qwen3-Next default:
    every 4th layer full, transformers_utils/configs/qwen3_next.py:250-254)."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention"
                 for i in range(n)]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries, num_hidden_layers={n}")
    return list(types)


def is_qsa_model(cfg: dict) -> bool:
    # A full-attention layer is QSA iff the indexer is configured (nv/model.py:217-233).
    return cfg.get("indexer_n_heads") is not None


def pp_partition(num_layers: int, pp_size: int, partition: str | None = None) -> list[int]:
    """Layers per PP rank, as vllm.distributed.utils.get_pp_indices
    (VLLM_PP_LAYER_PARTITION string, else even split with the remainder on
    the middle ranks)."""
    if partition:
        parts = [int(x) for x in str(partition).split(",")]
        if len(parts) != pp_size or sum(parts) != num_layers:
            raise ValueError(f"partition {partition!r} must have {pp_size} entries "
                             f"summing to {num_layers}")
        return parts
    parts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        parts[-i] += 1
    return parts


def rank_of_layers(parts: list[int]) -> list[int]:
    return [r for r, n in enumerate(parts) for _ in range(n)]


def gdn_page_bytes(cfg: dict, num_spec: int = 0, tp: int = 1,
                   ssm_dtype: str | None = None, conv_dtype: str | None = None) -> int:
    """Gated delta-net state page (mamba_utils.gated_delta_net_state_shape):
    conv (2*k_heads*dk + v_heads*dv)/TP x (conv_kernel-1+num_spec) + ssm v_heads/TP x dv x dk."""
    conv_dtype = conv_dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    ssm_dtype = ssm_dtype or cfg.get("mamba_ssm_dtype") or conv_dtype
    kh, vh = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
    conv_dim = (2 * kh * dk + vh * dv) // tp
    conv = conv_dim * (int(cfg["linear_conv_kernel_dim"]) - 1 + num_spec) * dtype_bytes(conv_dtype)
    ssm = (vh // tp) * dv * dk * dtype_bytes(ssm_dtype)
    return conv + ssm


def ple_page_bytes(cfg: dict, num_spec: int = 0) -> int:
    """PLE short-conv state page (nv/model.py get_ple_mamba_state_shape_from_config):
    hidden*hc x ((ple_conv_kernel-1)*ngram + num_spec), model dtype, TP-replicated."""
    if not cfg.get("ple_layer_ids"):
        return 0
    dt = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    chans = int(cfg["hidden_size"]) * int(cfg.get("hc_count", 4))
    state_len = (int(cfg.get("ple_conv_kernel_size", 4)) - 1) * int(cfg.get("ngram_size", 3))
    return chans * (state_len + num_spec) * dtype_bytes(dt)


def qsa_kv_bytes_per_token(cfg: dict, tp: int = 1) -> int:
    """Main K/V of one QSA layer: 2 (K,V) x kv_heads/TP x head_dim x bf16 (nv/qsa.py:339-347)."""
    return 2 * (int(cfg["num_key_value_heads"]) // tp) * int(cfg["head_dim"]) * 2


def qsa_compressed_key_bytes_per_token(cfg: dict, indexer_dtype: str = "bf16") -> int:
    """Compressed indexer key: idx_dim x dsz per ratio tokens (qsa_cache.py:862-873)."""
    return int(cfg["indexer_head_dim"]) * dtype_bytes(indexer_dtype) // int(cfg["indexer_compress_ratio"])


def qsa_vram_bytes_per_token(cfg: dict, indexer_dtype: str = "bf16") -> int:
    """VRAM-resident bytes per token of one QSA layer once its K/V is in host RAM."""
    return qsa_compressed_key_bytes_per_token(cfg, indexer_dtype) + QSA_VRAM_MARGIN_BYTES_PER_TOKEN


def ring_capacity(cfg: dict, num_spec: int = 0) -> int:
    """Raw-key ring rows (qsa_cache.py:847-848): ratio * cdiv(ratio+num_spec, ratio)."""
    ratio = int(cfg["indexer_compress_ratio"])
    return ratio * cdiv(ratio + num_spec, ratio)


def qsa_layers_per_rank(cfg: dict, pp_size: int = 1, partition: str | None = None,
                        num_mtp_layers: int = 0) -> list[int]:
    """QSA layers held by each PP rank; MTP draft layers are QSA layers on the last rank."""
    types = layer_types(cfg)
    ranks = rank_of_layers(pp_partition(len(types), pp_size, partition))
    counts = [0] * pp_size
    if is_qsa_model(cfg):
        for t, r in zip(types, ranks):
            if t == "full_attention":
                counts[r] += 1
        counts[-1] += num_mtp_layers
    return counts


def aligned_block_size(mamba_page_bytes: int, qsa_layers_per_rank: list[int],
                       vram_bytes_per_token: int, divisor: int = 1,
                       align: int = BLOCK_ALIGN) -> int:
    """Largest multiple of lcm(align, divisor) tokens whose QSA VRAM part on the
    rank with the most QSA layers fits one mamba page (rounded down: the QSA
    group must not widen the block past the mamba page).  Every rank uses the
    same value, since all ranks' specs must agree (kv_cache_utils.py:2655-2664)."""
    step = math.lcm(align, max(1, divisor))
    per_token = max(qsa_layers_per_rank) * vram_bytes_per_token
    if per_token <= 0:
        raise ValueError("no QSA layer on any rank: nothing to align")
    block = step * (mamba_page_bytes // (step * per_token))
    if block <= 0:
        raise ValueError(f"mamba page {mamba_page_bytes} B is smaller than {step} tokens "
                         f"of QSA VRAM state ({per_token} B/token)")
    return block


def model_block_size(cfg: dict, pp_size: int = 1, partition: str | None = None,
                     num_spec: int = 0, num_mtp_layers: int = 0, tp: int = 1,
                     indexer_dtype: str = "bf16", ssm_dtype: str | None = None) -> int:
    """Attention block size for QSA offload from a model config + rank layout."""
    page = max(gdn_page_bytes(cfg, num_spec, tp, ssm_dtype), ple_page_bytes(cfg, num_spec))
    ratio = int(cfg["indexer_compress_ratio"])
    # The ring must divide the block (qsa_cache.py:849) and the compressed
    # cache needs whole groups (qsa_cache.py:777).
    divisor = math.lcm(ratio, ring_capacity(cfg, num_spec))
    return aligned_block_size(page, qsa_layers_per_rank(cfg, pp_size, partition, num_mtp_layers),
                              qsa_vram_bytes_per_token(cfg, indexer_dtype), divisor)


def packed_groups(layers: list[tuple[str, int, int]]) -> list[list[tuple[str, int, int]]]:
    """Group layers like _get_packed_kv_cache_groups (kv_cache_utils.py:1978-2112)
    for the offload layout, where every bucket has a single page size:
    layers = [(kind, page_bytes, rank)] in model order, kind in
    {'attn', 'ring', 'mamba:<name>'}.  Attention buckets stay one group; state
    buckets (mamba, ring) are cut to anchor // page states per group, the anchor
    being the widest non-state group over the WHOLE model (PP-unaware, as upstream),
    layers dealt round-robin."""
    buckets: dict[tuple[str, int], list[tuple[str, int, int]]] = {}
    for layer in layers:
        buckets.setdefault((layer[0], layer[1]), []).append(layer)
    is_state = {key: key[0] != "attn" for key in buckets}
    anchor = max((page * (1 if is_state[(k, page)] else len(ls))
                  for (k, page), ls in buckets.items()), default=0)
    groups = []
    for key, ls in buckets.items():
        n = 1
        if is_state[key] and anchor:
            n = max(1, cdiv(len(ls), max(anchor // key[1], 1)))
        groups.extend([ls[i::n] for i in range(n)])
    return groups


def blocks_per_request(kind: str, block_size: int, max_len: int, mamba_mode: str,
                       num_spec: int) -> int:
    """Per-request blocks of one group (kv_cache_interface.py): attention
    cdiv(len, block); ring 1; mamba align 2+spec, none 1+spec."""
    if kind == "attn":
        return cdiv(max_len, block_size)
    if kind == "ring":
        return 1
    if mamba_mode == "align":
        return 2 + num_spec
    if mamba_mode == "none":
        return 1 + num_spec
    raise ValueError(f"mamba cache mode {mamba_mode!r}: qwen4_exp supports align / none")


def capacity_layout(cfg: dict, *, pp_size: int = 1, partition: str | None = None,
                    max_model_len: int, prefix_caching: bool, num_spec: int = 0,
                    num_mtp_layers: int | None = None, tp: int = 1,
                    indexer_dtype: str = "bf16", ssm_dtype: str | None = None,
                    uses_mrope: bool = False, block_size: int | None = None) -> dict:
    """Per-block geometry of the offload layout: block size, R, page per rank,
    host K/V bytes per block per rank."""
    if num_mtp_layers is None:
        num_mtp_layers = int(cfg.get("mtp_num_hidden_layers", 1)) if num_spec else 0
    mode = "align" if prefix_caching else "none"
    if block_size is None:
        block_size = model_block_size(cfg, pp_size, partition, num_spec, num_mtp_layers,
                                      tp, indexer_dtype, ssm_dtype)
    types = layer_types(cfg)
    ranks = rank_of_layers(pp_partition(len(types), pp_size, partition))
    gdn = gdn_page_bytes(cfg, num_spec, tp, ssm_dtype)
    ple = ple_page_bytes(cfg, num_spec)
    ratio = int(cfg["indexer_compress_ratio"])
    mla = (block_size // ratio) * int(cfg["indexer_head_dim"]) * dtype_bytes(indexer_dtype)
    ring_width = int(cfg["indexer_head_dim"]) + (12 if uses_mrope else 0)
    ring = ring_capacity(cfg, num_spec) * ring_width * 2
    ple_layers = {int(i) - 1 for i in cfg.get("ple_layer_ids") or []}
    layers = []
    for i, (t, r) in enumerate(zip(types, ranks)):
        if t == "full_attention":
            layers += [("attn", mla, r), ("ring", ring, r)]
        else:
            layers.append(("mamba:gdn", gdn, r))
        if i in ple_layers:
            layers.append(("mamba:ple", ple, r))
    for _ in range(num_mtp_layers):
        layers += [("attn", mla, pp_size - 1), ("ring", ring, pp_size - 1)]
    groups = packed_groups(layers)
    r_total = sum(blocks_per_request(g[0][0].split(":")[0], block_size, max_model_len,
                                     mode, num_spec) for g in groups)
    per_rank_block = [max(sum(p for _, p, rr in g if rr == r) for g in groups)
                      for r in range(pp_size)]
    qsa = qsa_layers_per_rank(cfg, pp_size, partition, num_mtp_layers)
    kv_tok = qsa_kv_bytes_per_token(cfg, tp)
    return {
        "block_size": block_size,
        "mamba_cache_mode": mode,
        "mamba_page_bytes": max(gdn, ple),
        "page_bytes": max(per_rank_block),
        "bytes_per_block_per_rank": per_rank_block,
        "R": r_total,
        "num_groups": len(groups),
        "num_gdn_groups": sum(1 for g in groups if g[0][0] == "mamba:gdn"),
        "qsa_layers_per_rank": qsa,
        "qsa_vram_bytes_per_token": qsa_vram_bytes_per_token(cfg, indexer_dtype),
        "qsa_kv_bytes_per_token": kv_tok,
        "host_bytes_per_block_per_rank": [block_size * kv_tok * n for n in qsa],
        # Prefill staging arena: (most QSA layers on any rank) x block x 2 KiB.
        "staging_arena_bytes": max(qsa) * block_size * kv_tok,
    }


def capacity(layout: dict, kv_cache_memory_bytes: int, max_model_len: int) -> dict:
    blocks = kv_cache_memory_bytes // layout["page_bytes"]
    requests = blocks / layout["R"]
    host = [blocks * b for b in layout["host_bytes_per_block_per_rank"]]
    vram = [blocks * b + layout["staging_arena_bytes"] for b in layout["bytes_per_block_per_rank"]]
    return {
        "kv_cache_memory_bytes": kv_cache_memory_bytes,
        "blocks": blocks,
        "requests": requests,
        "tokens": int(requests * max_model_len),
        "pinned_host_bytes_per_rank": host,
        "pinned_host_bytes": sum(host),
        "pinned_host_gib": sum(host) / 2**30,
        "pinned_per_kv_byte": sum(host) / kv_cache_memory_bytes if kv_cache_memory_bytes else 0.0,
        "vram_bytes_per_rank": vram,
        # SPEC: 1,405 tokens per MiB of VRAM, 15,460 per GiB of RAM (R=61).
        "tokens_per_mib_vram": max_model_len * 2**20 / (layout["R"] * layout["page_bytes"]),
        "tokens_per_gib_ram": max_model_len * 2**30
        / (layout["R"] * sum(layout["host_bytes_per_block_per_rank"])),
    }


def flag_for_ram_budget(layout: dict, ram_budget_bytes: int) -> int:
    """Largest --kv-cache-memory-bytes (a whole number of pages) whose pinned pool fits."""
    blocks = ram_budget_bytes // sum(layout["host_bytes_per_block_per_rank"])
    return blocks * layout["page_bytes"]


def flag_for_requests(layout: dict, num_requests: int) -> int:
    """Smallest --kv-cache-memory-bytes holding num_requests max-length requests."""
    return cdiv(num_requests * layout["R"], 1) * layout["page_bytes"]

# ---- END DERIVATION ----


# Pinned host RAM the other patches take besides the K/V pool (per PP rank).
# 0610-vit-stream keeps the 27 ViT blocks (0.836 GiB BF16, SPEC s6) in pinned
# memory on rank 0, one torch pin_memory buffer per block: torch's host
# allocator rounds each 31.7 MiB block up to 32 MiB.
VIT_BLOCKS = 27
VIT_BYTES = int(0.836 * 2**30)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def vit_pinned_bytes() -> int:
    return VIT_BLOCKS * _next_pow2(cdiv(VIT_BYTES, VIT_BLOCKS))


def mtp_embed_pinned_bytes(cfg: dict) -> int:
    """0640-mtp-fit: at PP>1 the draft's INT8 embed (vocab x hidden, one fp32
    scale per row) lives in 0210's exact-size pool on the last rank."""
    vocab, hidden = int(cfg["vocab_size"]), int(cfg["hidden_size"])
    return vocab * hidden + vocab * 4


def other_pinned_items(cfg: dict, pp_size: int, *, mtp: bool, vit: bool) -> list[tuple[str, int, int]]:
    """(what, rank, bytes) pinned outside the K/V pool: streamed ViT on rank 0,
    the MTP draft embed on the last rank (only at PP>1: at PP=1 it shares the
    target's embed in VRAM)."""
    items = []
    if vit:
        items.append(("ViT blocks on rank 0", 0, vit_pinned_bytes()))
    if mtp and pp_size > 1:
        items.append(("MTP embed on the last rank", pp_size - 1, mtp_embed_pinned_bytes(cfg)))
    return items


def other_pinned_bytes(cfg: dict, pp_size: int, *, mtp: bool, vit: bool) -> list[int]:
    """Pinned bytes per rank outside the K/V pool (other_pinned_items summed)."""
    per_rank = [0] * pp_size
    for _, rank, nbytes in other_pinned_items(cfg, pp_size, mtp=mtp, vit=vit):
        per_rank[rank] += nbytes
    return per_rank


def load_config(path: str | Path) -> dict:
    try:
        return text_config(json.loads(Path(path).read_text()))
    except FileNotFoundError:
        sys.exit(f"kv_capacity: config {path} not found; pass the checkpoint's config.json "
                 "with --config")


def parse_want(text: str) -> tuple[int, int]:
    try:
        n, ctx = text.lower().replace("×", "x").split("x")
        return int(n), int(ctx.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--want wants NxCONTEXT, e.g. 4x262144, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n"
               "  kv_capacity.py --kv-cache-memory-bytes 783000000\n"
               "  kv_capacity.py --kv-cache-memory-bytes 550000000 --mtp --pp-layer-partition 16,17,15\n"
               "  kv_capacity.py --want 4x262144 --json\n"
               "  kv_capacity.py --ram-budget-gib 70",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG),
                   help="model config.json (default: the Qwen3.8-Flash-Next shape in scripts/data/)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=262144)
    p.add_argument("--prefix-caching", dest="prefix_caching", action="store_true", default=True,
                   help="--enable-prefix-caching (mamba cache mode align; default)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="prefix caching off (mamba cache mode none)")
    p.add_argument("--mtp", action="store_true", help="MTP speculative decoding, 1 token")
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--pp", type=int, default=3, help="pipeline-parallel size (default 3)")
    p.add_argument("--pp-layer-partition", default=None,
                   help="VLLM_PP_LAYER_PARTITION, e.g. 16,17,15")
    p.add_argument("--indexer-kv-dtype", default="bf16", choices=["bf16", "fp8"])
    p.add_argument("--mamba-ssm-cache-dtype", default=None,
                   help="override the config's mamba_ssm_dtype")
    p.add_argument("--mrope", action="store_true", help="multimodal MRoPE positions in the ring")
    p.add_argument("--no-vit", dest="vit", action="store_false", default=True,
                   help="VLLM_VIT_STREAM=0 (ViT resident in VRAM) or a build without the ViT: no pinned ViT blocks on rank 0")
    inv = p.add_mutually_exclusive_group()
    inv.add_argument("--ram-budget-gib", type=float, default=None,
                     help="inverse: pinned host RAM budget (all ranks) -> flag value")
    inv.add_argument("--want", type=parse_want, default=None,
                     help="inverse: NxCONTEXT, e.g. 4x262144 -> flag value")
    p.add_argument("--json", action="store_true", help="print JSON")
    a = p.parse_args(argv)

    cfg = load_config(a.config)
    num_spec = a.num_speculative_tokens if a.num_speculative_tokens is not None else int(a.mtp)
    max_len = a.max_model_len
    if a.want:
        max_len = a.want[1]
    try:
        lay = capacity_layout(cfg, pp_size=a.pp, partition=a.pp_layer_partition,
                              max_model_len=max_len, prefix_caching=a.prefix_caching,
                              num_spec=num_spec, indexer_dtype=a.indexer_kv_dtype,
                              ssm_dtype=a.mamba_ssm_cache_dtype, uses_mrope=a.mrope)
    except (KeyError, ValueError) as e:
        sys.exit(f"kv_capacity: {e} (check --config and the layout flags)")

    other_items = other_pinned_items(cfg, a.pp, mtp=num_spec > 0, vit=a.vit)
    other = other_pinned_bytes(cfg, a.pp, mtp=num_spec > 0, vit=a.vit)
    out = {"config": str(a.config), "max_model_len": max_len, "pp": a.pp,
           "num_speculative_tokens": num_spec, "layout": lay}
    flag = a.kv_cache_memory_bytes
    if a.want:
        flag = flag_for_requests(lay, a.want[0])
        out["inverse"] = {"want_requests": a.want[0], "want_context": a.want[1],
                          "kv_cache_memory_bytes_min": flag,
                          "kv_cache_memory_bytes_mb": cdiv(flag, 10**6) * 10**6}
    elif a.ram_budget_gib is not None:
        # The budget is all pinned RAM: the ViT blocks and the MTP embed come first.
        kv_budget = int(a.ram_budget_gib * 2**30) - sum(other)
        if kv_budget <= 0:
            sys.exit(f"kv_capacity: --ram-budget-gib {a.ram_budget_gib} does not cover the "
                     f"{sum(other) / 2**30:.2f} GiB pinned outside the K/V pool "
                     "(ViT blocks, MTP embed); raise it or pass --no-vit")
        flag = flag_for_ram_budget(lay, kv_budget)
        if flag == 0:
            need = sum(other) + sum(lay["host_bytes_per_block_per_rank"])
            sys.exit(f"kv_capacity: --ram-budget-gib {a.ram_budget_gib} holds no K/V block; "
                     f"one block needs {need / 2**30:.2f} GiB pinned in all")
        out["inverse"] = {"ram_budget_gib": a.ram_budget_gib, "kv_cache_memory_bytes_max": flag}
    if flag is None:
        p.error("give --kv-cache-memory-bytes, or --want / --ram-budget-gib")
    out["capacity"] = capacity(lay, flag, max_len)
    kv_host = out["capacity"]["pinned_host_bytes_per_rank"]
    out["pinned_other_bytes_per_rank"] = other
    out["pinned_total_bytes_per_rank"] = [k + o for k, o in zip(kv_host, other)]
    out["pinned_total_gib"] = sum(out["pinned_total_bytes_per_rank"]) / 2**30

    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    c = out["capacity"]
    gib = 2**30
    print(f"config            {a.config}")
    print(f"layout            PP={a.pp} QSA layers/rank {lay['qsa_layers_per_rank']}, "
          f"spec tokens {num_spec}, mamba mode {lay['mamba_cache_mode']}")
    print(f"mamba page        {lay['mamba_page_bytes']:,} B; block page {lay['page_bytes']:,} B")
    print(f"block size        {lay['block_size']:,} tokens "
          f"(QSA VRAM {lay['qsa_vram_bytes_per_token']} B/token/layer)")
    print(f"R                 {lay['R']} blocks per {max_len:,}-token request "
          f"({lay['num_groups']} groups, {lay['num_gdn_groups']} GDN)")
    if "inverse" in out:
        for k, v in out["inverse"].items():
            print(f"{k:<28}{v:,}" if isinstance(v, int) else f"{k:<28}{v}")
    print(f"--kv-cache-memory-bytes {c['kv_cache_memory_bytes']:,} -> {c['blocks']} blocks")
    print(f"capacity          {c['requests']:.2f} requests x {max_len:,} = {c['tokens']:,} tokens")
    print(f"pinned host RAM   {c['pinned_host_gib']:.1f} GiB "
          f"({c['pinned_per_kv_byte']:.1f} x kv bytes); per rank "
          + ", ".join(f"{b / gib:.2f}" for b in c["pinned_host_bytes_per_rank"]) + " GiB")
    if any(other):
        what = ", ".join(w for w, _, _ in other_items)
        print(f"pinned, other     {sum(other) / gib:.2f} GiB ({what}); all pinned {out['pinned_total_gib']:.1f} GiB, per rank "
              + ", ".join(f"{b / gib:.2f}" for b in out["pinned_total_bytes_per_rank"]) + " GiB")
    print("VRAM per rank     " + ", ".join(f"{b / 2**20:.0f}" for b in c["vram_bytes_per_rank"])
          + f" MiB (incl. {lay['staging_arena_bytes'] / 2**20:.1f} MiB staging arena)")
    print(f"per block cost    {c['tokens_per_mib_vram']:,.0f} tokens/MiB VRAM, "
          f"{c['tokens_per_gib_ram']:,.0f} tokens/GiB pinned RAM")
    return 0


if __name__ == "__main__":
    sys.exit(main())
