#!/usr/bin/env python3
"""Host time of the V2 model runner's input preparation per PP rank, on CPU.

What decode-03 (patch 0300-deferred-recv, VLLM_PP_DEFERRED_RECV) hides on PP
ranks 1 and 2: the runner's preparation before its first
``intermediate_tensors.tensors`` read. This script runs vLLM 0.30.0's own code
for one decode step of 1..4 requests at long context, per rank of the
production config (scripts/data/qwen4_exp_flash_next_config.json, PP=3,
layer split 16/16/16, block size from scripts/kv_capacity.py = the 0220
derivation, mamba cache mode align), on CPU tensors, and times each piece:

  batch_state    GPUModelRunner.gather_batch_req_state          (real code)
  prepare_inputs GPUModelRunner.prepare_inputs                  (real code;
                 its two Triton kernels prepare_pos_seq_lens and
                 combine_sampled_and_draft_tokens emulated with torch ops)
  block_tables   GPUModelRunner.prepare_attn                    (real code;
                 BlockTables.gather_block_tables / compute_slot_mappings are
                 Triton kernels: emulated with torch ops)
  attn_metadata  MambaHybridModelState.prepare_attn -> build_attn_metadata
                 with the real metadata builders of this rank's KV-cache
                 groups (GDNAttentionMetadataBuilder, QSAMetadataBuilder for
                 the compressed key and the ring, the QSA FlashAttention
                 builder for the host-resident K/V, the PLE short-conv
                 builder on rank 0); groups from upstream
                 kv_cache_utils.get_kv_cache_groups on the whole model's specs
  ngram_context  Qwen4ExpModelState._prepare_ngram_context      (real code,
                 rank 0 only: the PLE layer is there)

Triton kernels launched inside the builders and the model state are NOT run
(device work, not host preparation): the launcher is replaced by a counter,
and the count per step is reported (launches_per_step). Their host launch
cost is therefore not in the figures. Left out entirely: the mamba align
pre-copy (MambaHybridModelState.preprocess_state: two kernel launches and
the align context, which needs the model's forward context), the PLE host
row gather (stage_host_rows: hashes on the GPU, then gathers from the 95 GiB
mmap'd table; see scripts/bench/bench_ple_gather.py), the cudagraph dispatch
/ DP sync, the request-state update (update_requests, staged writes) and the
copy of the received tensors (that is the deferred read itself).

Example (the figures the harness takes with --prep-from):
  python scripts/bench/measure_runner_prep.py --steps 400 \\
      --json scripts/bench/results/runner_prep.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "scripts" / "data" / "qwen4_exp_flash_next_config.json"
PIECES = ("batch_state", "prepare_inputs", "block_tables", "attn_metadata",
          "ngram_context")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="HF config.json")
    p.add_argument("--pp", type=int, default=3, help="pipeline ranks")
    p.add_argument("--layer-split", default="16,16,16",
                   help="VLLM_PP_LAYER_PARTITION (layers per rank)")
    p.add_argument("--num-reqs", default="1,2,3,4",
                   help="decode batch sizes to measure (comma list)")
    p.add_argument("--context", type=int, default=200_000,
                   help="tokens already computed per request")
    p.add_argument("--max-model-len", type=int, default=262_144)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--block-size", type=int, default=None,
                   help="attention block size (default: kv_capacity.model_block_size)")
    p.add_argument("--steps", type=int, default=300, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps per case")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write the result as JSON to PATH (no PATH: stdout)")
    args = p.parse_args(argv)
    args.num_reqs = [int(x) for x in args.num_reqs.split(",")]
    if max(args.num_reqs) > args.max_num_seqs or min(args.num_reqs) < 1:
        p.error("--num-reqs must lie in 1..--max-num-seqs")
    if args.context + args.steps + args.warmup + 1 > args.max_model_len:
        p.error("--context + --steps + --warmup must stay below --max-model-len")
    return args


# ---------------------------------------------------------------- set-up ---

def _quiet_cpu_env():
    # Real triton (no interpreter): its launcher is replaced below, so no
    # kernel runs; CUDA_VISIBLE_DEVICES="" keeps vllm from swapping in its
    # placeholder module (triton_utils/importing.py, distributed-env branch).
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ["VLLM_PP_LAYER_PARTITION"] = os.environ.get("VLLM_PP_LAYER_PARTITION", "")


class LaunchCounter:
    """Replaces Triton's launcher: count, do not run (device work)."""

    def __init__(self):
        self.count = 0
        self.names: set[str] = set()

    def install(self):
        from triton.runtime.jit import JITFunction

        counter = self

        def getitem(fn, grid):
            name = getattr(fn, "__name__", None) or getattr(
                getattr(fn, "fn", None), "__name__", repr(fn))

            def launch(*a, **k):
                counter.count += 1
                counter.names.add(name)
            return launch

        JITFunction.__getitem__ = getitem
        try:  # autotuned / heuristics wrappers resolve to the same __getitem__
            from triton.runtime.autotuner import Autotuner, Heuristics
            Autotuner.__getitem__ = getitem
            Heuristics.__getitem__ = getitem
        except ImportError:
            pass


