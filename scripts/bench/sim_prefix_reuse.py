#!/usr/bin/env python3
"""Per-turn prefix reuse of a qwen-code conversation, simulated on CPU with
vLLM 0.30.0's own scheduler, KV-cache manager, coordinator and block pool.

What is real: the KV-cache specs are this series' (18 GDN mamba groups + the
PLE short-conv group in align mode, the QSA compressed-key group with its
host-resident K/V partner from 0220, the QSA raw-key ring), grouped by
vLLM's get_kv_cache_groups, sized to the compose block count, and driven
through vllm.v1.core.sched.scheduler.Scheduler (align-mode chunk splitting,
EAGLE/MTP trailing-block drop, checkpoint retention) exactly as the engine
core does, with a stand-in "model" that only returns sampled token ids.
What is not: no forward pass, no timing. Time per turn is estimated as
prefilled tokens / --prefill-tok-s (the write-up: about 4,400 tok/s warm).

The conversation: a --start-tokens prompt (system prompt + tools + task),
then turns whose prompt is the previous prompt + the model's output + a tool
result, growing by 1,000-4,000 tokens per turn (uniform, seeded) up to
--end-tokens. This is the best case for prefix caching (the client re-sends
exactly what the server saw); a chat template that re-renders history
differently only lowers reuse.

--conversations N runs N conversations (qwen-code's subagents) at once, turn
k of each in one round, sharing the first --shared-tokens of the prompt; they
compete for the compose block count (244; MTP 170), so a conversation's cached
prefix can be evicted while the others run.

Variants (--variants, default all):
  base           compose.yaml: block 12,144, no MTP, retention interval 0
  mtp            compose/mtp.yaml: block 9,776, MTP 1 token (EAGLE block drop)
  base_dense     base + prefix_cache_retention_interval None (dense checkpoints)
  mtp_dense      mtp + dense checkpoints
  mtp_nodrop     mtp + speculative_config disable_eagle_block_drop
  base_pmu       base + prefix_match_unit (--match-unit): hits inside a block
  mtp_pmu        mtp + prefix_match_unit

  python3 scripts/bench/sim_prefix_reuse.py --json scripts/bench/results/prefix_reuse_sim.json \\
      --png scripts/bench/results/prefix_reuse_sim.png
  python3 scripts/bench/sim_prefix_reuse.py --variants base,base_pmu --conversations 4 \\
      --json scripts/bench/results/prefix_reuse_sim_4conv.json --png scripts/bench/results/prefix_reuse_sim_4conv.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ALL_VARIANTS = ("base", "mtp", "base_dense", "mtp_dense", "mtp_nodrop", "base_pmu", "mtp_pmu")

# The series' layout (kv_capacity.py derives the same numbers; tests/qsa/
# test_qsa_block_size.py checks them against vLLM's own state shapes):
# block 12,144 tokens (page 3,207,168 B), with MTP 9,776 (page 3,227,648 B).
BLOCK = {False: 12_144, True: 9_776}
# compose.yaml --kv-cache-memory-bytes 783000000 -> 244 blocks;
# compose/mtp.yaml 550000000 / 3,227,648 -> 170 blocks.
NUM_BLOCKS = {False: 244, True: 170}
MAX_NUM_SEQS = {False: 4, True: 2}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(ALL_VARIANTS),
                    help="comma list of: " + ", ".join(ALL_VARIANTS))
    ap.add_argument("--start-tokens", type=int, default=10_000)
    ap.add_argument("--end-tokens", type=int, default=200_000)
    ap.add_argument("--growth", default="1000,4000", help="min,max tokens added per turn (default 1000,4000)")
    ap.add_argument("--output-tokens", default="100,600",
                    help="min,max tokens the model writes per turn, part of the growth (default 100,600)")
    ap.add_argument("--max-turns", type=int, default=0, help="stop after this many turns (0: until --end-tokens)")
    ap.add_argument("--match-unit", type=int, default=16,
                    help="prefix_match_unit for the *_pmu variants; must divide both blocks (default 16)")
    ap.add_argument("--prefill-tok-s", type=float, default=4400.0,
                    help="warm prefill rate for the TTFT estimate (default 4400, the write-up's figure)")
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens (compose: 512)")
    ap.add_argument("--conversations", type=int, default=1,
                    help="concurrent conversations (qwen-code subagents), turn k of each in one round (default 1)")
    ap.add_argument("--shared-tokens", type=int, default=6000,
                    help="prompt tokens all conversations share (system prompt + tools; default 6000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--png", metavar="PATH")
    ap.add_argument("--quiet", action="store_true")
    return ap.parse_args(argv)


def conversation(args, c: int = 0) -> list[tuple[int, int]]:
    """[(prompt_tokens, output_tokens)] per turn of conversation c, seeded."""
    rng = random.Random(f"qwen-code conversation {args.seed}" + (f" {c}" if c else ""))
    gmin, gmax = (int(x) for x in args.growth.split(","))
    omin, omax = (int(x) for x in args.output_tokens.split(","))
    turns, prompt = [], args.start_tokens
    while prompt <= args.end_tokens and (not args.max_turns or len(turns) < args.max_turns):
        out = rng.randint(omin, omax)
        turns.append((prompt, out))
        prompt += max(rng.randint(gmin, gmax), out + 1)
    return turns


# --------------------------------------------------------------------------
# vLLM side (imported after argument parsing)
# --------------------------------------------------------------------------

def layer_specs(mtp: bool):
    """Per-layer KV-cache specs of Qwen3.8-Flash-Next with 0220 (QSA K/V in host
    RAM): 48 layers, every 4th QSA, PLE short-conv on layer 0, + the MTP draft's
    QSA layer. Shapes as tests/qsa/test_qsa_host_resident_groups.py, with the
    num_spec rows MTP adds to the conv states and the 8-row ring."""
    import torch
    from vllm.v1 import kv_cache_interface as kvi

    block, ns = BLOCK[mtp], int(mtp)
    gdn = kvi.MambaSpec(shapes=((3 + ns, 10240), (48, 128, 128)), dtypes=(torch.bfloat16, torch.float32),
                        block_size=block, mamba_cache_mode="align", num_speculative_blocks=ns)
    ple = kvi.MambaSpec(shapes=((10240, 9 + ns),), dtypes=(torch.bfloat16,), block_size=block,
                        tp_replicated=True, mamba_cache_mode="align", num_speculative_blocks=ns)
    mla = kvi.MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=128, dtype=torch.bfloat16,
                               tokens_per_state=4)
    ring = kvi.CircularBufferSpec(block_size=4 * math.ceil((4 + ns) / 4), num_kv_heads=1, head_size=128,
                                  head_size_v=0, dtype=torch.bfloat16)
    specs = {}

    def qsa(p):
        specs[f"{p}.indexer.raw_key_cache"] = ring
        specs[f"{p}.indexer.compressed_key_cache"] = mla
        specs[f"{p}.attn"] = kvi.HostResidentFullAttentionSpec(
            block_size=block, num_kv_heads=2, head_size=256, head_size_v=256, dtype=torch.bfloat16,
            partner_layer=f"{p}.indexer.compressed_key_cache")

    for i in range(48):
        if i % 4 == 3:
            qsa(f"model.layers.{i}.self_attn")
        else:
            specs[f"model.layers.{i}.linear_attn"] = gdn
        if i == 0:
            specs["model.layers.0.ple_conv"] = ple
    if mtp:
        qsa("mtp.layers.48.self_attn")
    return specs


def make_scheduler(variant: str, args):
    from types import SimpleNamespace

    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kvu
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_layout import KVCacheLayout

    mtp = variant.startswith("mtp")
    block = BLOCK[mtp]
    retention = None if variant.endswith("_dense") else 0  # 0 is CacheConfig's default
    pmu = args.match_unit if variant.endswith("_pmu") else None
    cc = CacheConfig(mamba_cache_mode="align", enable_prefix_caching=True, block_size=block,
                     mamba_block_size=block, prefix_cache_retention_interval=retention,
                     prefix_match_unit=pmu)
    sc = SchedulerConfig(max_num_seqs=MAX_NUM_SEQS[mtp], max_num_batched_tokens=args.chunk,
                         max_model_len=262_144, enable_chunked_prefill=True, is_encoder_decoder=False)
    vc = VllmConfig(cache_config=cc, scheduler_config=sc, device_config=DeviceConfig(device="cpu"))
    # The scheduler reads only these fields of the model config; a real
    # ModelConfig would need the checkpoint.
    object.__setattr__(vc, "model_config", SimpleNamespace(
        max_model_len=262_144, uses_mrope=False, is_encoder_decoder=False, is_diffusion=False,
        enable_return_routed_experts=False, return_sampling_mask=False, is_multimodal_model=False,
        multimodal_config=None, runner_type="generate", hf_config=None, logits_processors=None))
    if mtp:
        # SpeculativeConfig needs the checkpoint too; the scheduler calls these.
        nodrop = variant == "mtp_nodrop"
        object.__setattr__(vc, "speculative_config", SimpleNamespace(
            method="mtp", num_speculative_tokens=1, num_speculative_tokens_per_batch_size=None,
            disable_eagle_block_drop=nodrop, draft_model_config=None, max_num_new_slots_for_drafting=0,
            parallel_drafting=False,
            use_eagle=lambda: True, use_eagle_block_drop=lambda: not nodrop,
            use_multi_module_mtp=lambda: False, use_dflash=lambda: False,
            uses_draft_model=lambda: False, uses_dynamic_speculative_decoding=lambda: False))
    grp_cfg = SimpleNamespace(
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: KVCacheLayout.BLNHC,
                                     mamba_cache_mode="align", num_gpu_blocks_override=None,
                                     prefix_cache_retention_interval=retention),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        attention_config=SimpleNamespace(hisparse_config=None),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        speculative_config=vc.speculative_config,
        model_config=SimpleNamespace(max_model_len=262_144, hf_config=SimpleNamespace(model_type="qwen4_exp")))
    # 0220's host-resident K/V spec takes no device bytes only with its gate on
    # (compose sets it); grouping and the block count depend on it.
    saved = os.environ.get("VLLM_QSA_KV_OFFLOAD")
    os.environ["VLLM_QSA_KV_OFFLOAD"] = "1"
    try:
        groups = kvu.get_kv_cache_groups(grp_cfg, layer_specs(mtp))
        page = max(g.kv_cache_spec.page_size_bytes for g in groups)
        worker_cfg = kvu.get_kv_cache_config_from_groups(grp_cfg, groups, NUM_BLOCKS[mtp] * page)
    finally:
        if saved is None:
            os.environ.pop("VLLM_QSA_KV_OFFLOAD")
        else:
            os.environ["VLLM_QSA_KV_OFFLOAD"] = saved
    kcfg = kvu.generate_scheduler_kv_cache_config([worker_cfg])
    cc.num_gpu_blocks = kcfg.num_blocks
    sched_block, hash_block = kvu.resolve_kv_cache_block_sizes(kcfg, vc)
    hash_fn = get_hash_fn_by_name(cc.prefix_caching_hash_algo)
    kvu.init_none_hash(hash_fn)
    # No grammar in this simulation: a stand-in for the structured-output
    # manager that accepts every token (the real one needs a tokenizer).
    no_grammar = SimpleNamespace(accept_tokens=lambda req, toks: True,
                                 grammar_bitmask=lambda *a, **k: None,
                                 validate_tokens=lambda req, toks: toks)
    sched = Scheduler(vc, kcfg, no_grammar, block_size=sched_block, hash_block_size=hash_block,
                      log_stats=False)
    info = {"block_size": block, "scheduler_block_size": sched_block, "hash_block_size": hash_block,
            "num_blocks": kcfg.num_blocks, "num_groups": len(kcfg.kv_cache_groups),
            "group_kinds": sorted({type(g.kv_cache_spec).__name__ for g in kcfg.kv_cache_groups}),
            "prefix_cache_retention_interval": retention, "prefix_match_unit": pmu,
            "mtp": mtp, "eagle_block_drop": bool(mtp and variant != "mtp_nodrop")}
    return sched, kvu.get_request_block_hasher(hash_block, hash_fn), info


def run_variant(variant: str, args, turns, log=print) -> dict:
    """Drive the conversations through the scheduler. With --conversations N,
    N conversations (subagents) share the first --shared-tokens of the prompt
    and run their turns at the same time, turn k of each in one round."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    sched, hasher, info = make_scheduler(variant, args)
    n_conv = max(1, getattr(args, "conversations", 1))
    plans = [turns] + [conversation(args, c) for c in range(1, n_conv)]
    # conversation 0 keeps the single-conversation stream (same numbers as before)
    rngs = [random.Random(f"tokens {args.seed}")] + [random.Random(f"tokens {args.seed} {c}")
                                                     for c in range(1, n_conv)]
    toks = [[rngs[0].randrange(1, 150_000) for _ in range(turns[0][0])]]
    shared = min(getattr(args, "shared_tokens", 0), turns[0][0])
    for c in range(1, n_conv):
        toks.append(toks[0][:shared] + [rngs[c].randrange(1, 150_000) for _ in range(plans[c][0][0] - shared)])
    rows: list[dict] = []
    prev_computed = [0] * n_conv
    steps = 0
    t0 = time.perf_counter()
    for k in range(max(len(p) for p in plans)):
        live = {}
        for c in range(n_conv):
            if k >= len(plans[c]):
                continue
            n_prompt, n_out = plans[c][k]
            while len(toks[c]) < n_prompt:  # tool result + template tokens appended by the client
                toks[c].append(rngs[c].randrange(1, 150_000))
            req = Request(f"c{c}-turn-{k}", toks[c][:n_prompt],
                          SamplingParams(max_tokens=n_out, ignore_eos=True), None, block_hasher=hasher)
            sched.add_request(req)
            live[req.request_id] = {"c": c, "req": req, "cached": None, "prefill_steps": 0}
        while not all(v["req"].is_finished() for v in live.values()):
            out = sched.schedule()
            steps += 1
            ids = list(out.num_scheduled_tokens)
            sampled = []
            for rid in ids:
                v = live[rid]
                req = v["req"]
                if v["cached"] is None:
                    # what the server reports as usage.prompt_tokens_details.cached_tokens
                    v["cached"] = req.num_computed_tokens - out.num_scheduled_tokens[rid]
                if req.num_output_tokens == 0:
                    v["prefill_steps"] += 1
                done = req.num_computed_tokens >= req.num_tokens
                sampled.append([rngs[v["c"]].randrange(1, 150_000)] if done else [])
            sched.update_from_output(out, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=sampled))
        for v in live.values():
            c, req, cached = v["c"], v["req"], v["cached"]
            n_prompt = req.num_prompt_tokens
            output = list(req.output_token_ids)
            toks[c] = toks[c][:n_prompt] + output  # the next turn re-sends the conversation as the server saw it
            new = n_prompt - prev_computed[c] if k else n_prompt
            reprefill = max(prev_computed[c] - cached, 0) if k else 0
            prefilled = n_prompt - cached
            row = {"turn": k, "prompt_tokens": n_prompt, "output_tokens": len(output),
                   "cached_tokens": cached, "prefilled_tokens": prefilled, "new_tokens": new,
                   "reprefilled_tokens": reprefill, "prefill_steps": v["prefill_steps"],
                   "preemptions": req.num_preemptions,
                   "ttft_est_s": round(prefilled / args.prefill_tok_s, 3),
                   "reprefill_s": round(reprefill / args.prefill_tok_s, 3)}
            if n_conv > 1:
                row["conversation"] = c
            rows.append(row)
            prev_computed[c] = n_prompt + len(output) - 1  # the last sampled token was never fed
            if not args.quiet and c == 0 and (k % 10 == 0 or k == len(turns) - 1):
                log(f"  {variant:11s} turn {k:3d}: prompt {n_prompt:7,d}  cached {cached:7,d}  "
                    f"re-prefilled {reprefill:6,d}  TTFT~{row['ttft_est_s']:.1f} s")
    later = [r for r in rows if r["turn"] > 0]
    rp = [r["reprefilled_tokens"] for r in later]
    summary = {"turns": len(rows), "conversations": n_conv, "wall_s": round(time.perf_counter() - t0, 1),
               "scheduler_steps": steps,
               "reprefilled_mean": round(sum(rp) / max(len(rp), 1), 1), "reprefilled_max": max(rp, default=0),
               "reprefilled_total": sum(rp),
               "prefilled_total": sum(r["prefilled_tokens"] for r in later),
               "new_total": sum(r["new_tokens"] for r in later),
               "ttft_est_mean_s": round(sum(r["ttft_est_s"] for r in later) / max(len(later), 1), 2),
               "reprefill_s_mean": round(sum(rp) / max(len(rp), 1) / args.prefill_tok_s, 2),
               "first_turn_cached_mean": round(sum(r["cached_tokens"] for r in rows if r["turn"] == 0) / n_conv, 1),
               "preemptions": sum(r["preemptions"] for r in rows),
               # turns whose cache hit is gone: evicted by the other conversations' blocks
               "turns_with_cache_lost": sum(r["cached_tokens"] == 0 for r in later)}
    return {"variant": variant, "config": info, "summary": summary, "turns": rows}


