"""0200-qsa-kv-offload: KVBlockZeroer leaves host-backed (UVA) QSA K/V alone."""

from types import SimpleNamespace

import pytest
import torch

from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.worker.utils import KVBlockZeroer


@pytest.mark.parametrize("host_flag", [False, True])
def test_zeroer_skips_host_kv(host_flag):
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32,
                             head_size_v=32, dtype=torch.bfloat16)
    group = SimpleNamespace(kv_cache_spec=spec, kv_cache_group_id=0,
                            layer_names=["vram.attn", "host.attn"])
    ctx = {
        "vram.attn": SimpleNamespace(kv_cache=torch.zeros(4, 2, 16, 64, dtype=torch.bfloat16)),
        "host.attn": SimpleNamespace(kv_cache=torch.zeros(4, 2, 16, 64, dtype=torch.bfloat16)),
    }
    if host_flag:
        ctx["host.attn"].qsa_host_kv = True
    z = KVBlockZeroer(torch.device("cpu"), [group], [16], ctx, num_blocks=4)
    addrs = z._meta[0].tolist()
    assert ctx["vram.attn"].kv_cache.data_ptr() in addrs
    assert (ctx["host.attn"].kv_cache.data_ptr() in addrs) is (not host_flag)