def no_pin():
    """The builders' host staging must not pin without a driver (PIN_MEMORY is
    imported by value into several modules; same as tests/mamba)."""
    import torch

    import vllm.utils.torch_utils as tu
    for name, mod in list(sys.modules.items()):
        if name.startswith("vllm") and getattr(mod, "PIN_MEMORY", None) is True:
            mod.PIN_MEMORY = False
    tu.PIN_MEMORY = False
    # Some builders assert device tensors; the tensors here are CPU stand-ins.
    torch.Tensor.is_cuda = property(lambda self: True)


def emulate_runner_kernels():
    """Torch-op equivalents of the runner's Triton kernels (input_batch.py,
    block_table.py), same semantics for decode/prefill without drafts."""
    import torch

    from vllm.v1.worker.gpu import model_runner as mr

    def prepare_pos_seq_lens(idx_mapping, qsl, num_computed, pos, seq_lens):
        n = idx_mapping.shape[0]
        nc = num_computed[idx_mapping.long()]
        qlen = qsl[1:n + 1] - qsl[:n]
        seq_lens[:n] = nc + qlen
        seq_lens[n:] = 0
        tot = int(qsl[n])
        req = torch.repeat_interleave(torch.arange(n), qlen.long(), output_size=tot)
        off = torch.arange(tot) - qsl[:n].long()[req]
        pos[:tot] = nc.long()[req] + off

    def combine(input_ids, idx_mapping, last_sampled, qsl, seq_lens, prefill_len,
                draft_tokens, cu_num_logits, num_logits, num_new=1):
        n = idx_mapping.shape[0]
        nl = cu_num_logits[1:n + 1] - cu_num_logits[:n]
        qend = qsl[1:n + 1].long()
        logits_indices = (qend - nl).long()  # one logit per request (no drafts)
        idx = idx_mapping.long()
        gen = (seq_lens[:n] > prefill_len[idx]) & (seq_lens[:n] - nl >= prefill_len[idx])
        rows = logits_indices[gen]
        input_ids[rows] = last_sampled[idx[gen], 0].to(input_ids.dtype)
        return logits_indices

    mr.prepare_pos_seq_lens = prepare_pos_seq_lens
    mr.combine_sampled_and_draft_tokens = combine


