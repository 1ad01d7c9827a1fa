"""A prefix hit inside a block (--prefix-match-unit below the block size)
shares the partial tail block copy-on-write: the scheduler sends
kv_cache_block_copies and the runner copies them with
copy_kv_cache_blocks_inplace over its kv_caches. With 0220 those include the
host-resident QSA K/V views, so the copy reaches host K/V too (here on CPU,
the host backing a plain tensor, as tests/qsa/test_qsa_host_resident_groups.py
does). What this does NOT cover: 0250's row cache keys lines by physical slot
and invalidates them only on the K/V store, which a block copy bypasses."""

from types import SimpleNamespace

import pytest
import torch

kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
if not hasattr(kvi, "HostResidentFullAttentionSpec"):
    pytest.skip("0220-qsa-kv-offload not applied", allow_module_level=True)
from vllm.v1.core import kv_cache_utils as kvu  # noqa: E402


def test_block_copy_reaches_host_kv(monkeypatch):
    import vllm.utils.torch_utils as tu
    from vllm.models.qwen4_exp.nvidia import qsa_host_kv as qhk
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache, copy_kv_cache_blocks_inplace

    monkeypatch.setenv("VLLM_QSA_KV_OFFLOAD", "1")
    monkeypatch.setattr(tu, "PIN_MEMORY", False)  # no driver: the indices stay in pageable memory
    monkeypatch.setattr(qhk, "_HOST_RANGES", [])
    monkeypatch.setattr(qhk, "_ARENAS", {})
    monkeypatch.setattr(qhk, "allocate_host_kv_backing", lambda n, what: torch.zeros(n, dtype=torch.uint8))
    real_bind = qhk.bind_host_kv_layers
    monkeypatch.setattr(qhk, "bind_host_kv_layers",
                        lambda *a, **kw: real_bind(*a[:5], to_device_view=lambda t: t))
    block = 64  # small stand-in block so the CPU test allocates little
    p = "l.3.self_attn"
    specs = {
        "l.0.linear_attn": kvi.MambaSpec(shapes=((3, 64), (2, 16, 16)), dtypes=(torch.bfloat16, torch.float32),
                                         block_size=block, mamba_cache_mode="align"),
        f"{p}.indexer.raw_key_cache": kvi.CircularBufferSpec(block_size=4, num_kv_heads=1, head_size=128,
                                                             head_size_v=0, dtype=torch.bfloat16),
        f"{p}.indexer.compressed_key_cache": kvi.MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=128,
                                                                  dtype=torch.bfloat16, tokens_per_state=4),
        f"{p}.attn": kvi.HostResidentFullAttentionSpec(
            block_size=block, num_kv_heads=2, head_size=256, head_size_v=256, dtype=torch.bfloat16,
            partner_layer=f"{p}.indexer.compressed_key_cache", staging_blocks=1)}
    vcfg = SimpleNamespace(
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: KVCacheLayout.BLNHC,
                                     mamba_cache_mode="align", num_gpu_blocks_override=None,
                                     prefix_cache_retention_interval=None),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        attention_config=SimpleNamespace(hisparse_config=None),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        speculative_config=None, model_config=SimpleNamespace(max_model_len=262144))
    cfg = kvu.get_kv_cache_config_from_groups(vcfg, kvu.get_kv_cache_groups(vcfg, specs), 10 * 8192)
    kv = allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout.BLNHC, None)
    host, key = kv[f"{p}.attn"], kv[f"{p}.indexer.compressed_key_cache"]
    assert qhk.is_host_kv_tensor(host) and not qhk.is_host_kv_tensor(key)
    torch.manual_seed(0)
    host[1].normal_()
    key[1].normal_()
    before = host.clone()
    copy_kv_cache_blocks_inplace(list(kv.values()), cfg.num_blocks, [(1, 2)])
    assert torch.equal(host[2], host[1]) and torch.equal(key[2], key[1])
    others = [b for b in range(cfg.num_blocks) if b != 2]
    assert torch.equal(host[others], before[others])