def plot(results: list[dict], path: str) -> None:
    sys.path.insert(0, str(HERE.parent / "client"))  # scripts/client/tinypng.py
    import tinypng

    series = {}
    for res in results:
        buckets: dict[int, list[int]] = {}
        for r in res["turns"][1:]:
            buckets.setdefault(r["prompt_tokens"] // 20_000 * 20 + 10, []).append(r["reprefilled_tokens"])
        series[res["variant"]] = [(x, sum(v) / len(v) / 1000) for x, v in sorted(buckets.items())]
    tinypng.line_chart(series, path, title="RE-PREFILLED TOKENS PER TURN (K, MEAN PER 20K OF CONTEXT)",
                       xlabel="CONTEXT (K TOKENS)", ylabel="K TOKENS", width=900, height=460)


def main(argv=None) -> int:
    args = parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in ALL_VARIANTS]
    if bad:
        print(f"error: unknown variant(s) {bad}; pick from {', '.join(ALL_VARIANTS)}", file=sys.stderr)
        return 2
    turns = conversation(args)
    print(f"{len(turns)} turns, {turns[0][0]:,} -> {turns[-1][0]:,} tokens", file=sys.stderr)
    results = []
    try:
        for v in variants:
            results.append(run_variant(v, args, turns, log=lambda s: print(s, file=sys.stderr)))
            s = results[-1]["summary"]
            print(f"{v:11s} re-prefilled per turn mean {s['reprefilled_mean']:8,.0f} max {s['reprefilled_max']:6,d} "
                  f"tokens; TTFT estimate mean {s['ttft_est_mean_s']:.2f} s "
                  f"(of which re-prefill {s['reprefill_s_mean']:.2f} s at {args.prefill_tok_s:,.0f} tok/s)")
    except KeyboardInterrupt:
        print("interrupted: writing the variants done so far", file=sys.stderr)
    out = {"tool": "scripts/bench/sim_prefix_reuse.py",
           "command": ["python3", "scripts/bench/sim_prefix_reuse.py"] + (sys.argv[1:] if argv is None else list(argv)),
           "vllm": __import__("vllm").__version__, "prefill_tok_s": args.prefill_tok_s,
           "conversation": {"start_tokens": args.start_tokens, "end_tokens": args.end_tokens,
                            "growth": args.growth, "output_tokens": args.output_tokens, "seed": args.seed},
           "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.png and results:
        plot(results, args.png)
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
