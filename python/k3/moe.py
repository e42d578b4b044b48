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
from ._arrays import (DevicePlan, bf16_bits, host_view, int_arg, max_tokens_arg, need, need_cuda, no_overlap, out16,
                      out_or_new, stream_int, threads_arg)

_OUT = {"bf16": np.uint16, "fp16": np.uint16, "fp32": np.float32}


def expert_range(num_experts, ep_size, ep_rank):
    """The experts of EP rank ``ep_rank`` of ``ep_size`` as ``(first, count)``: contiguous balanced
    ranges in rank order, the first ``num_experts % ep_size`` ranks holding one expert more (any
    ``ep_size`` from 1 to ``num_experts``; for example 896 experts on 9 ranks: ranks 0-4 hold 100,
    ranks 5-8 hold 99). The same rule as the C++ library, the checkpoint loader and the CLI."""
    num_experts = int_arg("num_experts", num_experts, 1, 4096)
    ep_size = int_arg("ep_size", ep_size, 1, num_experts)
    ep_rank = int_arg("ep_rank", ep_rank, 0, ep_size - 1)
    return tuple(_k3.expert_range(num_experts, ep_size, ep_rank))


def problem(hidden=3584, intermediate=3072, num_experts=896, top_k=16, ep_size=1, ep_rank=0, recipe="w4a8",
            activation="situ", out_dtype="bf16", situ_beta=4.0, situ_linear_beta=25.0, swiglu_alpha=1.702,
            swiglu_beta=1.0, swiglu_limit=7.0):
    """A checked problem description (defaults: the Kimi-K3 per-rank shape, W4A8, SiTU, BF16 out)."""
    if out_dtype not in _OUT:
        raise ValueError(f"out_dtype = '{out_dtype}' must be one of {sorted(_OUT)}")
    # Range checks before the extension sees the integers (its own checks then give the precise rule).
    big = 2 ** 31 - 1
    hidden = int_arg("hidden", hidden, 1, big)
    intermediate = int_arg("intermediate", intermediate, 1, big)
    num_experts = int_arg("num_experts", num_experts, 1, 4096)
    top_k = int_arg("top_k", top_k, 1, min(32, num_experts))
    ep_size = int_arg("ep_size", ep_size, 1, num_experts)
    ep_rank = int_arg("ep_rank", ep_rank, 0, ep_size - 1)
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
        """This rank's expert count (the partition rule: see :func:`expert_range`)."""
        return self.native.local_experts

    @property
    def first_expert(self):
        """The global id of this rank's first expert."""
        return self.native.first_local_expert

    def __repr__(self):
        return repr(self.native)


