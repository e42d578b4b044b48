"""Helpers shared by the k3 wrappers: shape checks and output allocation."""

import numpy as np


_ndarray = np.ndarray
_dtype_cache = {}


def _np_dtype(dt):
    """numpy dtype of a numpy / torch / other dtype object (cached: this is on every call's path)."""
    r = _dtype_cache.get(dt)
    if r is None:
        r = _dtype_cache[dt] = np.dtype(str(dt).replace("torch.", ""))
    return r


def need(name, a, shape=None, dtype=None):
    """Checks an input array: C-contiguous (no hidden copy is ever made), shape and dtype."""
    if type(a) is _ndarray:  # the common case, kept to a few attribute reads
        if a.flags.c_contiguous and (shape is None or a.shape == shape) and (dtype is None or a.dtype == dtype):
            return a
    elif not hasattr(a, "shape"):
        raise ValueError(f"{name} must be an array (numpy, torch, ...), got {type(a).__name__}")
    contiguous = a.flags.c_contiguous if hasattr(a, "flags") else (a.is_contiguous() if hasattr(a, "is_contiguous")
                                                                    else True)
    if not contiguous:
        raise ValueError(f"{name} must be C-contiguous (k3 never copies an argument behind your back)")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    if dtype is not None and _np_dtype(a.dtype) != np.dtype(dtype):
        raise ValueError(f"{name} has dtype {a.dtype}, expected {np.dtype(dtype).name}")
    return a


def host_view(a):
    """A CPU torch tensor as a numpy array over the same memory (about 1 us; torch's DLPack export
    costs about 10 per tensor); anything else unchanged. Tensors of dtypes numpy lacks (bfloat16)
    are left alone: the checks then ask for their uint16 view."""
    if type(a).__name__ == "Tensor" and getattr(a, "is_cpu", False):
        try:
            return a.detach().numpy()
        except TypeError:
            return a
    return a


def out_or_new(name, out, shape, dtype):
    """The caller's output array (checked) or a new numpy array."""
    if out is None:
        return np.empty(shape, dtype=dtype)
    return need(name, out, shape, dtype)