class CpuBlockTables:
    """BlockTables' per-step API over CPU tensors. On the GPU each call is one
    Triton launch over all groups (block_table.py:149-223); here each is a
    handful of vectorized torch ops over a [groups, reqs, blocks] stack."""

    def __init__(self, tables, block_sizes, max_num_reqs, max_num_tokens):
        import torch

        width = max(t.shape[1] for t in tables)
        self.tables = torch.zeros(len(tables), max_num_reqs, width, dtype=torch.int32)
        for g, t in enumerate(tables):
            self.tables[g, :, : t.shape[1]] = t
        self.block_sizes = torch.tensor(block_sizes, dtype=torch.int64)[:, None]
        self.group_ids = torch.arange(len(tables))[:, None]
        self.input_block_tables = torch.zeros_like(self.tables)
        self.slot_mappings = torch.zeros(len(tables), max_num_tokens, dtype=torch.int64)

    def gather_block_tables(self, idx_mapping, num_reqs_padded):
        n = idx_mapping.shape[0]
        out = self.input_block_tables
        out[:, :n] = self.tables[:, idx_mapping.long()]
        out[:, n:num_reqs_padded] = 0
        return tuple(bt[:num_reqs_padded] for bt in out)

    def compute_slot_mappings(self, idx_mapping, qsl, positions, num_tokens_padded):
        import torch

        n = idx_mapping.shape[0]
        tot = int(qsl[n])
        qlen = (qsl[1:n + 1] - qsl[:n]).long()
        req = torch.repeat_interleave(idx_mapping.long(), qlen, output_size=tot)
        pos = positions[:tot][None, :]
        col = torch.div(pos, self.block_sizes, rounding_mode="floor")  # [G, tot]
        col = col.clamp_max_(self.tables.shape[2] - 1)  # the ring's 1-block rows
        blk = self.tables[self.group_ids, req[None, :], col].long()
        self.slot_mappings[:, :tot] = blk * self.block_sizes + pos % self.block_sizes
        self.slot_mappings[:, tot:] = -1  # PAD_SLOT_ID
        return self.slot_mappings[:, :num_tokens_padded]


def model_specs(cfg, block, mode):
    """Every layer's KV-cache spec, as the 0220 offload layout declares them
    (the same shapes as tests/qsa/test_qsa_host_resident_groups.py)."""
    import torch

    import vllm.v1.kv_cache_interface as kvi

    import kv_capacity as kc
    types = kc.layer_types(cfg)
    hk, hv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
    conv_dim = 2 * hk * dk + hv * dv
    kern = int(cfg["linear_conv_kernel_dim"])
    gdn = kvi.MambaSpec(shapes=((kern - 1, conv_dim), (hv, dk, dv)),
                        dtypes=(torch.bfloat16, torch.float32), block_size=block,
                        mamba_cache_mode=mode, mamba_type="gdn_attention")
    ple = kvi.MambaSpec(shapes=((10240, 9),), dtypes=(torch.bfloat16,),
                        block_size=block, tp_replicated=True, mamba_cache_mode=mode,
                        mamba_type="ple_short_conv")
    ihd = int(cfg["indexer_head_dim"])
    mla = kvi.MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=ihd,
                               dtype=torch.bfloat16,
                               tokens_per_state=int(cfg["indexer_compress_ratio"]))
    ring = kvi.CircularBufferSpec(block_size=kc.ring_capacity(cfg), num_kv_heads=1,
                                  head_size=ihd, head_size_v=0, dtype=torch.bfloat16)
    ple_layers = {int(i) - 1 for i in cfg.get("ple_layer_ids") or []}
    specs = {}
    for i, t in enumerate(types):
        if t == "full_attention":
            p = f"layers.{i}.self_attn"
            specs[f"{p}.indexer.raw_key_cache"] = ring
            specs[f"{p}.indexer.compressed_key_cache"] = mla
            kw = dict(block_size=block, num_kv_heads=int(cfg["num_key_value_heads"]),
                      head_size=int(cfg["head_dim"]), head_size_v=int(cfg["head_dim"]),
                      dtype=torch.bfloat16)
            if hasattr(kvi, "HostResidentFullAttentionSpec"):
                specs[f"{p}.attn"] = kvi.HostResidentFullAttentionSpec(
                    partner_layer=f"{p}.indexer.compressed_key_cache", **kw)
            else:
                specs[f"{p}.attn"] = kvi.FullAttentionSpec(**kw)
        else:
            specs[f"layers.{i}.linear_attn"] = gdn
        if i in ple_layers:
            specs[f"layers.{i}.ple_conv"] = ple
    return specs


