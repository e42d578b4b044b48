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


# ---- CUDA arrays (the CUDA entry points; NEVER RUN ON A GPU) ---------------------------------
_KDLCUDA = 2  # DLPack's device type of CUDA memory


def cuda_device_of(name, a):
    """The CUDA ordinal of a DLPack array (torch / CuPy / JAX on the GPU); a ValueError naming the
    argument and where it lives otherwise (host arrays are never copied to the device for you)."""
    dev = getattr(a, "__dlpack_device__", None)
    if dev is None:
        raise ValueError(f"{name} must be a CUDA array (torch / CuPy, DLPack), got {type(a).__name__}")
    kind, ordinal = dev()
    if int(kind) != _KDLCUDA:
        where = "the host" if int(kind) == 1 else f"DLPack device type {int(kind)}"
        raise ValueError(f"{name} must be a CUDA array, got one on {where} ({type(a).__name__})")
    return int(ordinal)


def need_cuda(name, a, device, shape=None, dtype=None):
    """need() for a CUDA array on `device`; BF16 / FP16 tensors are seen as their uint16 bits."""
    if a is None:
        return None
    d = cuda_device_of(name, a)
    if d != device:
        raise ValueError(f"{name} is on cuda:{d}, the plan is for cuda:{device}")
    return need(name, bits16(a), shape, dtype)


def bits16(a):
    """A torch bfloat16 / float16 tensor as its uint16 bit patterns (a view, no copy); else unchanged."""
    if str(getattr(a, "dtype", "")) in ("torch.bfloat16", "torch.float16"):
        import torch
        return a.view(torch.uint16)
    return a


def stream_int(stream):
    """A cudaStream_t as an integer: an int, a torch.cuda.Stream (.cuda_stream) or a CuPy stream (.ptr)."""
    if stream is None:
        return 0
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    if isinstance(stream, int) and stream >= 0:
        return stream
    raise ValueError(f"stream = {stream!r} must be a cudaStream_t as a non-negative int, a torch.cuda.Stream "
                     "or a CuPy stream")


def cuda_empty(shape, dtype, device):
    """A new CUDA array (torch when installed, else CuPy): for allocations made once, outside the hot path."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        tdt = {"uint8": torch.uint8, "uint16": torch.uint16, "int32": torch.int32, "float32": torch.float32,
               "int64": torch.int64}[np.dtype(dtype).name]
        return torch.empty(shape, dtype=tdt, device=f"cuda:{device}")
    try:
        import cupy
    except ImportError:
        raise RuntimeError("allocating CUDA arrays needs torch or CuPy; pass your own device arrays instead") from None
    with cupy.cuda.Device(device):
        return cupy.empty(shape, dtype=dtype)
