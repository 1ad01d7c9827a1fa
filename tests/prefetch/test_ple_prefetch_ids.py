"""ple_prefetch row ids vs the upstream Triton kernel (TRITON_INTERPRET=1).

The kernel is the authority: `ple_ngram_ids` (models/qwen4_exp/nvidia/ops/ple.py)
runs in the interpreter on CPU tensors; the numpy port must give the same int64
values bit for bit, including int64 wraparound, torch.remainder's sign on
negative hashes and the EOS wall (context older than the newest EOS = EOS).
"""

import subprocess
import sys

import numpy as np
import pytest
import torch

from vllm.models.qwen4_exp.nvidia import ple_prefetch as pp
from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding as N
from vllm.models.qwen4_exp.nvidia.ops.ple import ple_ngram_ids


def module_consts(ngram, P, V, eos, dense_id, base=20_000_000):
    C = ngram - 1
    m = N._make_layer_multipliers(
        ngram_size=ngram, unigram_vocab_size=V, seed=1234, ple_dense_layer_id=dense_id
    )
    S, O, _ = N._make_vocab_layout(
        ngram_vocab_size_base=base, ngram_heads=C * P, ple_dense_layer_id=dense_id
    )
    return pp.PLEHashConstants(np.array(m), np.array(S), np.array(O), eos, P)


def wrapping_consts(ngram, P, eos, rng):
    """Full-range odd int64 multipliers: token * m overflows int64 and the XOR
    mix is negative about half the time, so wraparound and remainder sign
    both matter (the production multipliers are bounded and never overflow)."""
    C = ngram - 1
    m = rng.integers(-(2**63), 2**63 - 1, size=ngram, dtype=np.int64) | 1
    S = rng.integers(1_000, 30_000_000, size=C * P, dtype=np.int64)
    O = np.concatenate([[0], np.cumsum(S)[:-1]]).astype(np.int64)
    return pp.PLEHashConstants(m, S, O, eos, P)


def random_batch(rng, V, eos, C, num_reqs, max_len, eos_frac):
    lens = rng.integers(0, max_len + 1, size=num_reqs)
    lens[rng.integers(0, num_reqs)] = 0  # a zero-length request inside
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(qsl[-1])
    ids = rng.integers(0, V, size=T).astype(np.int64)
    # Extremes of the token range, and EOS at many positions (chunk starts,
    # right after a chunk start, runs of EOS, the last token).
    extremes = rng.random(T) < 0.1
    ids[extremes] = rng.choice([0, V - 1], size=int(extremes.sum()))
    ids[rng.random(T) < eos_frac] = eos
    starts = qsl[:-1][lens > 0]
    ids[starts[::2]] = eos
    ids[np.minimum(starts[1::3] + 1, T - 1)] = eos
    if T:
        ids[-1] = eos
    ctx = rng.integers(0, V, size=(num_reqs, C)).astype(np.int64)
    ctx[rng.random((num_reqs, C)) < eos_frac] = eos
    ctx[0, -1] = eos  # newest context token is EOS: whole context walled
    # Pad like the model state: trailing zero-length requests (max_num_reqs).
    pad = 3
    qsl = np.concatenate([qsl, np.full(pad, qsl[-1], dtype=np.int32)])
    ctx = np.concatenate([ctx, np.full((pad, C), eos)])
    return ids, qsl, ctx


def kernel_ids(ids, qsl, ctx, c):
    out = ple_ngram_ids(
        torch.from_numpy(ids.astype(np.int32)),
        torch.from_numpy(qsl.astype(np.int32)),
        torch.from_numpy(ctx.astype(np.int32)),
        torch.from_numpy(c.multipliers),
        torch.from_numpy(c.sizes),
        torch.from_numpy(c.offsets),
        c.eos_token_id,
        c.heads_per_ngram,
    )
    return out.numpy()


CASES = [
    # ngram, P, V, eos, dense id, wrapping constants
    (3, 8, 248_320, 248_044, 0, False),  # the production shape
    (3, 8, 248_320, 248_044, 1, False),
    (4, 2, 50_000, 3, 2, False),
    (3, 8, 2**31 - 1, 0, 0, True),  # int32 extremes, overflowing products
    (4, 3, 2**31 - 1, 2**31 - 2, 0, True),
    (2, 4, 1000, 7, 0, True),
]


