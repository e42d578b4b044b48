"""The dense linear layer ``Y[M, N] = X[M, K] · Wᵀ (+ bias)`` with MXFP8 or BF16 weights
(docs/linear.md).

Weights: ``codes`` [N, K] uint8 E4M3 and ``scales`` [N, K/32] uint8 E8M0 (the checkpoint layout;
:func:`quantize_weight` makes them from a float matrix with k3's codec, RCEIL). Recipes:
"w8a16" (X stays BF16) and "w8a8" (X quantized per row to MXFP8, the seed's recipe). Recipe
"w16a16" takes the BF16 weights themselves (no quantization): ``codes`` is then the [N, K] BF16
matrix (uint16 bit patterns, or a torch bfloat16 tensor) and ``scales`` is None. X is BF16
bit patterns [M, K] uint16; the output is [M, N] in ``out_dtype``: "bf16" / "fp16" as uint16 bit
patterns, "fp32" as float32. ``bias``: float32 [N] or None.

Every ISA level and thread count gives the bits of the contract (the "reference" backend).
"""

import numpy as np

from . import _k3
from ._arrays import bf16_bits, host_view, max_tokens_arg, need, no_overlap, out16, out_or_new, threads_arg
from .mx import quantize as _mx_quantize

_OUT = {"bf16": np.uint16, "fp16": np.uint16, "fp32": np.float32}
_RECIPES = ("w8a16", "w8a8", "w16a16")


def quantize_weight(w, bf16=False):
    """A weight matrix [N, K] (float32, or BF16 bits as uint16 with ``bf16=True``; K a multiple of
    32) -> (codes [N, K] uint8 E4M3, scales [N, K/32] uint8 E8M0): MXFP8, RCEIL, RNE."""
    return _mx_quantize(w, element="mxfp8", rule="rceil", bf16=bf16)


def _check(recipe, out_dtype, codes, scales, bias):
    """Checks the arguments by name; returns (n, k, codes, scales, bf16) for the native call: the
    MXFP8 codes and scales (bf16 None), or with recipe w16a16 the BF16 weight bits in bf16 (codes
    and scales None)."""
    if recipe not in _RECIPES:
        raise ValueError(f"recipe = '{recipe}' must be one of {list(_RECIPES)}")
    if out_dtype not in _OUT:
        raise ValueError(f"out_dtype = '{out_dtype}' must be one of {sorted(_OUT)}")
    wb = None
    if recipe == "w16a16":
        if scales is not None:
            raise ValueError("scales must be None with recipe = 'w16a16' (codes is the BF16 weight matrix [N, K])")
        codes, wb = None, bf16_bits("codes", host_view(codes))
        w, dtype, what = wb, np.uint16, "BF16 weights as uint16 bits or bfloat16"
    else:
        w, dtype, what = codes, np.uint8, "E4M3 codes as uint8"
    need("codes", w, dtype=dtype)
    if len(w.shape) != 2:
        raise ValueError(f"codes has shape {tuple(w.shape)}, expected [N, K] ({what})")
    n, k = (int(d) for d in w.shape)
    if k % 32 != 0:
        raise ValueError(f"codes has K = {k} columns; K must be a multiple of 32 (the MX block)")
    if wb is None:
        need("scales", scales, (n, k // 32), np.uint8)
    if bias is not None:
        need("bias", bias, (n,), np.float32)
    return n, k, codes, scales, wb


def _host(x, out, out_dtype):
    """Host views: a torch bfloat16 x as its uint16 bits; a 16-bit out in out_dtype's format as its
    bits (the other format is refused by name)."""
    x = bf16_bits("x", host_view(x))
    if out is not None:
        out = host_view(out)
        if out_dtype != "fp32":
            out = out16("out", out, out_dtype)
    return x, out


def _check_x(k, n, x, out, out_type):
    need("x", x, dtype=np.uint16)
    shape = tuple(x.shape)
    if len(shape) != 2 or shape[1] != k:
        raise ValueError(f"x has shape {shape}, expected [M, {k}] (BF16 bits as uint16)")
    m = shape[0]
    out = out_or_new("out", out, (m, n), out_type)
    no_overlap("out", out, (("x", x),))
    return m, out


def run(codes, scales, x, bias=None, recipe="w8a16", out_dtype="bf16", out=None, backend=None, threads=0, isa=""):
    """One call (plan, prepack and run inside): for tools and tests. ``backend``: None (the best
    usable one), "cpu" or "reference" (the contract written plainly)."""
    n, k, codes, scales, wb = _check(recipe, out_dtype, codes, scales, bias)
    given = out
    x, out = _host(x, out, out_dtype)
    m, out = _check_x(k, n, x, out, _OUT[out_dtype])
    _k3.linear_run(k, n, recipe, out_dtype, codes, scales, wb, bias, x, m, backend or "", threads_arg(threads), isa,
                   out)
    return out if given is None else given


class CpuLinear:
    """The CPU backend's serving form: plan and prepacked weights made once; ``run`` takes X
    [M, K] (M <= max_tokens) and writes into the caller's output when one is given."""

    def __init__(self, codes, scales, bias=None, recipe="w8a16", out_dtype="bf16", max_tokens=4096, threads=0,
                 isa=""):
        self.n, self.k, codes, scales, wb = _check(recipe, out_dtype, codes, scales, bias)
        self.recipe, self.out_dtype = recipe, out_dtype
        self._out_type = _OUT[out_dtype]
        self._native = _k3.cpu_linear_prepare(self.k, self.n, recipe, out_dtype, codes, scales, wb, bias,
                                              max_tokens_arg(max_tokens), threads_arg(threads), isa)

    @property
    def plan(self):
        """The plan in one line: ISA level, kernels, threads, tiles, workspace."""
        return self._native.describe

    @property
    def max_tokens(self):
        return self._native.max_tokens

    @property
    def packed_bytes(self):
        """Bytes of the prepacked weights (8.5 bits per weight, 16 with w16a16, plus the bias)."""
        return self._native.packed_bytes

    def run(self, x, out=None):
        given = out
        x, out = _host(x, out, self.out_dtype)
        m, o = _check_x(self.k, self.n, x, out, self._out_type)
        self._native.run(x, m, o)
        return o if given is None else given
