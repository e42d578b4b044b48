"""The fused MoE layer: permute -> GEMM1 -> SiTU / SwiGLU / SiLU -> GEMM2 -> deterministic finalize,
on MXFP4 expert weights (W4A8: MXFP8 activations, W4A16: BF16 activations).

Weights use the checkpoint layout of one EP rank: fc1_q [E_local, 2N, K/2] (rows [gate; up]),
fc1_scale [E_local, 2N, K/32], fc2_q [E_local, K, N/2], fc2_scale [E_local, K, N/32], all uint8.
x is BF16 bit patterns [M, K] uint16; topk_ids [M, top_k] int32 global ids (-1 masked);
topk_weights [M, top_k] float32. The output is [M, K] in out_dtype: "bf16" / "fp16" as uint16 bit
patterns, "fp32" as float32.
"""

import numpy as np

from . import _k3
from ._arrays import host_view, need, out_or_new

_OUT = {"bf16": np.uint16, "fp16": np.uint16, "fp32": np.float32}


def problem(hidden=3584, intermediate=3072, num_experts=896, top_k=16, ep_size=1, ep_rank=0, recipe="w4a8",
            activation="situ", out_dtype="bf16", situ_beta=4.0, situ_linear_beta=25.0, swiglu_alpha=1.702,
            swiglu_beta=1.0, swiglu_limit=7.0):
    """A checked problem description (defaults: the Kimi-K3 per-rank shape, W4A8, SiTU, BF16 out)."""
    if out_dtype not in _OUT:
        raise ValueError(f"out_dtype = '{out_dtype}' must be one of {sorted(_OUT)}")
    p = _k3.moe_problem(hidden, intermediate, num_experts, top_k, ep_size, ep_rank, recipe, activation, out_dtype,
                        situ_beta, situ_linear_beta, swiglu_alpha, swiglu_beta, swiglu_limit)
    p_out = _OUT[out_dtype]
    return _Problem(p, hidden, intermediate, top_k, p_out, out_dtype)


class _Problem:
    def __init__(self, native, hidden, intermediate, top_k, out_type, out_dtype_name):
        self.native, self.hidden, self.intermediate, self.top_k, self.out_type = (native, hidden, intermediate,
                                                                                  top_k, out_type)
        self.out_dtype_name = out_dtype_name  # "bf16", "fp16" or "fp32"

    @property
    def local_experts(self):
        return self.native.local_experts

    def __repr__(self):
        return repr(self.native)


def _check_weights(p, fc1_q, fc1_scale, fc2_q, fc2_scale):
    e, k, n = p.local_experts, p.hidden, p.intermediate
    need("fc1_q", fc1_q, (e, 2 * n, k // 2), np.uint8)
    need("fc1_scale", fc1_scale, (e, 2 * n, k // 32), np.uint8)
    need("fc2_q", fc2_q, (e, k, n // 2), np.uint8)
    need("fc2_scale", fc2_scale, (e, k, n // 32), np.uint8)


def _check_inputs(p, x, topk_ids, topk_weights, out):
    need("x", x, dtype=np.uint16)
    shape = tuple(x.shape)
    if len(shape) != 2 or shape[1] != p.hidden:
        raise ValueError(f"x has shape {shape}, expected [M, {p.hidden}] (BF16 bits as uint16)")
    m = shape[0]
    slots = (m, p.top_k)
    need("topk_ids", topk_ids, slots, np.int32)
    need("topk_weights", topk_weights, slots, np.float32)
    return m, out_or_new("out", out, (m, p.hidden), p.out_type)


def run(p, fc1_q, fc1_scale, fc2_q, fc2_scale, x, topk_ids, topk_weights, out=None, backend=None, threads=0,
        isa=""):
    """One call (plan, prepack and run inside): for tools and tests. ``backend``: None (the best
    usable one), "cpu", "cuda" or "reference" (the FP64 contract oracle, rounded once)."""
    _check_weights(p, fc1_q, fc1_scale, fc2_q, fc2_scale)
    m, out = _check_inputs(p, x, topk_ids, topk_weights, out)
    _k3.moe_run(p.native, fc1_q, fc1_scale, fc2_q, fc2_scale, x, topk_ids, topk_weights, m, backend or "", threads,
                isa, out)
    return out


class CpuMoe:
    """The CPU backend's serving form: the plan and the prepacked weights are made once; ``run``
    takes the batch and writes into the caller's output (M <= max_tokens)."""

    def __init__(self, p, fc1_q, fc1_scale, fc2_q, fc2_scale, max_tokens=8192, threads=0, isa=""):
        _check_weights(p, fc1_q, fc1_scale, fc2_q, fc2_scale)
        self.problem = p
        self._native = _k3.cpu_moe_prepare(p.native, max_tokens, threads, isa, fc1_q, fc1_scale, fc2_q, fc2_scale)

    @property
    def plan(self):
        """The plan in one line: ISA level, kernel, threads, chunking, tiles, workspace."""
        return self._native.describe

    def run(self, x, topk_ids, topk_weights, out=None):
        given = out
        x, topk_ids, topk_weights = host_view(x), host_view(topk_ids), host_view(topk_weights)
        m, o = _check_inputs(self.problem, x, topk_ids, topk_weights, None if out is None else host_view(out))
        self._native.run(x, topk_ids, topk_weights, m, o)
        return o if given is None else given
