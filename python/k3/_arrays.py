"""Helpers shared by the k3 wrappers: shape checks and output allocation."""

import numpy as np


def need(name, a, shape=None, dtype=None):
    """Checks an input array: C-contiguous (no hidden copy is ever made), shape and dtype."""
    if not hasattr(a, "shape"):
        raise ValueError(f"{name} must be an array (numpy, torch, ...), got {type(a).__name__}")
    contiguous = a.flags.c_contiguous if hasattr(a, "flags") else (a.is_contiguous() if hasattr(a, "is_contiguous")
                                                                    else True)
    if not contiguous:
        raise ValueError(f"{name} must be C-contiguous (k3 never copies an argument behind your back)")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    if dtype is not None and np.dtype(str(a.dtype).replace("torch.", "")) != np.dtype(dtype):
        raise ValueError(f"{name} has dtype {a.dtype}, expected {np.dtype(dtype).name}")
    return a


def out_or_new(name, out, shape, dtype):
    """The caller's output array (checked) or a new numpy array."""
    if out is None:
        return np.empty(shape, dtype=dtype)
    return need(name, out, shape, dtype)
