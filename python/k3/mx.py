"""MXFP4 / MXFP8 block quantization (32 elements per E8M0 scale), bit-exact with NVIDIA's
definitions. Codes are packed E2M1 (two per byte, even element in the low nibble) or E4M3 bytes;
scales are E8M0 codes in the linear layout [rows, cols / 32]."""

import numpy as np

from . import _k3
from ._arrays import need, out_or_new, shape_of


def _row_bytes(element, cols):
    return cols // 2 if element == "mxfp4" else cols


def quantize(x, element="mxfp4", rule="rceil", q=None, scales=None, bf16=False):
    """x: [rows, cols] float32 (or BF16 bit patterns as uint16 with ``bf16=True``), cols a
    multiple of 32. Returns (q, scales). ``rule``: "rceil" (NVIDIA's rounding-up scale, default)
    or "floor" (OCP)."""
    dtype = np.uint16 if bf16 else np.float32
    need("x", x, dtype=dtype)
    if len(x.shape) != 2:
        raise ValueError(f"x must be 2-D [rows, cols], got shape {tuple(x.shape)}")
    rows, cols = x.shape
    q = out_or_new("q", q, (rows, _row_bytes(element, cols)), np.uint8)
    scales = out_or_new("scales", scales, (rows, cols // 32), np.uint8)
    fn = _k3.mx_quantize_bf16 if bf16 else _k3.mx_quantize
    fn(x, rows, cols, element, rule, q, scales)
    return q, scales


def dequantize(q, scales, cols, element="mxfp4", out=None):
    """Exact dequantization to float32 [rows, cols]."""
    if isinstance(cols, bool) or not isinstance(cols, (int, np.integer)) or cols <= 0 or cols % 32:
        raise ValueError(f"cols = {cols!r} must be a positive int, a multiple of 32 (one E8M0 scale per 32 elements)")
    if element not in ("mxfp4", "mxfp8"):
        raise ValueError(f"element = {element!r} must be 'mxfp4' or 'mxfp8'")
    rows = shape_of("q", q, 2, "[rows, packed bytes]")[0]
    need("q", q, (rows, _row_bytes(element, cols)), np.uint8)
    need("scales", scales, (rows, cols // 32), np.uint8)
    out = out_or_new("out", out, (rows, cols), np.float32)
    _k3.mx_dequantize(q, scales, rows, cols, element, out)
    return out
