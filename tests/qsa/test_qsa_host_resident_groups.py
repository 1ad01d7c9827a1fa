"""0220-qsa-kv-offload: host-resident QSA K/V through the real upstream
grouping and config code (kv_cache_utils) on the specs of a config shaped like
the real one: the K/V layers share their compressed-key group (same block
table), take no device bytes (bytes/block 3,207,168), get no device tensor,
and R stays 61 (align) with 244 blocks at 783 MB."""

from types import SimpleNamespace

import pytest
import torch

kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
if not hasattr(kvi, "HostResidentFullAttentionSpec"):
    pytest.skip("0220-qsa-kv-offload not applied", allow_module_level=True)
from vllm.v1.core import kv_cache_utils as kvu  # noqa: E402

import kv_capacity as kc  # noqa: E402

CFG = kc.load_config(kc.DEFAULT_CONFIG)


def _specs(lay, mode):
    block = lay["block_size"]
    gdn = kvi.MambaSpec(shapes=((3, 10240), (48, 128, 128)),
                        dtypes=(torch.bfloat16, torch.float32), block_size=block,
                        mamba_cache_mode=mode)
    ple = kvi.MambaSpec(shapes=((10240, 9),), dtypes=(torch.bfloat16,), block_size=block,
                        tp_replicated=True, mamba_cache_mode=mode)
    mla = kvi.MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=128,
                               dtype=torch.bfloat16, tokens_per_state=4)
    ring = kvi.CircularBufferSpec(block_size=4, num_kv_heads=1, head_size=128,
                                  head_size_v=0, dtype=torch.bfloat16)
    specs = {}
    for i in range(48):
        if i % 4 == 3:
            p = f"layers.{i}.self_attn"
            specs[f"{p}.indexer.raw_key_cache"] = ring
            specs[f"{p}.indexer.compressed_key_cache"] = mla
            specs[f"{p}.attn"] = kvi.HostResidentFullAttentionSpec(
                block_size=block, num_kv_heads=2, head_size=256, head_size_v=256,
                dtype=torch.bfloat16, partner_layer=f"{p}.indexer.compressed_key_cache")
        else:
            specs[f"layers.{i}.linear_attn"] = gdn
        if i == 0:
            specs["layers.0.ple_conv"] = ple
    return specs


def _vcfg(mode):
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout.BLNHC  # what QSAStateBackend resolves to (upstream map §1)
    return SimpleNamespace(
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout,
                                     mamba_cache_mode=mode, num_gpu_blocks_override=None,
                                     prefix_cache_retention_interval=None),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        attention_config=SimpleNamespace(hisparse_config=None),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        speculative_config=None, model_config=SimpleNamespace(max_model_len=262144))


def test_host_kv_joins_partner_group_and_costs_no_device_bytes(monkeypatch):
    monkeypatch.setenv("VLLM_QSA_KV_OFFLOAD", "1")
    lay = kc.capacity_layout(CFG, pp_size=1, max_model_len=262144, prefix_caching=True,
                             block_size=12_144)
    vcfg = _vcfg("align")
    specs = _specs(lay, "align")
    groups = kvu.get_kv_cache_groups(vcfg, specs)
    assert len(groups) == 21  # 18 GDN + PLE + ring + (compressed key + K/V)
    qsa = [g for g in groups if any(n.endswith(".attn") for n in g.layer_names)]
    assert len(qsa) == 1 and len(qsa[0].layer_names) == 24
    # device bytes: the whole model on one rank here -> the QSA group is 12 x 777,216
    assert qsa[0].kv_cache_spec.page_size_bytes == 12 * 777_216
    pages = sum(kc.cdiv(g.kv_cache_spec.max_memory_usage_bytes(vcfg),
                        g.kv_cache_spec.page_size_bytes) for g in groups)
    assert pages == 61
    cfg = kvu.get_kv_cache_config_from_groups(vcfg, groups, 100 * 12 * 777_216)
    assert cfg.num_blocks == 100
    tensor_layers = {n for t in cfg.kv_cache_tensors for n in t.layers}
    assert not any(n.endswith(".attn") for n in tensor_layers)
    assert any(n.endswith("compressed_key_cache") for n in tensor_layers)


def test_allocate_binds_host_views(monkeypatch):
    """allocate_kv_cache (both runners call it) returns UVA views for the K/V
    layers next to the device views; the zeroer would skip them."""
    from vllm.models.qwen4_exp.nvidia import qsa_host_kv as qhk
    from vllm.v1.worker.utils import allocate_kv_cache

    monkeypatch.setenv("VLLM_QSA_KV_OFFLOAD", "1")
    monkeypatch.setattr(qhk, "_HOST_RANGES", [])
    monkeypatch.setattr(qhk, "_ARENAS", {})
    got = []
    monkeypatch.setattr(qhk, "allocate_host_kv_backing",
                        lambda n, what: got.append(n) or torch.zeros(n, dtype=torch.uint8))
    real_bind = qhk.bind_host_kv_layers
    monkeypatch.setattr(qhk, "bind_host_kv_layers",
                        lambda *a, **kw: real_bind(*a[:5], to_device_view=lambda t: t))
    block = 64  # small stand-in block so the CPU test allocates little
    mla = kvi.MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=128,
                               dtype=torch.bfloat16, tokens_per_state=4)
    gdn = kvi.MambaSpec(shapes=((3, 64), (2, 16, 16)), dtypes=(torch.bfloat16, torch.float32),
                        block_size=block, mamba_cache_mode="align")
    ring = kvi.CircularBufferSpec(block_size=4, num_kv_heads=1, head_size=128,
                                  head_size_v=0, dtype=torch.bfloat16)
    specs = {"l.0.linear_attn": gdn, "l.1.linear_attn": gdn,
             "l.3.self_attn.indexer.raw_key_cache": ring,
             "l.3.self_attn.indexer.compressed_key_cache": mla,
             "l.3.self_attn.attn": kvi.HostResidentFullAttentionSpec(
                 block_size=block, num_kv_heads=2, head_size=256, head_size_v=256,
                 dtype=torch.bfloat16, partner_layer="l.3.self_attn.indexer.compressed_key_cache",
                 staging_blocks=2)}
    vcfg = _vcfg("align")
    groups = kvu.get_kv_cache_groups(vcfg, specs)
    cfg = kvu.get_kv_cache_config_from_groups(vcfg, groups, 10 * 8192)
    from vllm.v1.kv_cache_layout import KVCacheLayout

    kv = allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout.BLNHC, None)
    host = kv["l.3.self_attn.attn"]
    assert host.shape == (cfg.num_blocks, 2, block, 512)
    assert got == [cfg.num_blocks * block * 2048]  # exact: blocks x block x 2 KiB
    assert qhk.is_host_kv_tensor(host) and not qhk.is_host_kv_tensor(
        kv["l.3.self_attn.indexer.compressed_key_cache"])
    assert qhk.arena_for(host).num_blocks == 2