def _check_weights(p, fc1_q, fc1_scale, fc2_q, fc2_scale):
    e, k, n = p.local_experts, p.hidden, p.intermediate
    need("fc1_q", fc1_q, (e, 2 * n, k // 2), np.uint8)
    need("fc1_scale", fc1_scale, (e, 2 * n, k // 32), np.uint8)
    need("fc2_q", fc2_q, (e, k, n // 2), np.uint8)
    need("fc2_scale", fc2_scale, (e, k, n // 32), np.uint8)


def _host_inputs(p, x, topk_ids, topk_weights, out):
    """Host arrays of the caller's arguments: torch tensors as numpy views, BF16 tensors as their
    uint16 bits, a 16-bit output in the layer's format as its bits (the other format is refused)."""
    x = bf16_bits("x", host_view(x))
    if out is not None:
        out = host_view(out)
        if p.out_dtype_name != "fp32":
            out = out16("out", out, p.out_dtype_name)
    return x, host_view(topk_ids), host_view(topk_weights), out


def _check_inputs(p, x, topk_ids, topk_weights, out):
    need("x", x, dtype=np.uint16)
    shape = tuple(x.shape)
    if len(shape) != 2 or shape[1] != p.hidden:
        raise ValueError(f"x has shape {shape}, expected [M, {p.hidden}] (BF16 bits as uint16)")
    m = shape[0]
    slots = (m, p.top_k)
    need("topk_ids", topk_ids, slots, np.int32)
    need("topk_weights", topk_weights, slots, np.float32)
    out = out_or_new("out", out, (m, p.hidden), p.out_type)
    no_overlap("out", out, (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)))
    return m, out


def run(p, fc1_q, fc1_scale, fc2_q, fc2_scale, x, topk_ids, topk_weights, out=None, backend=None, threads=0,
        isa=""):
    """One call (plan, prepack and run inside): for tools and tests. ``backend``: None (the best
    usable one), "cpu", "cuda" or "reference" (the FP64 contract oracle, rounded once)."""
    _check_weights(p, fc1_q, fc1_scale, fc2_q, fc2_scale)
    given = out
    x, topk_ids, topk_weights, out = _host_inputs(p, x, topk_ids, topk_weights, out)
    m, out = _check_inputs(p, x, topk_ids, topk_weights, out)
    _k3.moe_run(p.native, fc1_q, fc1_scale, fc2_q, fc2_scale, x, topk_ids, topk_weights, m, backend or "",
                threads_arg(threads), isa, out)
    return out if given is None else given


class PreparedMoe:
    """A layer prepared once through the library's backend registry (the plan and the weights in
    the backend's layout, owned by the object); ``run`` takes the batch and writes into the
    caller's output (M <= max_tokens). ``backend``: None (the default backend: cpu) or a name
    from ``k3.info()["backends"]["moe"]`` ("cpu", "reference", "cuda"; the cuda one copies host
    buffers in and out per call, see :class:`CudaMoe` for device tensors)."""

    def __init__(self, p, fc1_q, fc1_scale, fc2_q, fc2_scale, max_tokens=8192, threads=0, isa="", backend=None):
        _check_weights(p, fc1_q, fc1_scale, fc2_q, fc2_scale)
        self.problem = p
        self._native = _k3.moe_prepare(p.native, backend or "", max_tokens_arg(max_tokens), threads_arg(threads), isa,
                                       fc1_q, fc1_scale, fc2_q, fc2_scale)

    @property
    def backend(self):
        return self._native.backend

    @property
    def plan(self):
        """What runs, in one line: the plan's decisions (ISA level and kernel, threads, chunking, tiles)."""
        return self._native.describe

    @property
    def kernel(self):
        return self._native.kernel

    @property
    def max_tokens(self):
        return self._native.max_tokens

    def run(self, x, topk_ids, topk_weights, out=None):
        given = out
        x, topk_ids, topk_weights, out = _host_inputs(self.problem, x, topk_ids, topk_weights, out)
        m, o = _check_inputs(self.problem, x, topk_ids, topk_weights, out)
        self._native.run(x, topk_ids, topk_weights, m, o)
        return o if given is None else given


class CpuMoe(PreparedMoe):
    """The CPU backend's serving form: :class:`PreparedMoe` on the "cpu" backend."""

    def __init__(self, p, fc1_q, fc1_scale, fc2_q, fc2_scale, max_tokens=8192, threads=0, isa=""):
        super().__init__(p, fc1_q, fc1_scale, fc2_q, fc2_scale, max_tokens=max_tokens, threads=threads, isa=isa,
                         backend="cpu")


class CudaMoe(DevicePlan):
    """The CUDA backend's serving form (this binding has never run on a GPU; the C++ backend ran on an H200).

    The plan is made for ``device`` (at most ``max_tokens`` rows per call) and the host weights
    (checkpoint layout, as for :class:`CpuMoe`) are uploaded once to that device. ``run`` takes
    CUDA arrays (torch / CuPy through DLPack, used in place): x [R, K] BF16 (bfloat16 or uint16
    bits), topk_ids [R, top_k] int32, topk_weights [R, top_k] float32, out [R, K] in the output
    dtype, ``m_device`` (int32 [1] on the device: the real token count, <= R, read by the kernels
    so that a captured graph replays with another M), a workspace of ``workspace_bytes`` (uint8,
    256-byte aligned; ``new_workspace()`` allocates one once) and a stream (int cudaStream_t,
    torch.cuda.Stream or CuPy stream; 0 = default). It only enqueues kernels: no allocation, no
    copy, no synchronization, so it can be captured in a CUDA graph. One workspace serves one
    stream at a time. Raises RuntimeError when the package was built without CUDA.

    ``path`` forces a kernel path by name instead of the plan's choice from the expected rows per
    local expert (``plan`` prints the choice; an unknown name raises ValueError listing the names)."""

    def __init__(self, p, fc1_q, fc1_scale, fc2_q, fc2_scale, max_tokens=8192, device=0, caps=None,
                 path=None):
        self.problem = p
        self.device = int(device)
        _k3.cuda_require()  # the build-without-CUDA message before anything else
        w = [host_view(a) for a in (fc1_q, fc1_scale, fc2_q, fc2_scale)]
        _check_weights(p, *w)
        self._native = _prepare_on(self.device, lambda: _k3.cuda_moe_prepare(
            p.native, max_tokens, self.device, path, caps, *w))

    @property
    def max_tokens(self):
        return self._native.max_tokens

    def run(self, x, topk_ids, topk_weights, out, m_device, workspace, stream=0):
        p, dev = self.problem, self.device
        x = need_cuda("x", x, dev, dtype=np.uint16)
        if len(x.shape) != 2 or x.shape[1] != p.hidden:
            raise ValueError(f"x has shape {tuple(x.shape)}, expected [M, {p.hidden}] (BF16)")
        rows = x.shape[0]
        ids = need_cuda("topk_ids", topk_ids, dev, (rows, p.top_k), np.int32)
        wts = need_cuda("topk_weights", topk_weights, dev, (rows, p.top_k), np.float32)
        o = need_cuda("out", out, dev, (rows, p.hidden), p.out_type)
        m = need_cuda("m_device", m_device, dev, (1,), np.int32)
        self._native.run(x, ids, wts, o, m, need_cuda("workspace", workspace, dev, dtype=np.uint8),
                         stream_int(stream))
        return out


def _prepare_on(device, fn):
    """Runs fn with `device` as the current CUDA device (prepack uploads to the current one)."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        with torch.cuda.device(device):
            return fn()
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None:
        with cupy.cuda.Device(device):
            return fn()
    if device != 0:
        raise RuntimeError(f"device = {device}: selecting a CUDA device other than 0 needs torch or CuPy")
    return fn()
