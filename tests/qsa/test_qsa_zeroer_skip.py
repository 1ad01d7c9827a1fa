"""0220-qsa-kv-offload: KVBlockZeroer leaves host-backed (UVA) QSA K/V alone."""

from types import SimpleNamespace

import pytest
import torch

from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.worker.utils import KVBlockZeroer


@pytest.mark.parametrize("host_flag", [False, True])
def test_zeroer_skips_host_kv(host_flag, monkeypatch):
    from vllm.models.qwen4_exp.nvidia import qsa_host_kv as qhk

    monkeypatch.setenv("VLLM_QSA_KV_OFFLOAD", "1")
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32,
                             head_size_v=32, dtype=torch.bfloat16)
    group = SimpleNamespace(kv_cache_spec=spec, kv_cache_group_id=0,
                            layer_names=["vram.attn", "host.attn"])
    ctx = {
        "vram.attn": SimpleNamespace(kv_cache=torch.zeros(4, 2, 16, 64, dtype=torch.bfloat16)),
        "host.attn": SimpleNamespace(kv_cache=torch.zeros(4, 2, 16, 64, dtype=torch.bfloat16)),
    }
    # the registry is process-global: start from a known one (an earlier test's
    # freed backing may span these tensors' reused addresses)
    monkeypatch.setattr(qhk, "_HOST_RANGES", [])
    if host_flag:  # registered host backing, as allocate_host_resident_kv does
        t = ctx["host.attn"].kv_cache
        monkeypatch.setattr(qhk, "_HOST_RANGES", [(t.data_ptr(), t.data_ptr() + t.nbytes)])
    z = KVBlockZeroer(torch.device("cpu"), [group], [16], ctx, num_blocks=4)
    addrs = z._meta[0].tolist()
    assert ctx["vram.attn"].kv_cache.data_ptr() in addrs
    assert (ctx["host.attn"].kv_cache.data_ptr() in addrs) is (not host_flag)


def test_zeroer_gate_off_zeroes_everything(monkeypatch):
    from vllm.models.qwen4_exp.nvidia import qsa_host_kv as qhk

    monkeypatch.setenv("VLLM_QSA_KV_OFFLOAD", "0")
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32,
                             head_size_v=32, dtype=torch.bfloat16)
    kv = torch.zeros(4, 2, 16, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(qhk, "_HOST_RANGES", [(kv.data_ptr(), kv.data_ptr() + kv.nbytes)])
    group = SimpleNamespace(kv_cache_spec=spec, kv_cache_group_id=0, layer_names=["a"])
    z = KVBlockZeroer(torch.device("cpu"), [group], [16], {"a": SimpleNamespace(kv_cache=kv)},
                      num_blocks=4)
    assert kv.data_ptr() in z._meta[0].tolist()
