"""scripts/kv_capacity.py's ledger: every figure derived again from the
patched vllm's own classes and size functions (real objects on the meta
device, so nothing is allocated), plus the null block, the minimum-flag
error and the table / --json. The GPU side (real pinned and device bytes)
is scripts/bench/ledger_device_check.py, recorded in
scripts/bench/results/ledger_h200.json."""

import json
import mmap
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kv_capacity as kc

CFG = kc.load_config(kc.DEFAULT_CONFIG)
VCFG = CFG["vision_config"]
TOOL = Path(kc.__file__)


def _layout(mtp=False, kv_dtype="bf16"):
    return kc.capacity_layout(CFG, pp_size=3, partition="16,17,15" if mtp else None,
                              max_model_len=262144, prefix_caching=True, num_spec=int(mtp),
                              kv_dtype=kv_dtype)


def _cli(*args):
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def vc():
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(cfg):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{port}")
        ps.initialize_model_parallel(1, 1, backend="gloo")
        try:
            yield cfg
        finally:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


def test_vit_figures_from_the_real_block_and_packer(vc):
    """The real Qwen3_VisionBlock at the config's width, packed by 0610's
    own pack_offsets / packs_layout / slot_bytes_for."""
    from vllm.model_executor.models.qwen3_vl import Qwen3_VisionBlock
    from vllm.models.qwen4_exp.nvidia import vit_stream as vs

    with torch.device("meta"):
        blk = Qwen3_VisionBlock(dim=VCFG["hidden_size"], num_heads=VCFG["num_heads"],
                                mlp_hidden_dim=VCFG["intermediate_size"], vllm_config=vc,
                                prefix="blocks.0")
    blk.to(torch.bfloat16)
    sizes = [p.numel() * p.element_size() for p in blk.parameters()]
    assert sizes == kc.vit_block_param_nbytes(VCFG)
    assert kc.VIT_ALIGN == vs._ALIGN
    assert vs.pack_offsets(sizes)[1] == kc.vit_slot_bytes(VCFG)
    assert vs.slot_bytes_for([sizes] * VCFG["depth"]) == kc.vit_slot_bytes(VCFG)
    assert vs.packs_layout([sizes] * VCFG["depth"])[1] == kc.vit_pool_bytes(VCFG)
    # the H200 figures: 29.1 MiB per pack, 0.766 GiB of parameters
    assert round(kc.vit_slot_bytes(VCFG) / 2**20, 1) == 29.1
    assert round(VCFG["depth"] * sum(sizes) / 2**30, 3) == 0.766


def test_whole_vit_from_the_real_transformer(vc):
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.qwen3_vl import Qwen3_VisionTransformer

    hf = Qwen3VLVisionConfig(**VCFG)
    with set_current_vllm_config(vc), torch.device("meta"):
        vit = Qwen3_VisionTransformer(hf, norm_eps=1e-6, prefix="visual")
    nbytes = sum(p.numel() * 2 for p in vit.parameters())  # bf16
    assert nbytes == kc.vit_total_bytes(VCFG)
    blocks = sum(p.numel() * 2 for p in vit.blocks.parameters())
    assert blocks == VCFG["depth"] * sum(kc.vit_block_param_nbytes(VCFG))


