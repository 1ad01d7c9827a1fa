"""scripts/kv_capacity.py: every figure of SPEC "Capacity model" from a config
shaped like the real one, and the group packing cross-checked against the real
upstream packer (kv_cache_utils._get_packed_kv_cache_groups) on the same specs."""

import copy
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import kv_capacity as kc

CFG = kc.load_config(kc.DEFAULT_CONFIG)
MTP_SPLIT = "16,17,15"


def layout(prefix=True, mtp=False, cfg=CFG, max_len=262144, **kw):
    return kc.capacity_layout(cfg, pp_size=3, partition=MTP_SPLIT if mtp else None,
                              max_model_len=max_len, prefix_caching=prefix,
                              num_spec=int(mtp), **kw)


def test_pages_from_state_shapes():
    assert kc.gdn_page_bytes(CFG) == 3_207_168 == 3_145_728 + 61_440
    assert kc.gdn_page_bytes(CFG, num_spec=1) == 3_227_648
    # a bf16 ssm state halves the temporal part: the page really comes from the config
    assert kc.gdn_page_bytes(CFG, ssm_dtype="bfloat16") == 1_572_864 + 61_440


def test_block_size_and_R_match_spec():
    off, on, mtp = layout(False), layout(True), layout(True, mtp=True)
    assert (off["block_size"], on["block_size"], mtp["block_size"]) == (12_144, 12_144, 9_776)
    assert (off["R"], on["R"], mtp["R"]) == (42, 61, 85)
    assert on["page_bytes"] == 3_207_168 and mtp["page_bytes"] == 3_227_648
    assert on["num_gdn_groups"] == 18  # 18 GDN + PLE group = the article's "19 groups"
    assert mtp["qsa_layers_per_rank"] == [4, 4, 5]
    # staging arena ~95 MiB per GPU (SPEC §5 / §7)
    assert on["staging_arena_bytes"] == 4 * 12_144 * 2048
    assert mtp["staging_arena_bytes"] == 5 * 9_776 * 2048
    assert 94 < on["staging_arena_bytes"] / 2**20 < 96


@pytest.mark.parametrize("mem,prefix,mtp,blocks,requests", [
    (550_000_000, False, False, 171, 4.07),
    (550_000_000, True, False, 171, 2.80),
    (783_000_000, True, False, 244, 4.00),
    (783_000_000, True, True, 242, 2.85),
    (550_000_000, True, True, 170, 2.00),
])
def test_capacity_checks(mem, prefix, mtp, blocks, requests):
    c = kc.capacity(layout(prefix, mtp), mem, 262144)
    assert c["blocks"] == blocks
    assert round(c["requests"], 2) == requests


def test_pinned_ram_and_per_block_cost():
    c = kc.capacity(layout(True), 783_000_000, 262144)
    assert round(c["pinned_per_kv_byte"]) == 93
    assert round(c["tokens_per_mib_vram"]) == 1405
    assert abs(c["tokens_per_gib_ram"] - 15_460) < 2
    m = kc.capacity(layout(True, mtp=True), 550_000_000, 262144)
    assert round(m["pinned_host_gib"], 1) == 41.2
    assert m["pinned_host_bytes"] == 170 * 9_776 * 2048 * 13


def test_inverse():
    lay = layout(True)
    flag = kc.flag_for_requests(lay, 4)
    assert flag == 244 * 3_207_168 <= 783_000_000
    assert kc.capacity(lay, flag, 262144)["requests"] >= 4
    assert kc.capacity(lay, flag - 1, 262144)["requests"] < 4
    budget = 41.2 * 2**30
    mlay = layout(True, mtp=True)
    f = kc.flag_for_ram_budget(mlay, int(budget))
    assert kc.capacity(mlay, f, 262144)["pinned_host_bytes"] <= budget
    assert kc.capacity(mlay, f + mlay["page_bytes"], 262144)["pinned_host_bytes"] > budget


