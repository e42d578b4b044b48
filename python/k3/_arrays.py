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


def _dtype_name(dt):
    return str(dt).replace("torch.", "")


def _same_dtype(actual, want):
    try:
        return _np_dtype(actual) == np.dtype(want)
    except TypeError:  # a dtype numpy does not know (torch.bfloat16, ...): not the one asked for
        return False


def _writable(a):
    flags = getattr(a, "flags", None)
    return True if flags is None else bool(flags.writeable)  # torch tensors are writable


def need(name, a, shape=None, dtype=None, writable=False):
    """Checks an array argument: C-contiguous (no hidden copy is ever made), shape, dtype, and
    for an output (writable=True) that k3 may write it. ValueError naming the argument otherwise."""
    if type(a) is _ndarray:  # the common case, kept to a few attribute reads
        if (a.flags.c_contiguous and (shape is None or a.shape == shape) and (dtype is None or a.dtype == dtype)
                and (not writable or a.flags.writeable)):
            return a
    elif not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise ValueError(f"{name} must be an array (numpy, torch, ...), got {type(a).__name__}")
    if dtype is not None and not _same_dtype(a.dtype, dtype):
        raise ValueError(f"{name} has dtype {_dtype_name(a.dtype)}, expected {np.dtype(dtype).name}"
                         + (" (BF16 data: a torch.bfloat16 tensor or its bits as uint16)"
                            if np.dtype(dtype) == np.uint16 else ""))
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    contiguous = a.flags.c_contiguous if hasattr(a, "flags") else (a.is_contiguous() if hasattr(a, "is_contiguous")
                                                                    else True)
    if not contiguous:
        raise ValueError(f"{name} must be C-contiguous (k3 never copies an argument behind your back)")
    if writable and not _writable(a):
        raise ValueError(f"{name} is read-only, but k3 writes its result there")
    return a


def bf16_bits(name, a):
    """BF16 data as its uint16 bits: a torch bfloat16 tensor becomes its uint16 view (no copy);
    float16 is refused by name (its bits are not BF16's); anything else is returned unchanged for
    need() to check as uint16."""
    dt = str(getattr(a, "dtype", ""))
    if dt == "torch.bfloat16":
        import torch
        return host_view(a.view(torch.uint16))
    if dt in ("torch.float16", "float16"):
        raise ValueError(f"{name} is float16, but k3 reads BF16 here: pass bfloat16 (x.to(torch.bfloat16)) or "
                         "BF16 bit patterns as uint16")
    return a


def out16(name, a, kind):
    """An output of 16-bit values in format `kind` ("bf16" / "fp16") as its uint16 bits: torch
    bfloat16 / float16 (and numpy float16) tensors of that format are viewed, the other format is
    refused by name (its bits would be written in the wrong format)."""
    dt = str(getattr(a, "dtype", ""))
    want = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[kind]
    if dt in ("torch.bfloat16", "torch.float16"):
        if dt != want:
            raise ValueError(f"{name} is {dt[6:]}, but this op writes {kind.upper()}: pass a "
                             f"{want[6:]} tensor (or uint16 bits)")
        import torch
        return host_view(a.view(torch.uint16))
    if dt == "float16":
        if kind != "fp16":
            raise ValueError(f"{name} is float16, but this op writes BF16: pass a torch.bfloat16 tensor or "
                             "uint16 bits")
        return a.view(np.uint16)
    return a