def backend_for(name, spec):
    import vllm.v1.kv_cache_interface as kvi
    import vllm.models.qwen4_exp.nvidia.model  # noqa: F401  (qsa.py's import cycle)
    from vllm.models.qwen4_exp.common.qsa_cache import QSAStateBackend
    from vllm.models.qwen4_exp.nvidia.qsa import Qwen4ExpQSAFlashAttentionBackend
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend
    from vllm.v1.attention.backends.short_conv_attn import PleShortConvAttentionBackend

    if isinstance(spec, kvi.MambaSpec):
        return PleShortConvAttentionBackend if name.endswith("ple_conv") else GDNAttentionBackend
    if name.endswith(".attn"):
        return Qwen4ExpQSAFlashAttentionBackend
    return QSAStateBackend


def rank_layers(cfg, pp, split):
    import kv_capacity as kc
    parts = kc.pp_partition(int(cfg["num_hidden_layers"]), pp, split)
    return kc.rank_of_layers(parts)


def _layer_index(name):
    return int(name.split(".")[1])


def make_vllm_config(args, block, cfg):
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig

    import torch

    from vllm.config.compilation import CUDAGraphMode

    vcfg = VllmConfig(
        cache_config=CacheConfig(block_size=block, mamba_cache_mode="align",
                                 enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192,
            max_model_len=args.max_model_len, is_encoder_decoder=False),
        device_config=DeviceConfig(device="cpu"),
    )
    # The server's decode graphs: FULL for uniform decode up to max-num-seqs
    # (a CPU VllmConfig turns graphs off; the builders size their persistent
    # buffers from these).
    vcfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    vcfg.compilation_config.max_cudagraph_capture_size = args.max_num_seqs
    # No checkpoint here: the two fields the builders read from the model.
    heads = int(cfg["num_attention_heads"])
    object.__setattr__(vcfg, "model_config", _NS(
        get_num_attention_heads=lambda parallel_config: heads,
        hf_config=_NS(model_type="qwen4_exp"), max_model_len=args.max_model_len,
        hf_text_config=_NS(**cfg), dtype=torch.bfloat16, rswa_window=None, is_mm_prefix_lm=False,
        get_head_size=lambda: int(cfg["head_dim"])))
    return vcfg