@pytest.mark.parametrize("ngram,P,V,eos,dense,wrap", CASES)
def test_row_ids_bit_exact_vs_kernel(ngram, P, V, eos, dense, wrap):
    rng = np.random.default_rng(ngram * 1000 + P * 10 + dense + wrap)
    c = wrapping_consts(ngram, P, eos, rng) if wrap else module_consts(ngram, P, V, eos, dense)
    for eos_frac in (0.0, 0.2, 0.6):
        ids, qsl, ctx = random_batch(rng, V, eos, ngram - 1, 6, 24, eos_frac)
        want = kernel_ids(ids, qsl, ctx, c)
        got = pp.ngram_row_ids(ids, qsl, ctx, c)
        assert got.dtype == np.int64 and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        assert (got >= c.offsets).all() and (got < c.offsets + c.sizes).all()
    if wrap:
        # The case really exercised wraparound and negative remainders.
        with np.errstate(over="ignore"):
            mix = ids.astype(np.int64) * c.multipliers[0]
        assert (mix < 0).any()


def test_request_chunks_match_kernel_chunked_prefill():
    """A prompt prefetched in 1024-token chunks gets the ids the kernel gives
    when the runner schedules it in 512-token chunks with ngram_context from
    the committed tokens (model_state._prepare_ngram_context)."""
    rng = np.random.default_rng(5)
    V, eos = 248_320, 248_044
    c = module_consts(3, 8, V, eos, 0)
    tokens = rng.integers(0, V, size=1100)
    tokens[rng.random(1100) < 0.05] = eos
    tokens[[0, 511, 512, 513, 1024, 1060, 1061, 1099]] = eos
    nc = 37  # prefix-cache hit: prefetch starts after it
    host = np.concatenate(
        [pp.request_row_ids(tokens, lo, min(1100, lo + 1024), c) for lo in range(nc, 1100, 1024)]
    )
    dev = []
    for lo in range(nc, 1100, 512):
        hi = min(1100, lo + 512)
        ctx = pp.request_context(tokens, lo, 2, eos)[None, :]
        dev.append(kernel_ids(tokens[lo:hi], np.array([0, hi - lo]), ctx, c))
    np.testing.assert_array_equal(host, np.concatenate(dev))


def test_request_context_edges():
    assert pp.request_context([5, 6, 7], 0, 2, 9).tolist() == [9, 9]
    assert pp.request_context([5, 6, 7], 1, 2, 9).tolist() == [9, 5]
    assert pp.request_context([5, 6, 7], 3, 2, 9).tolist() == [6, 7]
    c = pp.PLEHashConstants(np.array([3, 5]), np.array([7]), np.array([0]), 1, 1)
    assert pp.ngram_row_ids(np.zeros(0), np.array([0, 0]), np.ones((1, 1)), c).shape == (0, 1)


def test_constants_read_from_loaded_module():
    """from_module takes the buffers as loaded (a checkpoint may overwrite
    them), not values recomputed from the config."""

    class FakeNGram(torch.nn.Module):
        pass

    mod = FakeNGram()
    mod.register_buffer("layer_multipliers", torch.tensor([11, 13, 17]))
    mod.register_buffer("ngram_heads_vocab_sizes", torch.tensor([101, 103, 107, 109]))
    mod.register_buffer("ngram_heads_offsets", torch.tensor([0, 101, 204, 311]))
    mod.eos_token_id, mod.heads_per_ngram = 2, 2
    mod.layer_multipliers.copy_(torch.tensor([19, 23, 29]))  # "checkpoint" override
    c = pp.PLEHashConstants.from_module(mod)
    assert c.multipliers.tolist() == [19, 23, 29] and c.context_len == 2
    assert c.num_heads == 4 and c.eos_token_id == 2 and c.heads_per_ngram == 2
    with pytest.raises(ValueError):
        pp.PLEHashConstants(np.array([1, 2, 3]), np.array([5] * 3), np.array([0] * 3), 0, 2)


def test_module_loads_without_torch_or_vllm():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('ple_prefetch', {pp.__file__!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['ple_prefetch'] = m\n"
        "spec.loader.exec_module(m)\n"
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