def test_block_size_follows_config_and_layout():
    # 64 B/token compressed key (128 bf16 / ratio 4) + 2 B margin
    assert kc.qsa_vram_bytes_per_token(CFG) == 66
    assert kc.qsa_vram_bytes_per_token(CFG, "fp8") == 34
    # more QSA layers on one rank -> smaller block; never over the page
    six = kc.aligned_block_size(3_207_168, [4, 6, 2], 66)
    assert six == 16 * (3_207_168 // (16 * 6 * 66)) and six * 6 * 66 <= 3_207_168
    for pages in (1_000_000, 3_207_168, 3_227_648):
        for layers in ([1], [4, 4, 4], [4, 4, 5], [3, 9]):
            b = kc.aligned_block_size(pages, layers, 66, divisor=8)
            assert b % 16 == 0 and b % 8 == 0
            assert b * max(layers) * 66 <= pages < (b + 16) * max(layers) * 66
    cfg = copy.deepcopy(CFG)
    cfg["layer_types"] = ["full_attention" if i % 2 else "linear_attention" for i in range(48)]
    assert kc.capacity_layout(cfg, pp_size=3, max_model_len=262144,
                              prefix_caching=True)["qsa_layers_per_rank"] == [8, 8, 8]


def test_cli_json_and_help():
    tool = Path(kc.__file__)
    out = subprocess.run([sys.executable, str(tool), "--kv-cache-memory-bytes", "550000000",
                          "--mtp", "--pp-layer-partition", MTP_SPLIT, "--json"],
                         capture_output=True, text=True, check=True).stdout
    d = json.loads(out)
    assert d["layout"]["R"] == 85 and d["capacity"]["blocks"] == 170
    inv = json.loads(subprocess.run([sys.executable, str(tool), "--want", "4x262144", "--json"],
                                    capture_output=True, text=True, check=True).stdout)
    # 4 x 61 blocks + the null block vLLM holds back: 245 pages (783 MB holds
    # 244: 243 usable, 3.98 requests)
    assert inv["inverse"]["kv_cache_memory_bytes_min"] == 245 * 3_207_168
    assert inv["inverse"]["kv_cache_memory_bytes_mb"] == 786_000_000
    assert inv["capacity"]["usable_blocks"] == 244 and inv["capacity"]["requests"] == 4.0
    assert "--ram-budget-gib" in subprocess.run([sys.executable, str(tool), "--help"],
                                                capture_output=True, text=True).stdout


def test_pinned_outside_the_kv_pool():
    # 0610: 27 ViT blocks of 29.07 MiB (the block's bf16 parameters, each
    # start 256-aligned) in one exact-size pool: 0.766 GiB, not 27 x 32 MiB
    vit = kc.vit_pinned_bytes(CFG)
    assert vit == kc._align(27 * kc.vit_slot_bytes(CFG["vision_config"]), 4096)
    assert round(vit / 2**30, 3) == 0.766 and vit < 27 * 2**25
    # the whole ViT is the write-up's 0.836 GiB
    assert round(kc.vit_total_bytes(CFG["vision_config"]) / 2**30, 3) == 0.836
    # 0640: INT8 draft embed + fp32 row scales, exact size (0210's pool): 0.59 GiB
    emb = kc.mtp_embed_pinned_bytes(CFG)
    # (the anonymous mmap is backed in whole 4 KiB pages)
    assert emb == kc._align(248_320 * 2_560 + 248_320 * 4, 4096) and round(emb / 2**30, 2) == 0.59
    assert kc.other_pinned_bytes(CFG, 3, mtp=True, vit=True) == [vit, 0, emb]
    assert kc.other_pinned_bytes(CFG, 3, mtp=False, vit=False) == [0, 0, 0]
    # at PP=1 the draft shares the target's embed: nothing pinned for it
    assert kc.other_pinned_bytes(CFG, 1, mtp=True, vit=False) == [0]


def test_cli_ram_budget_counts_other_pinned():
    tool = Path(kc.__file__)

    def run(*args):
        return subprocess.run([sys.executable, str(tool), *args], capture_output=True, text=True)

    args = ["--ram-budget-gib", "41.2", "--mtp", "--pp-layer-partition", MTP_SPLIT, "--json"]
    d = json.loads(run(*args).stdout)
    bare = json.loads(run(*args, "--no-vit").stdout)
    total = 41.2 * 2**30
    assert sum(d["pinned_total_bytes_per_rank"]) <= total
    # the K/V flag shrinks by what the ViT blocks and the embed take first
    assert d["inverse"]["kv_cache_memory_bytes_max"] < bare["inverse"]["kv_cache_memory_bytes_max"]
    mlay = layout(True, mtp=True)
    assert d["inverse"]["kv_cache_memory_bytes_max"] == kc.flag_for_ram_budget(
        mlay, int(total) - sum(d["pinned_other_bytes_per_rank"]))
    low = run("--ram-budget-gib", "0.5")
    assert low.returncode != 0 and "--no-vit" in low.stderr
    tiny = run("--ram-budget-gib", "0.2", "--no-vit")  # one block: 0.28 GiB
    assert tiny.returncode != 0 and "holds no K/V block" in tiny.stderr


# ---- cross-check: the same layers through the real upstream packer ----

def _upstream_groups(lay, mtp):
    torch = pytest.importorskip("torch")
    from vllm.v1.core import kv_cache_utils as kvu
    from vllm.v1.kv_cache_interface import CircularBufferSpec, MambaSpec, MLAAttentionSpec

    num_spec = int(mtp)
    block = lay["block_size"]
    conv = 10240 * (3 + num_spec)
    gdn = MambaSpec(shapes=((conv // 10240, 10240), (48, 128, 128)),
                    dtypes=(torch.bfloat16, torch.float32), block_size=block,
                    mamba_cache_mode=lay["mamba_cache_mode"], num_speculative_blocks=num_spec)
    ple = MambaSpec(shapes=((10240, 9 + num_spec),), dtypes=(torch.bfloat16,),
                    block_size=block, tp_replicated=True,
                    mamba_cache_mode=lay["mamba_cache_mode"], num_speculative_blocks=num_spec)
    mla = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=128,
                           dtype=torch.bfloat16, tokens_per_state=4)
    ring = CircularBufferSpec(block_size=kc.ring_capacity(CFG, num_spec), num_kv_heads=1,
                              head_size=128, head_size_v=0, dtype=torch.bfloat16)
    assert gdn.page_size_bytes == lay["mamba_page_bytes"]
    specs = {}
    n = 48 + int(mtp)
    for i in range(n):
        if i == 48 or i % 4 == 3:
            specs[f"layers.{i}.self_attn.indexer.raw_key_cache"] = ring
            specs[f"layers.{i}.self_attn.indexer.compressed_key_cache"] = mla
        else:
            specs[f"layers.{i}.linear_attn"] = gdn
        if i == 0:
            specs[f"layers.{i}.ple_conv"] = ple
    layout_obj = SimpleNamespace(is_block_outermost=True)
    vcfg = SimpleNamespace(
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout_obj,
                                     mamba_cache_mode=lay["mamba_cache_mode"]),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        speculative_config=None, model_config=SimpleNamespace(max_model_len=262144))
    return vcfg, specs, kvu._get_packed_kv_cache_groups(vcfg, specs)


@pytest.mark.parametrize("prefix,mtp", [(False, False), (True, False), (True, True)])
def test_R_agrees_with_upstream_packer(prefix, mtp):
    lay = layout(prefix, mtp)
    vcfg, specs, groups = _upstream_groups(lay, mtp)
    assert groups is not None
    assert len(groups) == lay["num_groups"]
    # resident pages per request (what get_max_concurrency_for_kv_cache_config counts)
    r = sum(kc.cdiv(g.kv_cache_spec.first_spec.max_memory_usage_bytes(vcfg),
                    g.kv_cache_spec.first_spec.page_size_bytes) for g in groups)
    assert r == lay["R"]
    # per-rank bytes per block (the per-worker projection of kv_cache_utils.py:1588-1611)
    split = [int(x) for x in (MTP_SPLIT if mtp else "16,16,16").split(",")]
    ranks = kc.rank_of_layers(split) + [2]  # the MTP layer sits on the last rank
    per_rank = [max(sum(specs[n].page_size_bytes for n in g.layer_names
                        if ranks[int(n.split(".")[1])] == r) for g in groups)
                for r in range(3)]
    assert per_rank == lay["bytes_per_block_per_rank"]


# ---- the copy inside vllm (0220-qsa-kv-offload) agrees with the tool ----

def _derivation(text):
    a = text.index("# ---- DERIVATION")
    b = text.index("# ---- END DERIVATION ----")
    return text[a:b]


def test_vllm_copy_agrees_with_tool():
    qc = pytest.importorskip("vllm.models.qwen4_exp.common.qsa_capacity")
    assert _derivation(Path(qc.__file__).read_text()) == _derivation(Path(kc.__file__).read_text())
    for mtp in (False, True):
        for prefix in (False, True):
            for split in (None, "16,17,15", "20,14,14"):
                for dt in ("bf16", "fp8"):
                    for kv in kc.QSA_KV_DTYPES:
                        kw = dict(pp_size=3, partition=split, max_model_len=262144,
                                  prefix_caching=prefix, num_spec=int(mtp), indexer_dtype=dt,
                                  kv_dtype=kv)
                        assert qc.capacity_layout(CFG, **kw) == kc.capacity_layout(CFG, **kw)
    assert qc.model_block_size(CFG, 3) == 12_144
    assert qc.model_block_size(CFG, 3, MTP_SPLIT, 1, 1) == 9_776


# ---- --kv-dtype fp8: the FP8 QSA K/V pool (planned VLLM_QSA_KV_FP8 patch) ----

def _cli_json(*args):
    out = subprocess.run([sys.executable, str(Path(kc.__file__)), *args, "--json"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


@pytest.mark.parametrize("mtp", [False, True])
def test_kv_dtype_fp8_plan(mtp):
    args = ["--kv-cache-memory-bytes", "550000000" if mtp else "783000000"]
    if mtp:
        args += ["--mtp", "--pp-layer-partition", MTP_SPLIT]
    bf, f8 = _cli_json(*args), _cli_json(*args, "--kv-dtype", "fp8")
    assert (bf["kv_dtype"], f8["kv_dtype"]) == ("bf16", "fp8")
    # same blocks, block size, R and requests x tokens: the VRAM page is unchanged
    for key in ("blocks", "usable_blocks", "requests", "tokens"):
        assert bf["capacity"][key] == f8["capacity"][key]
    for key in ("block_size", "R", "page_bytes"):
        assert bf["layout"][key] == f8["layout"][key]
    # the pinned K/V pool is the derivation's at 1 B per element: half of bf16
    lay8 = layout(True, mtp, kv_dtype="fp8")
    mem = f8["capacity"]["kv_cache_memory_bytes"]
    assert f8["capacity"]["pinned_host_bytes"] == kc.usable_capacity(lay8, mem, 262144)[
        "pinned_host_bytes"] == bf["capacity"]["pinned_host_bytes"] // 2
    assert f8["layout"]["qsa_kv_bytes_per_token"] == kc.qsa_kv_bytes_per_token(CFG, kv_dtype="fp8")
    # the arena holds the cache's dtype: half the VRAM for the same rows
    assert f8["layout"]["staging_arena_bytes"] * 2 == bf["layout"]["staging_arena_bytes"]
    # PLE page cache: the RAM freed and what it lets the table keep
    pc, pb = f8["ple_page_cache"], bf["ple_page_cache"]
    assert pb["freed_vs_bf16_bytes"] == 0 and pb["ple_cached_fraction"] == pc[
        "bf16_ple_cached_fraction"]
    freed = bf["capacity"]["pinned_host_bytes"] - f8["capacity"]["pinned_host_bytes"]
    assert pc["freed_vs_bf16_bytes"] == freed > 0
    assert pc["page_cache_bytes"] == pb["page_cache_bytes"] + freed
    assert pc["ple_cached_fraction"] == kc.ple_page_cache(
        sum(f8["pinned_total_bytes_per_rank"]), sum(bf["pinned_total_bytes_per_rank"]),
        int(kc.RAM_TOTAL_GIB * 2**30), int(kc.PLE_TABLE_GIB * 2**30))["ple_cached_fraction"]
    assert pc["ple_cached_fraction"] > pb["ple_cached_fraction"]
    # fp8 is a plan until its patch exists, and the output says so
    assert "kv_dtype_note" not in bf and "VLLM_QSA_KV_FP8" in f8["kv_dtype_note"]
    text = subprocess.run([sys.executable, str(Path(kc.__file__)), *args, "--kv-dtype", "fp8"],
                          capture_output=True, text=True, check=True).stdout
    assert "VLLM_QSA_KV_FP8" in text and "PLE page cache" in text


def test_kv_dtype_fp8_inverse():
    # a RAM budget buys twice the blocks (VRAM permitting: see the ledger's headroom)
    f8 = _cli_json("--ram-budget-gib", "70", "--kv-dtype", "fp8")
    bf = _cli_json("--ram-budget-gib", "70")
    budget = int(70 * 2**30) - sum(f8["pinned_other_bytes_per_rank"])
    assert f8["inverse"]["kv_cache_memory_bytes_max"] == kc.flag_for_ram_budget(
        layout(True, kv_dtype="fp8"), budget)
    assert f8["capacity"]["blocks"] in (2 * bf["capacity"]["blocks"],
                                        2 * bf["capacity"]["blocks"] + 1)
    assert sum(f8["pinned_total_bytes_per_rank"]) <= 70 * 2**30
    # --want: the same flag (VRAM-bound), half the pinned K/V
    w8, wb = _cli_json("--want", "4x262144", "--kv-dtype", "fp8"), _cli_json("--want", "4x262144")
    assert w8["inverse"] == wb["inverse"]
    assert w8["capacity"]["pinned_host_bytes"] * 2 == wb["capacity"]["pinned_host_bytes"]


def test_ple_page_cache_bounds():
    gib = 2**30
    # nothing left unpinned: nothing of the table cached; a small table: all of it
    none = kc.ple_page_cache(130 * gib, 130 * gib, 125 * gib, 95 * gib)
    assert none["page_cache_bytes"] == 0 and none["ple_cached_fraction"] == 0.0
    full = kc.ple_page_cache(10 * gib, 20 * gib, 125 * gib, 95 * gib)
    assert full["ple_cached_fraction"] == 1.0 and full["ple_cached_bytes"] == 95 * gib
    assert full["freed_vs_bf16_bytes"] == 10 * gib and full["bf16_page_cache_bytes"] == 105 * gib
    half = kc.ple_page_cache(75 * gib, 75 * gib, 125 * gib, 100 * gib)
    assert half["ple_cached_fraction"] == 0.5
    # --ram-total-gib / --ple-table-gib reach it
    d = _cli_json("--kv-cache-memory-bytes", "783000000", "--ram-total-gib", "96",
                  "--ple-table-gib", "50")
    pc = d["ple_page_cache"]
    assert pc["ram_total_bytes"] == 96 * gib and pc["ple_table_bytes"] == 50 * gib
    assert pc["page_cache_bytes"] == 96 * gib - sum(d["pinned_total_bytes_per_rank"])