@pytest.mark.parametrize("mtp", [False, True])
def test_arena_and_row_cache_state_from_their_classes(mtp):
    from vllm.models.qwen4_exp.nvidia.ops.qsa_row_cache import QSARowCache
    from vllm.models.qwen4_exp.nvidia.qsa_host_kv import QSAStagingArena

    lay = _layout(mtp)
    layers = max(lay["qsa_layers_per_rank"])
    arena = QSAStagingArena(layers, lay["block_size"], CFG["num_key_value_heads"],
                            CFG["head_dim"], "meta")
    assert arena.nbytes == lay["staging_arena_bytes"]
    led = kc.ledger(CFG, lay, kc.usable_capacity(lay, 783_000_000, 262144), pp_size=3,
                    mtp=mtp, vit=True)
    row = {r["name"]: r for r in led["rows"]}
    # 0250: one state tensor per rank, lines = the arena's rows over the
    # rank's own QSA layers (QSARowCache built on the real arena)
    want = []
    for n in lay["qsa_layers_per_rank"]:
        rc = QSARowCache(arena.token_rows, n, epoch_limit=1 << 20)
        want.append(kc.alloc_bytes(rc.state_bytes))
        assert kc.alloc_bytes(rc.state_bytes) == kc.row_cache_state_bytes(arena.rows, n)
    assert row["QSA row-cache state"]["requested_bytes_per_rank"] == want
    assert row["QSA row-cache state"]["bytes_per_rank"] == [kc.cuda_block_bytes(n) for n in want]
    assert row["QSA staging arena"]["requested_bytes_per_rank"] == [arena.nbytes] * 3
    assert row["QSA staging arena"]["bytes_per_rank"] == [kc.cuda_block_bytes(arena.nbytes)] * 3


@pytest.mark.parametrize("mtp", [False, True])
def test_fp8_arena_and_pool_from_the_patched_classes(mtp, monkeypatch):
    """0260-qsa-kv-fp8: the arena and the pinned K/V backing the patched
    bind_host_kv_layers allocates for uint8 K/V are the planner's fp8 figures
    (same rows, half the bytes; same blocks, half the pinned pool)."""
    import vllm.models.qwen4_exp.nvidia.qsa_host_kv as qhk

    lay8, lay16 = _layout(mtp, "fp8"), _layout(mtp)
    assert lay8["block_size"] == lay16["block_size"]
    assert lay8["staging_arena_bytes"] * 2 == lay16["staging_arena_bytes"]
    got = []
    monkeypatch.setattr(qhk, "allocate_host_kv_backing",
                        lambda n, *, what: got.append(n) or torch.empty(n, dtype=torch.uint8,
                                                                         device="meta"))
    monkeypatch.setattr(qhk, "_HOST_RANGES", [])
    monkeypatch.setattr(qhk, "_row_cache_attach", lambda arena, n: None)
    cap = kc.usable_capacity(lay8, 783_000_000, 262144)
    blocks = cap["blocks"]
    for rank, n in enumerate(lay8["qsa_layers_per_rank"]):
        layers = [type("L", (), dict(num_kv_heads=CFG["num_key_value_heads"],
                                     head_dim=CFG["head_dim"]))() for _ in range(n)]
        arena = qhk.bind_host_kv_layers(layers, blocks, lay8["block_size"],
                                        max(lay8["qsa_layers_per_rank"]), "meta",
                                        to_device_view=lambda t: t, dtype=torch.uint8)
        assert arena.nbytes == lay8["staging_arena_bytes"]
        assert got[-1] == blocks * lay8["host_bytes_per_block_per_rank"][rank]
        assert got[-1] == cap["pinned_host_bytes_per_rank"][rank]
        assert got[-1] * 2 == blocks * lay16["host_bytes_per_block_per_rank"][rank]


def test_qsa_device_size_functions_are_the_patch_copies():
    """kv_capacity keeps a copy of 0220/0250's size functions: same source."""
    import inspect

    from vllm.models.qwen4_exp.common import qsa_capacity as qc

    for name in ("alloc_bytes", "stage_transient_bytes", "row_cache_lines",
                 "row_cache_state_bytes"):
        body = lambda f: [l for l in inspect.getsource(f).split('"""')[-1].splitlines() if l.strip()]  # noqa: E731
        assert body(getattr(kc, name)) == body(getattr(qc, name)), name
    assert (kc.ALLOC_ROUND, kc.SCAN_WORKSPACE_BYTES) == (qc.ALLOC_ROUND, qc.SCAN_WORKSPACE_BYTES)
    # the production figure both quote (H200 measured 16,250,880 B within it)
    assert kc.stage_transient_bytes(512, 2052, 244, 12144, 4 * 12144, 4, 22) == 16_316_416


