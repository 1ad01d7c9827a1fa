"""The row-cache benchmark's selection sequences have the overlap they are
labelled with (scripts/bench/bench_qsa_row_cache.py; the timing needs a GPU)."""

import pytest
import torch

bench = pytest.importorskip("bench.bench_qsa_row_cache")


@pytest.mark.parametrize("overlap", [0.0, 0.72, 1.0])
def test_selection_overlap(overlap):
    g = torch.Generator().manual_seed(0)
    sel = bench.selections(2, 6, overlap, 100_000, g)
    assert sel.shape == (6, 2, bench.TOPK)
    seen = set(sel[0, 0].tolist())
    for t in range(1, 6):
        for r in range(2):
            prev, cur = set(sel[t - 1, r].tolist()), sel[t, r].tolist()
            assert len(set(cur)) == bench.TOPK  # distinct columns
            shared = len(prev & set(cur)) / bench.TOPK
            assert abs(shared - overlap) < 1e-3
        new = set(sel[t, 0].tolist()) - set(sel[t - 1, 0].tolist())
        assert not (new & seen)  # replaced columns are never-seen positions
        seen |= set(sel[t, 0].tolist())
