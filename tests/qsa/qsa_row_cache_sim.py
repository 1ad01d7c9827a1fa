"""Randomized decode steps for the QSA row cache (0250-qsa-row-cache):
every step runs the cached kernels and the uncached upstream split-K kernel
on the same inputs and compares the outputs with torch.equal, and checks
that every tagged line holds its slot's current host row.

Used by tests/qsa/test_qsa_row_cache.py (CPU interpreter, tiny shapes) and
tests/qsa/test_qsa_row_cache_gpu.py (real sizes, host K/V in pinned memory
read over UVA); the latter also runs as a script on a GPU machine without
vLLM, with qsa_ops.py (ops/qsa.py) and qsa_row_cache.py beside it.

What a step does, mirroring the serving order of one QSA layer:
  * host rows rewritten (the K/V store: this step's new tokens, and rows the
    previous step selected, so stale hits would show), then invalidate;
  * sometimes the arena is overwritten with garbage + invalidate_all (a
    staged prefill);
  * requests persist over steps (their selections drift by `1 - overlap`),
    share prefix blocks, get replaced by new requests; counts below the
    width, -1 and out-of-table indices, -1 block-table entries;
  * two or more layers share the arena (separate slices, separate epochs);
  * a small epoch limit makes the epoch wrap (reset) happen many times.
"""

from __future__ import annotations

import dataclasses

import torch

try:
    from vllm.models.qwen4_exp.nvidia.ops import qsa_row_cache as rc
    from vllm.models.qwen4_exp.nvidia.ops.qsa import qsa_sparse_paged_attention
except ImportError:  # bare torch + triton machine (device kit)
    import qsa_row_cache as rc
    from qsa_ops import qsa_sparse_paged_attention


@dataclasses.dataclass
class Shape:
    num_blocks: int = 24  # host K/V blocks per layer
    page_size: int = 4  # K/V block size (12,144 in service)
    kv_heads: int = 2
    head_dim: int = 16
    q_heads: int = 4
    topk: int = 32  # selection width (2,051 in service); <= 32: one tile, no merge (the
    # upstream merge kernel does not run in the Triton interpreter)
    lines: int = 16  # cache lines per layer (= block size in service)
    layers: int = 2  # arena blocks = QSA layers of the rank
    table_width: int = 6  # block-table columns
    max_requests: int = 3
    max_rows: int = 12
    max_rows_per_request: int = 2
    shared_prefix: int = 2  # blocks every request starts with
    overlap: float = 0.7  # step-to-step selection overlap
    arena_overwrite_p: float = 0.03
    epoch_limit: int = 50


def line_of(slot: torch.Tensor, lines: int) -> torch.Tensor:
    """_row_cache_line in torch (slot < 2**31)."""
    return (((slot.long() * 2654435761) & 0xFFFFFFFF) * lines) >> 32


def host_tokens(kv: torch.Tensor) -> torch.Tensor:
    """[blocks, heads, page, 2D] layer view -> [blocks, page, heads, 2D]."""
    return kv.transpose(1, 2)