def int_arg(name, v, lo, hi):
    """An integer argument in [lo, hi] (checked before anything is allocated from it)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name} = {v!r} must be an integer in [{lo}, {hi}], got {type(v).__name__}")
    if not lo <= int(v) <= hi:
        raise ValueError(f"{name} = {int(v)} must be in [{lo}, {hi}]")
    return int(v)


#: The largest thread count any k3 entry point takes (k3::kMaxThreadCount; 0 means all logical CPUs).
MAX_THREADS = 256
#: The most rows a prepared layer plans for (the C++ plans' limit, 2^24).
MAX_TOKENS = 1 << 24


def threads_arg(v, name="threads", allow_none=False):
    """A thread count in [0, MAX_THREADS] (0: all logical CPUs; None passes through where the
    caller means "torch's count"): checked here, by name, before the binding's C int sees it, so
    a huge value, a float or a bool (``threads=True``) is refused instead of reinterpreted."""
    if v is None and allow_none:
        return None
    return int_arg(name, v, 0, MAX_THREADS)


def max_tokens_arg(v, name="max_tokens"):
    """Rows per call a layer is planned for, in [1, MAX_TOKENS]."""
    return int_arg(name, v, 1, MAX_TOKENS)


def path_arg(name, path):
    """A filesystem path as str; a NUL byte (which would cut the library's message short) is refused."""
    import os
    p = os.fspath(path)
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    if "\0" in p:
        raise ValueError(f"{name} = {p!r} contains a NUL byte (at index {p.index(chr(0))}): not a valid path")
    return p


def no_overlap(out_name, out, inputs):
    """Refuses an output that shares memory with an input: k3 reads its inputs while it writes its
    outputs, so an alias would give wrong rows with no error. inputs: (name, array or None) pairs."""
    for name, a in inputs:
        if a is None:
            continue
        if a is out:
            raise ValueError(f"{out_name} is the same array as {name}: k3 writes {out_name} while it reads {name}; "
                             "pass separate buffers")
        if np.may_share_memory(out, a):
            raise ValueError(f"{out_name} overlaps {name}: k3 writes {out_name} while it reads {name}; pass separate "
                             "buffers")


def seqlens_arg(name, cu, num_tokens):
    """cu_seqlens as an int64 array: an int64 array is used as it is (checked); a list or tuple of
    Python ints is converted (documented); floats, other integer widths and fewer than 2 entries are
    refused by name."""
    if cu is None:
        return None
    if isinstance(cu, (list, tuple)):
        if any(isinstance(c, bool) or not isinstance(c, (int, np.integer)) for c in cu):
            raise ValueError(f"{name} = {list(cu)!r} must hold integers (token offsets)")
        cu = np.asarray(cu, dtype=np.int64)
    cu = host_view(cu)
    need(name, cu, dtype=np.int64)
    if len(cu.shape) != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} has shape {tuple(cu.shape)}, expected [N + 1] with N >= 1 "
                         f"(offsets 0 = c_0 <= ... <= c_N = {num_tokens})")
    return cu


def shape_of(name, a, ndim, what):
    """The shape of array argument `name`, which must have `ndim` dimensions (`what` describes
    them, e.g. "[T, H, K]"): ValueError naming the argument for a non-array or another rank."""
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise ValueError(f"{name} must be an array (numpy, torch, ...) {what}, got {type(a).__name__}")
    if len(a.shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D {what}, got shape {tuple(a.shape)}")
    return tuple(int(d) for d in a.shape)


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
    """The caller's output array (checked, writable) or a new numpy array."""
    if out is None:
        return np.empty(shape, dtype=dtype)
    return need(name, out, shape, dtype, writable=True)


# ---- CUDA arrays (the CUDA entry points; never run on a GPU from Python) ----------------------
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
class DevicePlan:
    """What a planned CUDA layer shows (k3.kda.CudaKda, k3.moe.CudaMoe): its plan in one line and
    its workspace, on ``self.device``; ``self._native`` is the extension's plan."""

    @property
    def plan(self):
        """The plan in one line: kernel or path, geometry, workspace."""
        return self._native.describe

    @property
    def workspace_bytes(self):
        return self._native.workspace_bytes

    def new_workspace(self):
        """A uint8 device buffer of workspace_bytes (torch, else CuPy): allocate once, reuse per call."""
        return cuda_empty((self.workspace_bytes,), np.uint8, self.device)


