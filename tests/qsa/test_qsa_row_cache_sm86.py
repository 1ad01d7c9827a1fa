"""0250-qsa-row-cache: sm_86 compile of the row-cache kernels at the real
decode shapes (2 KV heads x 256, 16 query heads, selection width 2,051,
block 12,144 = lines per layer, 22 block-table columns, <= 12 rows: BLOCK_N 32,
64 splits, 4 warps, 2 stages): shared memory must fit a 3090 (<= 101,376 B).
The cached split-K kernel loads K and V once each through tl.where(hit,
vram, host); it must not need more shared memory than the upstream kernel.
"""

import pytest

pytest.importorskip("triton")

from sm86 import check_fits, compile_many  # noqa: E402

from vllm.models.qwen4_exp.nvidia.ops import qsa as upstream  # noqa: E402
from vllm.models.qwen4_exp.nvidia.ops import qsa_row_cache as rc  # noqa: E402

KV_HEADS, HEAD_DIM, Q_HEADS, TOPK, BLOCK, WIDTH = 2, 256, 16, 2051, 12144, 22

_SPLITK_SIG = {
    "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "indices_ptr": "*i32",
    "block_table_ptr": "*i32", "token_to_req_ptr": "*i32", "partial_output_ptr": "*fp32",
    "partial_lse_ptr": "*fp32", "output_ptr": "*bf16", "output_gate_ptr": "*bf16",
    "stride_q_row": "i32", "stride_q_head": "i32", "stride_k_block": "i32",
    "stride_k_token": "i32", "stride_k_head": "i32", "stride_v_block": "i32",
    "stride_v_token": "i32", "stride_v_head": "i32", "stride_indices_row": "i32",
    "stride_table_req": "i32", "stride_output_row": "i32", "stride_output_head": "i32",
    "stride_output_gate_row": "i32", "stride_output_gate_head": "i32",
    "num_rows": "i32", "num_cache_blocks": "i32", "num_requests": "i32",
}
# 16-byte aligned at run time (pointers; strides that are multiples of 16:
# the selection row stride 2,052 and the table stride are not).
_SPLITK_ALIGNED = (
    "q_ptr", "k_cache_ptr", "v_cache_ptr", "indices_ptr", "block_table_ptr",
    "token_to_req_ptr", "partial_output_ptr", "partial_lse_ptr", "output_ptr",
    "output_gate_ptr", "stride_q_row", "stride_q_head", "stride_k_block", "stride_k_token",
    "stride_k_head", "stride_v_block", "stride_v_token", "stride_v_head",
    "stride_output_row", "stride_output_head", "stride_output_gate_row",
    "stride_output_gate_head",
)
# The row-cache kernels take the pointers a batch slices without the
# alignment key (do_not_specialize_on_alignment): never aligned there.
_SLICED = ("indices_ptr", "block_table_ptr", "token_to_req_ptr", "slot_mapping_ptr")
# 0260-qsa-kv-fp8: the FP8 scales (host floats, read only for a uint8 cache).
_SCALE_SIG = {"softmax_scale": "fp32", "output_scale": "fp32"}
_CACHE_SIG = {"cache_rows_ptr": "*bf16", "tags_ptr": "*i64", "hitmarks_ptr": "*i64",
              "claims_ptr": "*i64", "epoch_ptr": "*i64", "stride_cache_line": "i32",
              "stride_cache_head": "i32"}


def _configs():
    cfgs = []
    # every decode size maps to one config (asserted); compile each once
    decode = {upstream._select_config(rows, KV_HEADS, False, TOPK)
              for rows in range(1, rc.ROW_CACHE_MAX_ROWS + 1)}
    assert len(decode) == 1, decode
    for block_n, warps, tiles, splits in sorted(decode):
        common = dict(TOPK=TOPK, PAGE_SIZE=BLOCK, PAGE_TABLE_WIDTH=WIDTH, GROUP_SIZE=Q_HEADS // KV_HEADS,
                      HEAD_DIM=HEAD_DIM, NUM_QUERY_HEADS=Q_HEADS, NUM_SPLITS=splits, NUM_TILES=tiles,
                      BLOCK_M=Q_HEADS // KV_HEADS, BLOCK_N=block_n)
        cfgs.append(dict(fn=upstream._qsa_sparse_paged_gqa_splitk_kernel, signature=_SPLITK_SIG,
                         constexprs=common, aligned=_SPLITK_ALIGNED, num_warps=warps, num_stages=2))
        cfgs.append(dict(fn=rc._qsa_row_cache_splitk_kernel, signature={**_SPLITK_SIG, **_SCALE_SIG, **_CACHE_SIG},
                         constexprs={**common, "NUM_LINES": BLOCK},
                         aligned=tuple(a for a in _SPLITK_ALIGNED if a not in _SLICED)
                         + tuple(_CACHE_SIG),
                         num_warps=warps, num_stages=2))
        cfgs.append(dict(
            fn=rc._qsa_row_cache_plan_kernel,
            signature={"indices_ptr": "*i32", "block_table_ptr": "*i32", "token_to_req_ptr": "*i32",
                       "tags_ptr": "*i64", "hitmarks_ptr": "*i64", "claims_ptr": "*i64",
                       "epoch_ptr": "*i64", "stats_ptr": "*i64", "stride_indices_row": "i32",
                       "stride_table_req": "i32", "num_rows": "i32", "num_cache_blocks": "i32",
                       "num_requests": "i32"},
            constexprs=dict(TOPK=TOPK, PAGE_SIZE=BLOCK, PAGE_TABLE_WIDTH=WIDTH, NUM_LINES=BLOCK,
                            NUM_TILES=tiles, BLOCK_N=block_n, COUNT=False),
            aligned=("tags_ptr", "hitmarks_ptr", "claims_ptr", "epoch_ptr", "stats_ptr"),
            num_warps=1, num_stages=3))
    cfgs.append(dict(
        fn=rc._qsa_row_cache_invalidate_kernel,
        signature={"slot_mapping_ptr": "*i64", "num_slots": "i32", "tags_ptr": "*i64",
                   "hitmarks_ptr": "*i64", "claims_ptr": "*i64", "epoch_ptr": "*i64"},
        constexprs=dict(NUM_LINES=BLOCK, EPOCH_LIMIT=rc.EPOCH_LIMIT, BLOCK=rc._INVALIDATE_BLOCK,
                        RESET_BLOCK=rc._RESET_BLOCK),
        aligned=("tags_ptr", "hitmarks_ptr", "claims_ptr", "epoch_ptr"),
        num_warps=4, num_stages=3))
    return cfgs


def test_row_cache_kernels_fit_sm86():
    cfgs = _configs()
    res = compile_many(cfgs)
    assert len(res) == len(cfgs)
    launch = {}
    for c, cfg in zip(res, cfgs):
        check_fits(c, str(cfg["constexprs"]))
        launch.setdefault(c.name, set()).add(c.shared)
    print({c.name: c.shared for c in res})
    up = max(launch["_qsa_sparse_paged_gqa_splitk_kernel"])
    assert max(launch["_qsa_row_cache_splitk_kernel"]) <= up, (launch, up)