def check_lines(cache, layer: int, kv: torch.Tensor, page_size: int) -> int:
    """Every tagged line holds its slot's current host row; returns the
    number of tagged lines."""
    tags = cache.tags[layer]
    used = torch.nonzero(tags >= 0).flatten()
    if not used.numel():
        return 0
    slots = tags[used]
    assert torch.equal(line_of(slots, cache.num_lines), used), "tag on a foreign line"
    host = host_tokens(kv)[slots // page_size, slots % page_size]
    assert torch.equal(cache.rows[layer, used], host), "stale or torn cached row"
    return int(used.numel())


class Sim:
    def __init__(self, s: Shape, device, seed: int, make_host=None) -> None:
        self.s, self.dev = s, torch.device(device)
        self.g = torch.Generator(device="cpu").manual_seed(seed)
        # Host K/V per layer: [blocks, page, heads, 2D] token-major storage
        # (BLNHC) seen as [blocks, heads, page, 2D], as 0220 binds it.
        torch.manual_seed(seed)  # device-side garbage (arena overwrites)
        self.kv = []
        self._host_keep = []
        shape = (s.num_blocks, s.page_size, s.kv_heads, 2 * s.head_dim)
        for _ in range(s.layers):
            if make_host is not None:  # e.g. pinned host memory + its UVA view
                keep, view = make_host(shape)
                self._host_keep.append(keep)
            else:
                view = torch.randn(shape, generator=self.g).bfloat16().to(self.dev)
            self.kv.append(view.transpose(1, 2))
        arena = torch.randn(
            s.layers, s.lines, s.kv_heads, 2 * s.head_dim, device=self.dev
        ).bfloat16()
        self.cache = rc.QSARowCache(arena, epoch_limit=s.epoch_limit)
        self.cache.count_hits = True
        self.requests = [self._new_request() for _ in range(s.max_requests)]
        self.stats = dict(steps=0, equal=0, tagged_max=0, stores=0, arena_overwrites=0,
                          epoch_resets=0, cached_rows=0)
        self._epochs_prev = self.cache.epochs.clone()

    # -- requests ---------------------------------------------------------
    def _rand(self, *shape, high: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.g)

    def _new_request(self) -> dict:
        s = self.s
        table = self._rand(s.table_width, high=s.num_blocks)
        table[: s.shared_prefix] = torch.arange(s.shared_prefix)  # shared prefix blocks
        if torch.rand(1, generator=self.g).item() < 0.2:
            table[self._rand(1, high=s.table_width)] = -1  # unused / invalid entry
        ctx = int(self._rand(1, high=s.table_width * s.page_size).item()) + 1
        rows = 1 + int(self._rand(1, high=s.max_rows_per_request).item())  # MTP: > 1 row
        sel = [self._rand(s.topk, high=ctx) for _ in range(rows)]
        return dict(table=table, ctx=ctx, sel=sel, pos=ctx - 1)

    def _drift(self, req: dict) -> None:
        s = self.s
        for i, sel in enumerate(req["sel"]):
            new = self._rand(s.topk, high=req["ctx"])
            keep = torch.rand(s.topk, generator=self.g) < s.overlap
            req["sel"][i] = torch.where(keep, sel, new)

    # -- one step ---------------------------------------------------------
    def step(self) -> None:
        s, dev = self.s, self.dev
        layer = int(self._rand(1, high=s.layers).item())
        kv = self.kv[layer]
        tokens = host_tokens(kv)
        for i in range(len(self.requests)):
            if torch.rand(1, generator=self.g).item() < 0.05:
                self.requests[i] = self._new_request()
            else:
                self._drift(self.requests[i])
        n_req = 1 + int(self._rand(1, high=len(self.requests)).item())
        reqs = self.requests[:n_req]

        # The K/V store: one new token per request (at a position a later
        # step can select), plus rows the last steps selected, rewritten.
        slots = []
        for r in reqs:
            page = r["pos"] // s.page_size
            blk = int(r["table"][min(page, s.table_width - 1)])
            if blk >= 0:
                slots.append(blk * s.page_size + r["pos"] % s.page_size)
        slots += self._rand(int(self._rand(1, high=4).item()), high=s.num_blocks * s.page_size).tolist()
        tagged = self.cache.tags[layer].cpu()
        live = tagged[tagged >= 0]
        if live.numel():
            pick = live[self._rand(min(3, live.numel()), high=live.numel())]
            slots += pick.tolist()
        slot_mapping = torch.tensor(slots + [-1] * int(self._rand(1, high=3).item()),
                                    dtype=torch.int64)
        for slot in set(x for x in slots if x >= 0):
            tokens[slot // s.page_size, slot % s.page_size] = torch.randn(
                s.kv_heads, 2 * s.head_dim, generator=self.g).bfloat16().to(dev)
        self.stats["stores"] += len(slots)
        self.cache.invalidate(layer, slot_mapping.to(dev))
        if torch.rand(1, generator=self.g).item() < s.arena_overwrite_p:
            self.cache.rows.copy_(torch.randn(self.cache.rows.shape, device=dev))
            self.cache.invalidate_all()
            self.stats["arena_overwrites"] += 1

        # The batch.
        rows_idx, rows_req = [], []
        for ri, r in enumerate(reqs):
            for sel in r["sel"]:
                if len(rows_idx) < s.max_rows:
                    rows_idx.append(sel)
                    rows_req.append(ri)
        n = len(rows_idx)
        idx = torch.stack(rows_idx).to(torch.int32)
        idx[torch.rand(idx.shape, generator=self.g) < 0.03] = -1
        far = torch.rand(idx.shape, generator=self.g) < 0.01
        idx[far] = s.table_width * s.page_size + 3  # past the block table
        count = torch.full((n, 1), s.topk, dtype=torch.int32)
        short = torch.rand(n, generator=self.g) < 0.3
        count[short, 0] = self._rand(int(short.sum()), high=s.topk + 1).to(torch.int32)
        indices = torch.cat([idx, count], dim=1)
        table = torch.stack([r["table"] for r in reqs]).to(torch.int32)
        t2r = torch.tensor(rows_req, dtype=torch.int32)
        if n > 1 and torch.rand(1, generator=self.g).item() < 0.05:
            t2r[-1] = -1  # a padded row
        q = torch.randn(n, s.q_heads, s.head_dim, generator=self.g).bfloat16()
        gate = torch.randn(n, s.q_heads, s.head_dim, generator=self.g).bfloat16()
        q, gate, indices, table, t2r = (x.to(dev) for x in (q, gate, indices, table, t2r))
        kc, vc = kv.transpose(1, 2).split(s.head_dim, dim=-1)

        ref = torch.full_like(q, 7.0)
        got = torch.full_like(q, -7.0)
        qsa_sparse_paged_attention(q, kc, vc, indices, table, t2r, False, ref, output_gate=gate)
        self.cache.attention(layer, q, kc, vc, indices, table, t2r, got, output_gate=gate)
        if not torch.equal(ref, got):
            bad = (ref != got).any(-1).any(-1).nonzero().flatten().tolist()
            raise AssertionError(f"step {self.stats['steps']} layer {layer}: rows {bad} differ")
        self.stats["equal"] += 1
        self.stats["cached_rows"] += n
        tagged_now = check_lines(self.cache, layer, kv, s.page_size)
        self.stats["tagged_max"] = max(self.stats["tagged_max"], tagged_now)
        ep = self.cache.epochs.clone()
        self.stats["epoch_resets"] += int((ep < self._epochs_prev).sum())
        self._epochs_prev = ep
        self.stats["steps"] += 1

    def summary(self) -> dict:
        st = self.cache.stats.sum(0).tolist()
        return dict(self.stats, hits=st[0], lookups=st[1],
                    hit_rate=st[0] / max(1, st[1]))


def run(steps: int, shape: Shape | None = None, device="cpu", seed: int = 0, make_host=None,
        time_budget_s: float | None = None) -> dict:
    """``steps`` steps (fewer if ``time_budget_s`` runs out: the count is
    in the result); raises on the first mismatch."""
    import time

    sim = Sim(shape or Shape(), device, seed, make_host)
    t0 = time.monotonic()
    for _ in range(steps):
        sim.step()
        if time_budget_s is not None and time.monotonic() - t0 > time_budget_s:
            break
    out = sim.summary()
    out["seconds"] = round(time.monotonic() - t0, 2)
    return out
