"""sm_86 compile of every decode-05 kernel at the real shapes (512 experts,
top-10, hidden 2560, shared intermediate 640), M = 1, 2, 4, 8, per-channel
and group-128 scales: shared memory must fit a 3090 (<= 101,376 B)."""

import pytest

pytest.importorskip("triton")

from sm86 import check_fits, compile_many  # noqa: E402

from vllm.models.qwen4_exp.nvidia.ops import moe_fused as mf  # noqa: E402

E, TOPK, H, I = 512, 10, 2560, 640
TOKENS = (1, 2, 4, 8)


def _route_cfgs():
    sig = {"x_ptr": "*bf16", "gw_ptr": "*bf16", "sgw_ptr": "*bf16", "logits_ptr": "*fp32",
           "counter_ptr": "*i32", "topk_w_ptr": "*fp32", "topk_ids_ptr": "*i32", "sorted_ptr": "*i32",
           "expert_ids_ptr": "*i32", "ntpp_ptr": "*i32", "M": "i32", "E": "i32", "K": "i32",
           "stride_xm": "i32", "stride_g": "i32", "stride_l": "i32", "num_sorted": "i32",
           "num_blocks": "i32"}
    aligned = ("x_ptr", "gw_ptr", "sgw_ptr", "logits_ptr", "counter_ptr", "topk_w_ptr", "topk_ids_ptr",
               "sorted_ptr", "expert_ids_ptr", "ntpp_ptr", "E", "K", "stride_xm", "stride_g")
    out = []
    for m in TOKENS:
        bn, bk, nw = mf.ROUTE_CFG[1 << (m - 1).bit_length()]
        out.append(dict(fn=mf._moe_route_kernel, signature=sig,
                        constexprs=mf.route_constexprs(m, E, TOPK, block_n=bn, block_k=bk),
                        aligned=aligned, num_warps=nw, num_stages=3))
    return out


def _shared_cfgs():
    out = []
    for m in TOKENS:
        bm = 1 << (m - 1).bit_length()
        for grp in (0, 128):
            out.append(dict(
                fn=mf._shared_gate_up_silu_kernel,
                signature={"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16",
                           "M": "i32", "K": "i32", "I": "i32", "stride_xm": "i32", "stride_w": "i32",
                           "stride_s": "i32", "stride_om": "i32"},
                constexprs=dict(GROUP=grp, BLOCK_M=bm, BLOCK_N=mf.GATE_UP_BLOCK_N,
                                BLOCK_K=min(mf.GATE_UP_BLOCK_K, grp or H)),
                aligned=("x_ptr", "w_ptr", "s_ptr", "out_ptr", "K", "I", "stride_xm", "stride_w",
                         "stride_om"),
                num_warps=mf.SHARED_NUM_WARPS, num_stages=3))
            out.append(dict(
                fn=mf._shared_down_final_kernel,
                signature={"a_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "routed_ptr": "*bf16",
                           "sg_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "H": "i32", "I": "i32",
                           "stride_am": "i32", "stride_w": "i32", "stride_s": "i32", "stride_rm": "i32",
                           "stride_rk": "i32", "stride_sg": "i32", "stride_om": "i32"},
                constexprs=dict(TOPK=TOPK, GROUP=grp, BLOCK_M=bm, BLOCK_N=mf.DOWN_BLOCK_N,
                                BLOCK_K=min(mf.DOWN_BLOCK_K, grp or I)),
                aligned=("a_ptr", "w_ptr", "s_ptr", "routed_ptr", "sg_ptr", "out_ptr", "H", "I",
                         "stride_am", "stride_w", "stride_rm", "stride_rk", "stride_om"),
                num_warps=mf.SHARED_NUM_WARPS, num_stages=3))
    for grp in (0, 128):
        out.append(dict(
            fn=mf._int6_planes_gemm_kernel,
            signature={"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16",
                       "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_w": "i32",
                       "stride_s": "i32", "stride_om": "i32"},
            constexprs=dict(GROUP=grp, DOT_F32=False, BLOCK_M=mf.GEMM_BLOCK_M, BLOCK_N=mf.GEMM_BLOCK_N,
                            BLOCK_K=min(mf.GEMM_BLOCK_K, grp or H)),
            aligned=("x_ptr", "w_ptr", "s_ptr", "out_ptr", "M", "N", "K", "stride_xm", "stride_w",
                     "stride_om"),
            num_warps=mf.GEMM_NUM_WARPS, num_stages=mf.GEMM_NUM_STAGES))
    return out


def test_all_kernels_fit_sm86():
    cfgs = _route_cfgs() + _shared_cfgs()
    res = compile_many(cfgs)
    assert len(res) == len(cfgs)
    for c, cfg in zip(res, cfgs):
        check_fits(c, str(cfg["constexprs"]))