class RankCase:
    """One PP rank's runner state for ``num_reqs`` decoding requests."""

    def __init__(self, args, cfg, rank, groups, vcfg, block, num_reqs):
        import numpy as np
        import torch

        from vllm.v1.worker.gpu.input_batch import InputBuffers
        from vllm.v1.worker.utils import AttentionGroup

        self.rank, self.num_reqs = rank, num_reqs
        owner = rank_layers(cfg, args.pp, args.layer_split)
        R, L = args.max_num_seqs, args.max_model_len
        dev = torch.device("cpu")
        # attention groups of this rank (empty list: no layer of it here)
        self.attn_groups, self.builders = [], []
        tables, bsizes = [], []
        for gid, g in enumerate(groups):
            mine = [n for n in g.layer_names if owner[_layer_index(n)] == rank]
            by_backend = {}
            for n in mine:
                spec = self.specs[n]
                by_backend.setdefault((backend_for(n, spec), spec), []).append(n)
            ags = []
            for (backend, spec), names in by_backend.items():
                ag = AttentionGroup(backend, names, spec, gid)
                ag.create_metadata_builders(vcfg, dev)
                ags.append(ag)
                self.builders.append(type(ag.get_metadata_builder(0)).__name__)
            self.attn_groups.append(ags)
            bs = g.kv_cache_spec.block_size
            # cdiv(max_model_len, attention block) columns (22 at 262,144 /
            # 12,144); the ring group (block = ring capacity) wraps in place.
            width = -(-L // block)
            t = torch.zeros(R, width, dtype=torch.int32)
            nb = min(width, -(-(args.context + args.steps + args.warmup + 2) // bs))
            t[:, :nb] = torch.arange(1, R * nb + 1, dtype=torch.int32).view(R, nb)
            tables.append(t)
            bsizes.append(bs)
        self.kv_cache_config = _KVConfig(groups)
        self.block_tables = CpuBlockTables(tables, bsizes, R, 8192)

        # request state: the fields the runner reads (states.py), as CPU
        # tensors (RequestState itself needs UVA buffers).
        rs = _NS(req_id_to_index={}, num_computed_prefill_tokens=np.zeros(R, np.int32),
                 num_computed_tokens_np=np.zeros(R, np.int32))
        rs.prefill_len = _NS(np=np.zeros(R, np.int32), gpu=torch.zeros(R, dtype=torch.int32))
        rs.prompt_len = _NS(np=np.zeros(R, np.int32), gpu=torch.zeros(R, dtype=torch.int32))
        rs.num_computed_tokens = _NS(gpu=torch.zeros(R, dtype=torch.int32))
        rs.all_token_ids = _NS(gpu=torch.randint(0, 150_000, (R, L), dtype=torch.int32))
        rs.last_sampled_tokens = torch.randint(0, 150_000, (R, 1), dtype=torch.int64)
        rs.draft_tokens = torch.zeros(R, 0, dtype=torch.int64)
        rs.next_prefill_tokens = torch.zeros(1, R, dtype=torch.int32)
        prompt = args.context
        for i in range(num_reqs):
            rid = f"req-{i}"
            idx = R - 1 - i  # free_indices.pop() order
            rs.req_id_to_index[rid] = idx
            rs.prefill_len.np[idx] = prompt
            rs.prefill_len.gpu[idx] = prompt
            rs.prompt_len.np[idx] = prompt
            rs.num_computed_prefill_tokens[idx] = prompt
            rs.num_computed_tokens_np[idx] = prompt
            rs.num_computed_tokens.gpu[idx] = prompt
        self.req_states = rs

        from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState
        from vllm.models.qwen4_exp.nvidia.model_state import Qwen4ExpModelState

        ms = object.__new__(Qwen4ExpModelState)
        ms.vllm_config, ms.max_model_len, ms.max_num_reqs = vcfg, L, R
        ms.device, ms._align_mode = dev, False  # align ctx left out (see doc)
        ms.recoverssm = None  # use_kda_recoverssm off (KDA models only)
        ms.num_accepted_tokens_gpu = torch.ones(R, dtype=torch.int32)
        ms.num_new_sampled_tokens_per_step = 1
        ngram = int(cfg["ngram_size"]) - 1
        ms.ngram_context_len, ms.ngram_eos_token_id = ngram, int(cfg.get("eos_token_id", 0) or 0)
        ms.ngram_context = torch.zeros(R, ngram, dtype=torch.int32)
        ms.ngram_context_offsets = torch.arange(-ngram, 0, dtype=torch.int64)
        self.model_state = ms
        self.has_ple = any(owner[i - 1] == rank for i in cfg.get("ple_layer_ids") or [])
        self.prepare_attn_fn = MambaHybridModelState.prepare_attn

        runner = _NS(req_states=rs, decode_query_len=1, adaptive_verification=None,
                     input_buffers=InputBuffers(R, 8192, dev), max_num_reqs=R,
                     device=dev, model_state=ms, fast_prefill=None,
                     model_config=_NS(rswa_window=None), pcp_manager=None,
                     block_tables=self.block_tables)
        self.runner = runner
        self.sched = _NS(
            num_scheduled_tokens={f"req-{i}": 1 for i in range(num_reqs)},
            total_num_scheduled_tokens=num_reqs, scheduled_spec_decode_tokens={},
            has_structured_output_requests=False)

    def step(self, counter):
        """One decode step's preparation; returns {piece: seconds}."""
        from vllm.config.compilation import CUDAGraphMode
        from vllm.v1.worker.gpu import model_runner as mr
        from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

        GPU = mr.GPUModelRunner
        t = {}
        c0 = counter.count
        t0 = time.perf_counter()
        brs, _ = GPU.gather_batch_req_state(self.runner, self.sched, False)
        t1 = time.perf_counter()
        padded = 1 << (self.num_reqs - 1).bit_length()  # decode graph sizes 1,2,4
        desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=padded,
                                        num_reqs=padded, uniform_token_count=1)
        ib = GPU.prepare_inputs(self.runner, self.sched, brs, desc)
        t2 = time.perf_counter()
        block_tables, slot_mappings = GPU.prepare_attn(self.runner, ib)
        t3 = time.perf_counter()
        self.prepare_attn_fn(self.model_state, ib, CUDAGraphMode.FULL, block_tables,
                             slot_mappings, self.attn_groups, self.kv_cache_config)
        t4 = time.perf_counter()
        if self.has_ple:
            self.model_state._prepare_ngram_context(ib, self.req_states)
        t5 = time.perf_counter()
        t = dict(batch_state=t1 - t0, prepare_inputs=t2 - t1, block_tables=t3 - t2,
                 attn_metadata=t4 - t3, ngram_context=t5 - t4)
        self.launches = counter.count - c0
        # post_update (not timed): one token computed per request
        rs = self.req_states
        for rid in self.sched.num_scheduled_tokens:
            idx = rs.req_id_to_index[rid]
            rs.num_computed_tokens_np[idx] += 1
            rs.num_computed_tokens.gpu[idx] += 1
        return t


class _NS:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _KVConfig:
    def __init__(self, groups):
        self.kv_cache_groups = groups


def summarize_ms(xs):
    xs = sorted(xs)
    return {"median_ms": round(statistics.median(xs) * 1e3, 4),
            "p90_ms": round(xs[int(0.9 * (len(xs) - 1))] * 1e3, 4),
            "mean_ms": round(statistics.fmean(xs) * 1e3, 4)}


def main(argv=None) -> int:
    args = parse_args(argv)
    load_before = round(os.getloadavg()[0], 2)
    _quiet_cpu_env()
    sys.path.insert(0, str(REPO / "scripts"))
    import kv_capacity as kc
    cfg = kc.text_config(json.loads(Path(args.config).read_text()))
    block = args.block_size or kc.model_block_size(cfg, args.pp, args.layer_split)
    print(f"importing vllm (about 20 s of CPU); block size {block} ...",
          file=sys.stderr, flush=True)
    if args.layer_split:
        os.environ["VLLM_PP_LAYER_PARTITION"] = args.layer_split
    os.environ.setdefault("VLLM_QSA_KV_OFFLOAD", "1")
    import torch

    torch.set_num_threads(1)  # a runner process's host thread
    from vllm.config import set_current_vllm_config
    from vllm.v1.core import kv_cache_utils as kvu

    counter = LaunchCounter()
    counter.install()
    emulate_runner_kernels()
    no_pin()
    vcfg = make_vllm_config(args, block, cfg)
    specs = model_specs(cfg, block, "align")
    RankCase.specs = specs
    kv_vcfg = _NS(cache_config=_NS(get_resolved_kv_cache_layout=lambda: None,
                                   mamba_cache_mode="align", num_gpu_blocks_override=None,
                                   prefix_cache_retention_interval=None),
                  scheduler_config=_NS(disable_hybrid_kv_cache_manager=False),
                  attention_config=_NS(hisparse_config=None),
                  parallel_config=_NS(decode_context_parallel_size=1),
                  speculative_config=None,
                  model_config=_NS(max_model_len=args.max_model_len))
    from vllm.v1.kv_cache_layout import KVCacheLayout
    kv_vcfg.cache_config.get_resolved_kv_cache_layout = lambda: KVCacheLayout.BLNHC
    groups = kvu.get_kv_cache_groups(kv_vcfg, specs)

    out = {
        "bench": "runner_prep",
        "command": "python scripts/bench/measure_runner_prep.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {"model_config": str(Path(args.config).name), "pp": args.pp,
                   "layer_split": args.layer_split, "block_size": block,
                   "context": args.context, "max_model_len": args.max_model_len,
                   "max_num_seqs": args.max_num_seqs, "num_reqs": args.num_reqs,
                   "steps": args.steps, "warmup": args.warmup,
                   "mamba_cache_mode": "align", "torch_threads": 1,
                   "num_kv_cache_groups": len(groups)},
        "pieces": list(PIECES),
        "real": ["GPUModelRunner.gather_batch_req_state", "GPUModelRunner.prepare_inputs",
                 "GPUModelRunner.prepare_attn", "MambaHybridModelState.prepare_attn",
                 "build_attn_metadata + the real metadata builders",
                 "Qwen4ExpModelState._prepare_ngram_context"],
        "emulated": ["prepare_pos_seq_lens", "combine_sampled_and_draft_tokens",
                     "BlockTables.gather_block_tables", "BlockTables.compute_slot_mappings",
                     "RequestState fields as CPU tensors"],
        "not_run": ["Triton kernels inside builders/model state (counted: launches_per_step)",
                    "preprocess_state (mamba align pre-copy)", "align ctx aligned indices",
                    "PLE stage_host_rows (hash + mmap gather)", "cudagraph dispatch / DP sync",
                    "update_requests / staged writes"],
        "ranks": [],
    }
    try:
        from tqdm import tqdm
    except ImportError:
        def tqdm(x, **_):
            return x
    cases = [(r, n) for r in range(args.pp) for n in args.num_reqs]
    with set_current_vllm_config(vcfg):
        per_rank = {r: {"rank": r, "cases": []} for r in range(args.pp)}
        try:
            for rank, n in tqdm(cases, desc="rank x num_reqs", file=sys.stderr):
                case = RankCase(args, cfg, rank, groups, vcfg, block, n)
                samples = {k: [] for k in PIECES}
                total = []
                for s in range(args.warmup + args.steps):
                    t = case.step(counter)
                    if s >= args.warmup:
                        for k in PIECES:
                            samples[k].append(t[k])
                        total.append(sum(t.values()))
                per_rank[rank]["builders"] = sorted(set(case.builders))
                per_rank[rank]["num_builders"] = len(case.builders)
                pieces = {k: summarize_ms(v) for k, v in samples.items()}
                per_rank[rank]["cases"].append({
                    "num_reqs": n,
                    "pieces": pieces,
                    "total": summarize_ms(total),
                    # On a loaded host each piece is preempted now and then, so
                    # the median of the per-step sum exceeds this sum of the
                    # pieces' medians (the quiet-host figure).
                    "sum_of_piece_medians_ms": round(
                        sum(v["median_ms"] for v in pieces.values()), 4),
                    "launches_per_step": case.launches,
                })
        except KeyboardInterrupt:
            print("interrupted: keeping the cases measured so far", file=sys.stderr)
        out["ranks"] = [per_rank[r] for r in range(args.pp) if per_rank[r]["cases"]]
    cpu_model = next((ln.split(":", 1)[1].strip() for ln in
                      Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), None) \
        if Path("/proc/cpuinfo").exists() else None
    out["kernels_not_run"] = sorted(counter.names)
    out["host"] = {"cpus": os.cpu_count(), "cpu_model": cpu_model,
                   "loadavg_1m_before": load_before,
                   "loadavg_1m": round(os.getloadavg()[0], 2),
                   "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for r in out["ranks"]:
        for c in r["cases"]:
            pieces = " ".join(f"{k} {v['median_ms']:.3f}" for k, v in c["pieces"].items())
            print(f"rank {r['rank']} reqs {c['num_reqs']}: total median "
                  f"{c['total']['median_ms']:.3f} ms p90 {c['total']['p90_ms']:.3f} "
                  f"sum of piece medians {c['sum_of_piece_medians_ms']:.3f} "
                  f"({pieces}; {c['launches_per_step']} kernel launches not run)",
                  file=sys.stderr)
    if args.json == "-":
        print(json.dumps(out, indent=2))
    elif args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