def test_cuda_block_bytes_matches_the_h200_measurement():
    """The caching allocator's rounding as measured on the H200 (first run of
    ledger_device_check.py, default allocator config)."""
    assert kc.cuda_block_bytes(30_479_104, False) == 30 * 2**20  # ViT slot -> 30 MiB
    assert kc.cuda_block_bytes(30_479_104) == 30_479_360  # expandable segments: 512 B steps
    assert kc.cuda_block_bytes(100_106_240, False) == 96 * 2**20  # MTP arena -> 96 MiB
    assert kc.cuda_block_bytes(99_483_648, False) == 99_483_648  # arena: split, exact
    assert kc.cuda_block_bytes(388_608) == 388_608            # small pool, 512 B steps
    assert kc.cuda_block_bytes(32) == 512 and kc.cuda_block_bytes(0) == 0


def test_hc_scratch_and_no_prefill_copy():
    from vllm.models.qwen4_exp.nvidia.ops import hc_int8

    partials, counters = hc_int8.split_k_scratch(torch.device("meta"))
    assert partials.nbytes + counters.nbytes == kc.hc_split_k_scratch_bytes()
    # 0400's prefill GEMMs read weight_packed: the dequant copies are gone
    assert kc.hc_prefill_transient_bytes(CFG) == 0


def test_int6_relayout_transient_from_moe_fused():
    from vllm.models.qwen4_exp.nvidia.ops import moe_fused

    assert kc.INT6_CHUNK_TEMP_BYTES == moe_fused._CHUNK_TEMP_BYTES
    h, i = CFG["hidden_size"], kc.SHARED_EXPERT_INTERMEDIATE
    packed = moe_fused.int6_pack_dense(torch.zeros(2 * i, h, dtype=torch.int32))
    assert kc.int6_relayout_transient_bytes(CFG) == packed.nbytes + moe_fused._CHUNK_TEMP_BYTES


def test_pool_alignment_constants():
    from vllm.models.qwen4_exp.nvidia import mtp_fit

    assert kc.MTP_ALIGN == mtp_fit.ALIGN
    assert kc.HOST_PAGE == mmap.PAGESIZE


def test_null_block_is_vllms():
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=244, enable_caching=True, hash_block_size=16)
    assert pool.get_num_free_blocks() == 244 - kc.NULL_BLOCKS
    lay = _layout()
    c = kc.usable_capacity(lay, 783_000_000, 262144)
    assert (c["blocks"], c["usable_blocks"], round(c["requests"], 2)) == (244, 243, 3.98)


def test_want_counts_the_null_block():
    d = json.loads(_cli("--want", "2x262144", "--mtp", "--pp-layer-partition", "16,17,15",
                        "--json").stdout)
    c = d["capacity"]
    assert c["blocks"] == 2 * 85 + 1 and c["usable_blocks"] == 170 and c["requests"] == 2.0


def test_too_small_flag_names_the_minimum():
    r = _cli("--kv-cache-memory-bytes", "1000")
    need = kc.flag_for_usable_requests(_layout(), 1)
    assert r.returncode != 0 and f"{need:,}" in r.stderr and "null block" in r.stderr
    assert _cli("--kv-cache-memory-bytes", str(need)).returncode == 0
    assert _cli("--kv-cache-memory-bytes", str(need - 1)).returncode != 0


