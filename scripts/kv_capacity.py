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

Below the derivation, the LEDGER section counts, per PP rank, every byte the
series allocates beyond upstream (pinned pools, arena, row-cache state, kernel
scratch, worst per-step transients, weights moved or not built) and the VRAM
headroom left at the configured utilization; the table and --json print it.
Concurrency is (blocks - 1) / R: vLLM holds one block back as the null block
(783 MB -> 244 blocks -> 3.98 requests; the SPEC figures above count all).

``--kv-dtype fp8`` plans the QSA K/V pool in FP8 (1 B per element instead of
2; upstream's per-tensor scales add nothing per token): the same blocks,
block size and requests x tokens for a given flag, half the pinned K/V, and
the "PLE page cache" line says how much of the PLE table (``--ple-table-gib``,
95.37 GiB) the freed RAM lets the page cache keep, out of ``--ram-total-gib``.
Serving it takes VLLM_QSA_KV_FP8=1 (patch 0260-qsa-kv-fp8, opt-in, with
VLLM_QSA_KV_OFFLOAD=1): the host pool, the staging arena (same rows, half
the bytes) and the row cache hold e4m3 bytes.

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
    "fp8_e5m2": 1, "float8_e5m2": 1, "uint8": 1,
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

# Element types of the QSA main K/V (the host-resident pool under offload).
# bf16 by default; fp8 = vLLM 0.33.0's QSA FP8 cache, e4m3 stored as uint8
# bytes (below sm_89, i.e. the 3090, the kernel decodes the bytes itself),
# 1 byte per element: the opt-in VLLM_QSA_KV_FP8 (0260-qsa-kv-fp8).
QSA_KV_DTYPES = ("bf16", "fp8")
# Upstream's QSA FP8 scaling is per tensor: one K and one V scale per layer,
# host-side floats (layer._k_scale_float / _v_scale_float) folded into the
# kernel's softmax and output scales.  Nothing is stored per token.
QSA_KV_SCALE_BYTES_PER_TOKEN = {"bf16": 0, "fp8": 0}


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


def qsa_kv_bytes_per_token(cfg: dict, tp: int = 1, kv_dtype: str = "bf16") -> int:
    """Main K/V of one QSA layer: 2 (K,V) x kv_heads/TP x head_dim x the K/V
    element (nv/qsa.py:339-347), plus per-token scales (none: upstream's FP8
    scales are per tensor).  bf16 2,048 B, fp8 1,024 B."""
    if kv_dtype not in QSA_KV_DTYPES:
        raise ValueError(f"QSA K/V dtype {kv_dtype!r}; use one of {QSA_KV_DTYPES}")
    elems = 2 * (int(cfg["num_key_value_heads"]) // tp) * int(cfg["head_dim"])
    return elems * dtype_bytes(kv_dtype) + QSA_KV_SCALE_BYTES_PER_TOKEN[kv_dtype]


def qsa_compressed_key_bytes_per_token(cfg: dict, indexer_dtype: str = "bf16") -> int:
    """Compressed indexer key: idx_dim x dsz per ratio tokens (qsa_cache.py:862-873)."""
    return int(cfg["indexer_head_dim"]) * dtype_bytes(indexer_dtype) // int(cfg["indexer_compress_ratio"])


def qsa_vram_bytes_per_token(cfg: dict, indexer_dtype: str = "bf16") -> int:
    """VRAM-resident bytes per token of one QSA layer once its K/V is in host RAM.
    The K/V element type does not enter: host K/V takes no device bytes
    (UniformTypeKVCacheSpecs.page_size_bytes skips it), so an fp8 K/V leaves
    the block size and the device page as they are and halves the host pool."""
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
                    uses_mrope: bool = False, block_size: int | None = None,
                    kv_dtype: str = "bf16") -> dict:
    """Per-block geometry of the offload layout: block size, R, page per rank,
    host K/V bytes per block per rank (K/V elements of ``kv_dtype``)."""
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
    kv_tok = qsa_kv_bytes_per_token(cfg, tp, kv_dtype)
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
        "qsa_kv_dtype": kv_dtype,
        "qsa_kv_bytes_per_token": kv_tok,
        "host_bytes_per_block_per_rank": [block_size * kv_tok * n for n in qsa],
        # Prefill staging arena: (most QSA layers on any rank) x block x K/V
        # bytes per token (the arena holds the cache's dtype: bf16 2 KiB).
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


# ---- LEDGER: every allocation the series makes beyond upstream, per PP rank ----
#
# Each figure comes from a size function that mirrors the code (the function
# it mirrors is named beside it; tests/qsa/test_kv_ledger.py derives the same
# figures from the patched vllm's own functions/classes), and from the model
# config.  Where the write-up gives a figure it is printed beside ours.

# vLLM's BlockPool holds block 0 back as the null block (v1/core/block_pool.py:
# ``self.null_block = self.free_block_queue.popleft()``): of ``blocks`` pages,
# blocks - 1 hold requests.
NULL_BLOCKS = 1

# 0210: the pool is an anonymous mmap; the kernel backs it in whole pages.
HOST_PAGE = 4096
# 0610 vit_stream._ALIGN: each parameter (and each block's pack) starts on it.
VIT_ALIGN = 256
VIT_SLOTS = 2
# 0640 mtp_fit.ALIGN: parameter offsets inside the draft embed's buffer.
MTP_ALIGN = 256
# 0400 ops/hc_int8.py: split-K scratch per device (_DECODE_PARTIALS fp32 +
# _COUNTERS int32), allocated at load time, before graph capture.
HC_DECODE_PARTIALS = 128 * 1024
HC_COUNTERS = 4096
# 0500 ops/moe_fused.int6_to_planes: chunk temporaries (_CHUNK_TEMP_BYTES);
# the shared expert's intermediate size (bench_moe_fused.py I; the text
# config of the checkpoint does not name it).
INT6_CHUNK_TEMP_BYTES = 1 << 20
SHARED_EXPERT_INTERMEDIATE = 640
# Host RAM of the target machine (README "Hardware and software": about
# 125 GiB) and the PLE table read through its page cache (95.37 GiB, 320 B
# rows), for the "PLE page cache" line.
RAM_TOTAL_GIB = 125.0
PLE_TABLE_GIB = 95.37
# The FP8 QSA K/V pool is served by an opt-in gate (compose keeps bf16).
KV_FP8_NOTE = ("fp8 QSA K/V is served with VLLM_QSA_KV_FP8=1 (0260-qsa-kv-fp8, "
               "opt-in, needs VLLM_QSA_KV_OFFLOAD=1); compose.yaml keeps bf16")
# The write-up's figures, shown beside ours (never used in a sum).
WRITEUP = {
    "vit_gib": 0.836, "vit_slots_mib": 58, "embed_int8_gib": 0.60,
    "staging_arena_mib": 95, "row_cache_state_mib": 1.1,
    "weights_gib_pp3": [20.98, 20.44, 21.05],
    "peak_mib_4x247k": [24022, 24090, 24038], "limit_mib": 24124,
}


def _align(n: int, a: int) -> int:
    return cdiv(n, a) * a


def ple_page_cache(pinned_total_bytes: int, bf16_pinned_total_bytes: int,
                   ram_total_bytes: int, table_bytes: int) -> dict:
    """Host RAM left to the page cache once everything pinned is taken out
    (an upper bound: the processes' own memory comes out of it too), the
    share of the PLE table it can keep, and the RAM the K/V dtype frees
    against bf16 at the same --kv-cache-memory-bytes."""
    def room(pinned):
        return max(0, ram_total_bytes - pinned)

    def share(pinned):
        return min(1.0, room(pinned) / table_bytes) if table_bytes > 0 else 1.0

    return {"ram_total_bytes": ram_total_bytes, "ple_table_bytes": table_bytes,
            "freed_vs_bf16_bytes": bf16_pinned_total_bytes - pinned_total_bytes,
            "page_cache_bytes": room(pinned_total_bytes),
            "ple_cached_bytes": min(room(pinned_total_bytes), table_bytes),
            "ple_cached_fraction": share(pinned_total_bytes),
            "freed_vs_bf16_gib": (bf16_pinned_total_bytes - pinned_total_bytes) / 2**30,
            "ple_cached_gib": min(room(pinned_total_bytes), table_bytes) / 2**30,
            "bf16_page_cache_bytes": room(bf16_pinned_total_bytes),
            "bf16_ple_cached_fraction": share(bf16_pinned_total_bytes)}


def usable_capacity(layout: dict, kv_cache_memory_bytes: int, max_model_len: int) -> dict:
    """capacity() with the null block taken out: requests = (blocks - 1) / R.
    Host and VRAM bytes still count every block (the null block is allocated)."""
    c = capacity(layout, kv_cache_memory_bytes, max_model_len)
    usable = max(0, c["blocks"] - NULL_BLOCKS)
    c["usable_blocks"] = usable
    c["null_blocks"] = min(NULL_BLOCKS, c["blocks"])
    c["requests"] = usable / layout["R"]
    c["tokens"] = int(c["requests"] * max_model_len)
    return c


def flag_for_usable_requests(layout: dict, num_requests: int) -> int:
    """Smallest --kv-cache-memory-bytes whose blocks, less the null block,
    hold num_requests max-length requests."""
    return (num_requests * layout["R"] + NULL_BLOCKS) * layout["page_bytes"]


# -- 0610 ViT stream (config: vision_config) --

def vit_block_param_nbytes(vcfg: dict, dtype_bytes: int = 2) -> list[int]:
    """Bytes of each parameter of one Qwen3_VisionBlock (qwen3_vl.py), in
    named_parameters order: norm1, norm2 (LayerNorm w+b), attn.qkv, attn.proj,
    mlp.linear_fc1, mlp.linear_fc2 (weight, bias each)."""
    d, f = int(vcfg["hidden_size"]), int(vcfg["intermediate_size"])
    elems = [d, d, d, d, 3 * d * d, 3 * d, d * d, d, f * d, f, d * f, d]
    return [n * dtype_bytes for n in elems]


def vit_pack_bytes(param_nbytes: list[int]) -> int:
    """vit_stream.pack_offsets: params back to back, each start aligned."""
    off = 0
    for n in param_nbytes:
        off = _align(off + n, VIT_ALIGN)
    return max(off, 1)


def vit_pool_bytes(vcfg: dict) -> int:
    """vit_stream.packs_layout: all blocks' packs in one exact-size buffer."""
    return int(vcfg["depth"]) * _align(vit_pack_bytes(vit_block_param_nbytes(vcfg)), VIT_ALIGN)


def vit_slot_bytes(vcfg: dict) -> int:
    """vit_stream.slot_bytes_for: one GPU slot = the largest block pack."""
    return vit_pack_bytes(vit_block_param_nbytes(vcfg))


def vit_total_bytes(vcfg: dict, dtype_bytes: int = 2) -> int:
    """The whole Qwen3_VisionTransformer: blocks + patch_embed (Conv3d + bias)
    + pos_embed + merger (+ one postshuffle merger per deepstack index)."""
    d = int(vcfg["hidden_size"])
    blocks = int(vcfg["depth"]) * sum(vit_block_param_nbytes(vcfg, 1))
    patch = int(vcfg["in_channels"]) * int(vcfg["temporal_patch_size"]) * int(vcfg["patch_size"]) ** 2 * d + d
    pos = int(vcfg["num_position_embeddings"]) * d
    merged = d * int(vcfg["spatial_merge_size"]) ** 2
    out = int(vcfg["out_hidden_size"])

    def merger(norm: int) -> int:
        return 2 * norm + merged * merged + merged + merged * out + out

    extra = len(vcfg.get("deepstack_visual_indexes") or []) * merger(merged)
    return (blocks + patch + pos + merger(d) + extra) * dtype_bytes


# Pinned host RAM the other patches take besides the K/V pool (per PP rank).

def vit_pinned_bytes(cfg: dict) -> int:
    """0610: the ViT blocks' one pool (0210), rounded to whole pages."""
    return _align(vit_pool_bytes(cfg["vision_config"]), HOST_PAGE)


def int8_vocab_bytes(cfg: dict) -> int:
    """An INT8 V x H table + one fp32 scale per row (0020 embed/lm_head)."""
    vocab, hidden = int(cfg["vocab_size"]), int(cfg["hidden_size"])
    return vocab * hidden + vocab * 4


def mtp_embed_pinned_bytes(cfg: dict) -> int:
    """0640-mtp-fit: at PP>1 the draft's INT8 embed (vocab x hidden, one fp32
    scale per row) lives in 0210's exact-size pool on the last rank
    (mtp_fit.move_to_pinned_uva: each parameter MTP_ALIGN-aligned)."""
    vocab, hidden = int(cfg["vocab_size"]), int(cfg["hidden_size"])
    return _align(_align(vocab * hidden, MTP_ALIGN) + _align(vocab * 4, MTP_ALIGN), HOST_PAGE)


def other_pinned_items(cfg: dict, pp_size: int, *, mtp: bool, vit: bool) -> list[tuple[str, int, int]]:
    """(what, rank, bytes) pinned outside the K/V pool: streamed ViT on rank 0,
    the MTP draft embed on the last rank (only at PP>1: at PP=1 it shares the
    target's embed in VRAM)."""
    items = []
    if vit and cfg.get("vision_config"):  # a text-only config has no ViT
        items.append(("ViT blocks on rank 0", 0, vit_pinned_bytes(cfg)))
    if mtp and pp_size > 1:
        items.append(("MTP embed on the last rank", pp_size - 1, mtp_embed_pinned_bytes(cfg)))
    return items


def other_pinned_bytes(cfg: dict, pp_size: int, *, mtp: bool, vit: bool) -> list[int]:
    """Pinned bytes per rank outside the K/V pool (other_pinned_items summed)."""
    per_rank = [0] * pp_size
    for _, rank, nbytes in other_pinned_items(cfg, pp_size, mtp=mtp, vit=vit):
        per_rank[rank] += nbytes
    return per_rank


# -- VRAM: state, scratch and transients --

def cuda_block_bytes(nbytes: int, expandable_segments: bool = True) -> int:
    """Bytes a torch.empty(nbytes) on the GPU takes from the caching allocator
    (c10 CUDACachingAllocator): round_size to 512 B.  With
    expandable_segments (compose's PYTORCH_CUDA_ALLOC_CONF) that is all: the
    segment grows in 2 MiB pages and the block is split off exactly.  Without
    it, above 1 MiB a segment of 20 MiB (< 10 MiB) or the size rounded to
    2 MiB is split only when more than 1 MiB is left over, else the block is
    the whole segment.  H200 (scripts/bench/results/ledger_h200.json): the
    29.07 MiB ViT slot takes 30 MiB and the 95.47 MiB MTP arena 96 MiB
    without expandable segments, their own 512-rounded sizes with them."""
    if nbytes <= 0:
        return 0
    r = cdiv(nbytes, 512) * 512
    if r <= 1 << 20 or expandable_segments:
        return r
    seg = 20 << 20 if r < 10 << 20 else cdiv(r, 2 << 20) * (2 << 20)
    return r if seg - r > 1 << 20 else seg


# ---- 0220/0250 device sizes (keep identical to the section after END
# DERIVATION in vllm/models/qwen4_exp/common/qsa_capacity.py) ----
ALLOC_ROUND = 512
# cumsum_ of the staging ranks runs one CUB scan whose tile-state workspace
# is ~16 B per 1,920 items (12 KiB at 1.5 M slots); this bounds it.
SCAN_WORKSPACE_BYTES = 64 * 1024


def alloc_bytes(nbytes: int) -> int:
    return cdiv(max(int(nbytes), 1), ALLOC_ROUND) * ALLOC_ROUND


def stage_transient_bytes(num_rows: int, packed_width: int, num_cache_blocks: int,
                          block_size: int, arena_rows: int, num_requests: int,
                          table_width: int) -> int:
    """Peak device bytes one prefill staging call (0220 stage_selected_rows)
    allocates beyond the arena (int32 rank per slot, distinct slots,
    rewritten indices, arena block table, scan workspace)."""
    num_slots = num_cache_blocks * block_size
    return (alloc_bytes(4 * (num_slots + 1))
            + alloc_bytes(4 * arena_rows)
            + alloc_bytes(4 * num_rows * packed_width)
            + alloc_bytes(4 * num_requests * table_width)
            + ALLOC_ROUND
            + SCAN_WORKSPACE_BYTES)


def row_cache_lines(arena_rows: int, num_layers: int) -> int:
    """0250: lines per QSA layer, the arena's rows split evenly among the
    rank's QSA layers (rounded down to even)."""
    return arena_rows // max(1, num_layers) // 2 * 2


def row_cache_state_bytes(arena_rows: int, num_layers: int) -> int:
    """0250: the rank's row-cache state, one int64 tensor allocated with the
    arena at startup (24 B per line + 32 B per layer)."""
    lines = row_cache_lines(arena_rows, num_layers)
    return alloc_bytes(8 * (3 * num_layers * lines + 4 * num_layers))
# ---- end of the 0220/0250 device sizes ----


def hc_split_k_scratch_bytes() -> int:
    """0400 ops/hc_int8.split_k_scratch: one per device."""
    return HC_DECODE_PARTIALS * 4 + HC_COUNTERS * 4


def hc_prefill_transient_bytes(cfg: dict) -> int:
    """0400 prefill (> 8 tokens): the W8A16 GEMMs read weight_packed as
    stored, so no bf16 weight copy exists any more (it was 6.56 MiB per call
    with dequant + cuBLAS); activations are in vLLM's own profile run."""
    del cfg
    return 0


def int6_relayout_transient_bytes(cfg: dict) -> int:
    """0500 int6_to_planes at load: one new buffer of the original size is
    written while the original lives (then freed), plus chunk temporaries in
    the small pool (<= _CHUNK_TEMP_BYTES = 1 MiB). Largest linear: the shared
    expert's gate_up, [2 x I, H] INT6 (6 bits per weight)."""
    h = int(cfg["hidden_size"])
    i = int(cfg.get("shared_expert_intermediate_size", SHARED_EXPERT_INTERMEDIATE))
    return max(2 * i * h, h * i) * 6 // 8 + INT6_CHUNK_TEMP_BYTES


def ledger(cfg: dict, lay: dict, cap: dict, *, pp_size: int, mtp: bool, vit: bool,
           vit_built: bool = True, max_num_batched_tokens: int = 512,
           max_num_seqs: int = 4, max_model_len: int = 262144,
           weights_gib: list[float] | None = None, gpu_total_mib: float = 24576,
           gpu_memory_utilization: float = 0.97, expandable_segments: bool = True) -> dict:
    """Per-rank rows (name, patch, kind, bytes per rank, write-up figure).
    kind: 'pinned' (host), 'vram' (resident), 'transient' (per step or load,
    the worst one counted in the headroom), 'removed' (VRAM upstream would
    use that the series does not: negative, informational)."""
    last = pp_size - 1
    rows = []

    def row(name, patch, kind, per_rank, writeup=None, source="", requested=None):
        rows.append({"name": name, "patch": patch, "kind": kind,
                     "bytes_per_rank": [int(x) for x in per_rank],
                     "requested_bytes_per_rank": [int(x) for x in (requested or per_rank)],
                     "writeup": writeup, "source": source})

    def only(rank, n):
        return [n if r == rank else 0 for r in range(pp_size)]

    kv_host = [_align(b, HOST_PAGE) if b else 0 for b in cap["pinned_host_bytes_per_rank"]]
    row("QSA K/V pool", "0220+0210", "pinned", kv_host,
        source=f"blocks x block x {lay['qsa_kv_bytes_per_token']} B ({lay['qsa_kv_dtype']}) "
               "x QSA layers of the rank (capacity_layout)")
    vcfg = cfg.get("vision_config")
    if vit and vcfg:
        row("ViT blocks pool", "0610+0210", "pinned", only(0, vit_pinned_bytes(cfg)),
            f"{WRITEUP['vit_gib']} GiB whole ViT", "vit_pool_bytes (packs_layout)")
        row("ViT copies re-pinned by device_loading_context", "0610", "pinned",
            [0] * pp_size, "2.005 GiB left before the fix (H200)",
            "returned by release_repinned_copies()")
    if mtp and pp_size > 1:
        row("MTP draft embed pool", "0640+0210", "pinned", only(last, mtp_embed_pinned_bytes(cfg)),
            f"{WRITEUP['embed_int8_gib']} GiB", "mtp_embed_pinned_bytes")

    vram_kv = [cap["blocks"] * b for b in lay["bytes_per_block_per_rank"]]
    row("KV pages in VRAM (indexer, GDN, PLE state)", "0220", "vram", vram_kv,
        source="blocks x bytes_per_block_per_rank")
    # Resident VRAM rows: what the caching allocator hands out (cuda_block_bytes);
    # "requested_bytes_per_rank" keeps the tensors' own sizes.
    def block(n):  # this ledger's allocator config
        return cuda_block_bytes(n, expandable_segments)

    row("QSA staging arena", "0220", "vram", [block(lay["staging_arena_bytes"])] * pp_size,
        f"~{WRITEUP['staging_arena_mib']} MiB (bf16)",
        f"max QSA layers x block x {lay['qsa_kv_bytes_per_token']} B (QSAStagingArena)",
        requested=[lay["staging_arena_bytes"]] * pp_size)
    arena_layers = max(lay["qsa_layers_per_rank"])
    arena_rows = arena_layers * lay["block_size"]
    rc_state = [row_cache_state_bytes(arena_rows, n) if n else 0
                for n in lay["qsa_layers_per_rank"]]
    row("QSA row-cache state", "0250", "vram", [block(n) for n in rc_state],
        f"{WRITEUP['row_cache_state_mib']} MiB",
        "row_cache_state_bytes (arena rows / the rank's QSA layers lines)",
        requested=rc_state)
    row("HC split-K scratch", "0400", "vram",
        [block(HC_DECODE_PARTIALS * 4) + block(HC_COUNTERS * 4)] * pp_size,
        "528 KiB", "split_k_scratch", requested=[hc_split_k_scratch_bytes()] * pp_size)
    if vit and vcfg:
        row("ViT GPU slots", "0610", "vram", only(0, VIT_SLOTS * block(vit_slot_bytes(vcfg))),
            f"{WRITEUP['vit_slots_mib']} MiB", "2 x slot_bytes_for",
            requested=only(0, VIT_SLOTS * vit_slot_bytes(vcfg)))

    row("HC prefill transient", "0400", "transient",
        [hc_prefill_transient_bytes(cfg)] * pp_size, None, "hc_prefill_transient_bytes")
    row("INT6 re-layout transient", "0500", "transient",
        [int6_relayout_transient_bytes(cfg)] * pp_size, None, "int6_relayout_transient_bytes (load)")
    stage = stage_transient_bytes(
        max_num_batched_tokens, int(cfg["indexer_budget"]) + 1, cap["blocks"],
        lay["block_size"], arena_rows, max_num_seqs, cdiv(max_model_len, lay["block_size"]))
    row("QSA staging temporaries", "0220", "transient",
        [stage if n else 0 for n in lay["qsa_layers_per_rank"]],
        "94.5 MB before (int64 + torch.unique, H200)",
        f"stage_transient_bytes ({max_num_batched_tokens} rows x "
        f"{int(cfg['indexer_budget']) + 1} columns; H200 measured within it)")

    emb = int8_vocab_bytes(cfg)
    row("embed_tokens not built", "0600", "removed",
        [0 if r == 0 else -emb for r in range(pp_size)], f"{WRITEUP['embed_int8_gib']} GiB")
    row("lm_head not built", "0600", "removed",
        [0 if r == last else -emb for r in range(pp_size)], f"{WRITEUP['embed_int8_gib']} GiB")
    if vcfg and vit_built:
        whole = vit_total_bytes(vcfg)
        row("ViT not built", "0600", "removed", [0] + [-whole] * last, f"{WRITEUP['vit_gib']} GiB")
        if vit:
            row("ViT blocks moved to host", "0610", "removed",
                only(0, -int(vcfg["depth"]) * sum(vit_block_param_nbytes(vcfg))))
    if mtp and pp_size > 1:
        row("MTP embed moved to host", "0640", "removed", only(last, -emb))
        row("MTP lm_head not built", "0640", "removed", only(last, -emb))

    def total(kind):
        return [sum(r["bytes_per_rank"][i] for r in rows if r["kind"] == kind)
                for i in range(pp_size)]

    out = {"rows": rows, "pinned_bytes_per_rank": total("pinned"),
           "vram_bytes_per_rank": total("vram"),
           "worst_transient_bytes_per_rank": [max([r["bytes_per_rank"][i] for r in rows
                                                   if r["kind"] == "transient"] or [0])
                                              for i in range(pp_size)],
           "removed_bytes_per_rank": total("removed"),
           "gpu_budget_mib": gpu_total_mib * gpu_memory_utilization,
           "weights_gib_per_rank": weights_gib}
    if weights_gib:
        out["headroom_mib_per_rank"] = [
            out["gpu_budget_mib"] - w * 1024 - (v + t) / 2**20
            for w, v, t in zip(weights_gib, out["vram_bytes_per_rank"],
                               out["worst_transient_bytes_per_rank"])]
    return out


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
    p.add_argument("--kv-dtype", default="bf16", choices=list(QSA_KV_DTYPES),
                   help="QSA K/V element type in the host pool (default bf16; fp8 = "
                        "VLLM_QSA_KV_FP8=1: half the pinned K/V and staging arena)")
    p.add_argument("--ram-total-gib", type=float, default=RAM_TOTAL_GIB,
                   help=f"host RAM, for the PLE page cache line (default {RAM_TOTAL_GIB:g})")
    p.add_argument("--ple-table-gib", type=float, default=PLE_TABLE_GIB,
                   help=f"PLE table size (default {PLE_TABLE_GIB}, the production table)")
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
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="rows of one prefill step, for the staging temporaries (compose: 512)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.97,
                   help="the server's value (compose: 0.97): the VRAM budget of the headroom")
    p.add_argument("--gpu-total-mib", type=float, default=24576,
                   help="one card's memory (RTX 3090: 24,576 MiB)")
    p.add_argument("--weights-gib", default=None,
                   help="weights per PP rank in GiB, e.g. 20.98,20.44,21.05 (the load log's "
                        "'Model loading took'); default: the write-up's figures at PP=3 "
                        "without MTP, else no headroom line")
    p.add_argument("--no-expandable-segments", dest="expandable", action="store_false",
                   default=True, help="PYTORCH_CUDA_ALLOC_CONF without expandable_segments:True "
                   "(compose sets it): large blocks round to 2 MiB segments")
    p.add_argument("--json", action="store_true", help="print JSON")
    a = p.parse_args(argv)

    cfg = load_config(a.config)
    num_spec = a.num_speculative_tokens if a.num_speculative_tokens is not None else int(a.mtp)
    max_len = a.max_model_len
    if a.want:
        max_len = a.want[1]
    try:
        lay_kw = dict(pp_size=a.pp, partition=a.pp_layer_partition,
                      max_model_len=max_len, prefix_caching=a.prefix_caching,
                      num_spec=num_spec, indexer_dtype=a.indexer_kv_dtype,
                      ssm_dtype=a.mamba_ssm_cache_dtype, uses_mrope=a.mrope)
        lay = capacity_layout(cfg, kv_dtype=a.kv_dtype, **lay_kw)
        bf16_lay = capacity_layout(cfg, kv_dtype="bf16", **lay_kw)
    except (KeyError, ValueError) as e:
        sys.exit(f"kv_capacity: {e} (check --config and the layout flags)")

    other_items = other_pinned_items(cfg, a.pp, mtp=num_spec > 0, vit=a.vit)
    other = other_pinned_bytes(cfg, a.pp, mtp=num_spec > 0, vit=a.vit)
    out = {"config": str(a.config), "max_model_len": max_len, "pp": a.pp,
           "num_speculative_tokens": num_spec, "kv_dtype": a.kv_dtype, "layout": lay}
    if a.kv_dtype != "bf16":
        out["kv_dtype_note"] = KV_FP8_NOTE
    flag = a.kv_cache_memory_bytes
    if a.want:
        flag = flag_for_usable_requests(lay, a.want[0])
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
    minimum = flag_for_usable_requests(lay, 1)
    if flag < minimum:
        sys.exit(f"kv_capacity: --kv-cache-memory-bytes {flag:,} holds {flag // lay['page_bytes']} "
                 f"blocks of {lay['page_bytes']:,} B; one {max_len:,}-token request needs "
                 f"{lay['R']} blocks plus vLLM's null block: at least {minimum:,} B "
                 f"(--kv-cache-memory-bytes {cdiv(minimum, 10**6) * 10**6})")
    out["capacity"] = usable_capacity(lay, flag, max_len)
    kv_host = out["capacity"]["pinned_host_bytes_per_rank"]
    out["pinned_other_bytes_per_rank"] = other
    out["pinned_total_bytes_per_rank"] = [k + o for k, o in zip(kv_host, other)]
    out["pinned_total_gib"] = sum(out["pinned_total_bytes_per_rank"]) / 2**30
    bf16_kv_host = usable_capacity(bf16_lay, flag, max_len)["pinned_host_bytes"]
    out["ple_page_cache"] = ple_page_cache(
        sum(out["pinned_total_bytes_per_rank"]), bf16_kv_host + sum(other),
        int(a.ram_total_gib * 2**30), int(a.ple_table_gib * 2**30))
    weights = None
    if a.weights_gib:
        weights = [float(x) for x in a.weights_gib.split(",")]
        if len(weights) != a.pp:
            p.error(f"--weights-gib needs {a.pp} values (one per PP rank)")
    elif a.pp == 3 and num_spec == 0 and not a.pp_layer_partition:
        weights = WRITEUP["weights_gib_pp3"]
    out["ledger"] = ledger(cfg, lay, out["capacity"], pp_size=a.pp, mtp=num_spec > 0, vit=a.vit,
                           max_num_batched_tokens=a.max_num_batched_tokens,
                           max_model_len=max_len,
                           weights_gib=weights, gpu_total_mib=a.gpu_total_mib,
                           gpu_memory_utilization=a.gpu_memory_utilization,
                           expandable_segments=a.expandable)

    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    c = out["capacity"]
    gib = 2**30
    print(f"config            {a.config}")
    if "kv_dtype_note" in out:
        print(f"NOTE              {out['kv_dtype_note']}")
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
    print(f"--kv-cache-memory-bytes {c['kv_cache_memory_bytes']:,} -> {c['blocks']} blocks "
          f"({c['usable_blocks']} usable: vLLM holds {c['null_blocks']} back as the null block)")
    print(f"capacity          {c['requests']:.2f} requests x {max_len:,} = {c['tokens']:,} tokens")
    print(f"pinned host RAM   {c['pinned_host_gib']:.1f} GiB {a.kv_dtype} K/V "
          f"({lay['qsa_kv_bytes_per_token']:,} B/token/layer) "
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
    pc = out["ple_page_cache"]
    print(f"PLE page cache    {pc['freed_vs_bf16_bytes'] / gib:.1f} GiB pinned RAM freed vs bf16 at this flag; "
          f"{pc['page_cache_bytes'] / gib:.1f} of {pc['ram_total_bytes'] / gib:g} GiB RAM unpinned "
          "(--ram-total-gib)\n"
          f"                  -> {pc['ple_cached_bytes'] / gib:.1f} GiB "
          f"({100 * pc['ple_cached_fraction']:.0f} %) of the {pc['ple_table_bytes'] / gib:.2f} GiB "
          f"PLE table can stay cached (bf16 K/V: {100 * pc['bf16_ple_cached_fraction']:.0f} %); "
          "an upper bound: the processes' own memory comes out of it too")
    print_ledger(out["ledger"], a.pp)
    return 0


def print_ledger(led: dict, pp: int) -> None:
    mib = 2**20
    ranks = "".join(f"{f'rank {r}':>11}" for r in range(pp))
    print(f"\nledger (MiB; beyond upstream)      patch     {ranks}  write-up")
    for kind, title in (("pinned", "pinned host"), ("vram", "VRAM, resident"),
                        ("transient", "VRAM, transient (worst counted)"),
                        ("removed", "VRAM upstream uses, the series does not")):
        print(f"  {title}")
        for r in led["rows"]:
            if r["kind"] == kind:
                vals = "".join(f"{b / mib:11.2f}" for b in r["bytes_per_rank"])
                print(f"    {r['name'][:32]:<32} {r['patch']:<9}{vals}  {r['writeup'] or ''}")
    for key, label in (("pinned_bytes_per_rank", "pinned total"),
                       ("vram_bytes_per_rank", "VRAM resident total"),
                       ("worst_transient_bytes_per_rank", "worst transient")):
        print(f"  {label:<42}" + "".join(f"{b / mib:11.2f}" for b in led[key]))
    if "headroom_mib_per_rank" in led:
        print(f"  headroom at {led['gpu_budget_mib']:,.0f} MiB budget, weights "
              f"{led['weights_gib_per_rank']} GiB:".ljust(44)
              + "".join(f"{h:11.0f}" for h in led["headroom_mib_per_rank"]))
        print("    (excludes activations, the CUDA context and CUDA graphs: only a GPU run "
              "measures those; write-up peaks at 4 x 247k: "
              f"{WRITEUP['peak_mib_4x247k']} MiB of {WRITEUP['limit_mib']:,})")
    else:
        print("  headroom: pass --weights-gib (per rank) to compute it")


if __name__ == "__main__":
    sys.exit(main())