def test_table_and_json_carry_the_ledger():
    d = json.loads(_cli("--kv-cache-memory-bytes", "550000000", "--mtp",
                        "--pp-layer-partition", "16,17,15", "--json").stdout)
    led = d["ledger"]
    names = {r["name"] for r in led["rows"]}
    for want in ("QSA K/V pool", "ViT blocks pool", "MTP draft embed pool", "QSA staging arena",
                 "QSA row-cache state", "HC split-K scratch", "ViT GPU slots",
                 "HC prefill transient", "INT6 re-layout transient", "QSA staging temporaries",
                 "embed_tokens not built", "lm_head not built", "MTP lm_head not built"):
        assert want in names
    assert all(len(r["bytes_per_rank"]) == 3 for r in led["rows"])
    # the ledger's pinned totals are what the planner's per-rank totals say
    assert led["pinned_bytes_per_rank"][2] == kc._align(
        d["capacity"]["pinned_host_bytes_per_rank"][2], 4096) + kc.mtp_embed_pinned_bytes(CFG)
    assert "headroom_mib_per_rank" not in led  # no weights given for the MTP split
    with_w = json.loads(_cli("--kv-cache-memory-bytes", "550000000", "--mtp",
                             "--pp-layer-partition", "16,17,15", "--weights-gib",
                             "20.9,21.4,21.2", "--json").stdout)["ledger"]
    budget = 24576 * 0.97
    assert with_w["headroom_mib_per_rank"][0] == pytest.approx(
        budget - 20.9 * 1024 - (with_w["vram_bytes_per_rank"][0]
                                + with_w["worst_transient_bytes_per_rank"][0]) / 2**20)
    table = _cli("--kv-cache-memory-bytes", "783000000").stdout
    assert "ledger (MiB" in table and "headroom" in table and "null block" in table


def test_ledger_agrees_with_the_h200_measurement():
    """scripts/bench/results/ledger_h200.json: every measured pinned/device
    byte count equals the current ledger's figure for that run's allocator
    config (the kit's ledger_bytes were computed by the version of the time)."""
    rec = json.loads((TOOL.parent / "bench/results/ledger_h200.json").read_text())
    for run in rec["runs"].values():
        exp = "expandable" in run["PYTORCH_CUDA_ALLOC_CONF"]
        lay = _layout()
        cap = kc.usable_capacity(lay, run["kv_cache_memory_bytes"], 262144)
        rows = {r["name"]: r for r in kc.ledger(CFG, lay, cap, pp_size=3, mtp=False, vit=True,
                                                 expandable_segments=exp)["rows"]}
        got = {i["name"]: i for i in run["items"]}
        if "QSA K/V pool, rank 0 (smaps Rss)" in got:
            assert got["QSA K/V pool, rank 0 (smaps Rss)"]["measured_bytes"] == \
                rows["QSA K/V pool"]["bytes_per_rank"][0]
        assert got["ViT blocks pool (smaps Size)"]["measured_bytes"] == \
            rows["ViT blocks pool"]["bytes_per_rank"][0]
        assert got["ViT blocks pool (exact nbytes)"]["measured_bytes"] == kc.vit_pool_bytes(VCFG)
        assert got["ViT re-pinned copies left in torch's cache"]["measured_bytes"] == 0
        assert got["ViT GPU slots"]["measured_bytes"] == rows["ViT GPU slots"]["bytes_per_rank"][0]
        assert got["QSA staging arena"]["measured_bytes"] == \
            rows["QSA staging arena"]["bytes_per_rank"][0]
        # (the row-cache state was re-laid as one tensor after this record:
        # tests/qsa/test_qsa_row_cache.py checks its size against the class)
        mlay = _layout(mtp=True)
        assert got["QSA staging arena (MTP)"]["measured_bytes"] == kc.cuda_block_bytes(
            mlay["staging_arena_bytes"], exp)
        assert run["vit_streamed_equals_resident"]
    # before the fix: re-pinned copies + one torch pin_memory buffer per block
    assert rec["findings"]["vit_before_fix_gib"] == 2.005


def test_text_only_config_has_no_vit_rows(tmp_path):
    cfg = json.loads(kc.DEFAULT_CONFIG.read_text())
    cfg.pop("vision_config")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    r = _cli("--config", str(path), "--kv-cache-memory-bytes", "783000000", "--json")
    assert r.returncode == 0, r.stderr
    names = {row["name"] for row in json.loads(r.stdout)["ledger"]["rows"]}
    assert not any("ViT" in n for n in names) and "QSA K/V pool" in names
