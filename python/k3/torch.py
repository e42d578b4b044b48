"""k3's kernels as torch custom ops (``torch.library``), and a drop-in fused-MoE module.

Importing ``k3.torch`` registers, in the ``k3`` op namespace:

- ``torch.ops.k3.route(logits, bias, top_k, n_group, topk_group, renormalize, routed_scaling_factor,
  topk_ids!, topk_weights!)``: the Kimi-K3 router, writing the caller's ``topk_ids`` (int32) and
  ``topk_weights`` (float32).
- ``torch.ops.k3.moe_run(layer, x, topk_ids, topk_weights, out!)``: the fused MoE of a prepared
  layer (``layer`` is the integer handle of a :class:`FusedMoE` / :func:`prepare_moe`), ``x`` BF16
  ``[M, K]``, ``out`` ``[M, K]`` in the layer's output dtype (bfloat16, float16 or float32).
- ``torch.ops.k3.kda_verify_replay / kda_commit``: speculative verify without snapshots (k3.kda's
  verify_replay / commit; CPU only).
- ``torch.ops.k3.kda_prefill / kda_decode / kda_verify``: Kimi Delta Attention (k3.kda's
  prefill / decode / verify; the configuration as scalar arguments, absent optional tensors as
  empty ones), writing ``o!`` (and ``final_state!`` / the state pool ``state_pool!`` in place).
- ``torch.ops.k3.causal_conv1d(x, weight, bias, cu_seqlens, conv_state!, silu, y!)``: the KDA
  layer's short convolution + SiLU (k3.kda.causal_conv1d; CPU only): x [T, D], weight [D, W],
  conv_state [N, D, S] and y all float32 or all bfloat16, bias float32 (empty tensors: absent).

Both mutate only their ``!`` outputs and return nothing, so they work under
``torch.compile(fullgraph=True)`` (fake implementations describe them to the compiler) and in
CUDA-graph-style static-buffer loops; tensors cross to the library through DLPack without a copy
(BF16 tensors are viewed as uint16 bit patterns, never converted). The extension does not link
against torch. Kernels are registered for CPU and CUDA tensors. The CUDA kernels (never run on a
GPU from Python; the C++ backend behind them ran on an H200, 2026-12-04) enqueue on ``torch.cuda.current_stream()`` and never
synchronize or copy, so they can be captured in torch CUDA graphs; in a package built without
CUDA they raise RuntimeError saying how to build with it. A layer is prepared for one device
(``prepare_moe(..., device=...)`` / ``FusedMoE(..., device=...)``): the CPU (default) or a GPU.
"""

import atexit
import itertools
import threading

import torch

from . import _k3
from . import kda as _kda
from . import linear as _linear
from . import moe as _moe
from ._arrays import MAX_THREADS, MAX_TOKENS, need, threads_arg
from .routing import route as _route

__all__ = ["FusedMoE", "Linear", "prepare_moe", "release_moe", "prepare_linear", "release_linear"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_layers = {}
_next_id = itertools.count(1)
_lock = threading.Lock()


@atexit.register
def _release_all():
    """Prepared layers still registered at exit are freed before the extension goes away."""
    with _lock:
        _layers.clear()


def _bits(t, name, want=torch.bfloat16):
    """A 16-bit float tensor of dtype `want` as its uint16 bit patterns (a view: no copy). BF16
    and FP16 are told apart: float16 bits read as BF16 (or the reverse) would be silently wrong."""
    if t.dtype == want:
        return t.view(torch.uint16)
    hint = ""
    if {t.dtype, want} == {torch.bfloat16, torch.float16}:
        hint = f" (the two 16-bit formats differ; convert with .to({want}))"
    raise ValueError(f"{name} has dtype {t.dtype}, expected {want}{hint}")


def _out16(out, problem):
    """The MoE output: exactly the layer's out dtype (float32 as is, 16-bit as bit patterns)."""
    want = _DTYPES[problem.out_dtype_name]
    if out.dtype == torch.float32 and want == torch.float32:
        return out
    return _bits(out, "out", want)


def _np(t):
    """A CPU tensor as a numpy array over the same memory. Crossing as numpy costs about 1 us per
    tensor; torch's own DLPack export costs about 10 (measured with python/benchmarks/overhead.py)."""
    return t.detach().numpy()


class _CudaLayer:
    """A k3.moe.CudaMoe with its workspace and its device token count, allocated once."""

    def __init__(self, moe, device):
        self.moe, self.device = moe, device
        self.workspace = torch.empty(moe.workspace_bytes, dtype=torch.uint8, device=device)
        self.m_device = torch.zeros(1, dtype=torch.int32, device=device)


def _host(a):
    """Weights for prepacking: a CUDA tensor is copied to the host once (construction, not the hot path)."""
    if isinstance(a, torch.Tensor) and a.device.type != "cpu":
        return a.detach().cpu()
    return a


def prepare_moe(problem, fc1_q, fc1_scale, fc2_q, fc2_scale, max_tokens=8192, threads=None, isa="", device=None):
    """Plans and prepacks one layer's experts and returns its integer handle for
    ``torch.ops.k3.moe_run``. Weights: uint8 tensors or arrays in the checkpoint layout.
    ``device``: None / "cpu" (k3.moe.CpuMoe) or a CUDA device (k3.moe.CudaMoe, the weights
    uploaded to it, one workspace allocated; the Python CUDA bindings have never run on a GPU; the C++ backend behind them ran on an H200, 2026-12-04).
    ``threads``: None (default) takes torch's thread count (``torch.get_num_threads()``) so that
    k3 and torch share the cores without oversubscription; 0 means all logical CPUs."""
    threads = min(torch.get_num_threads(), MAX_THREADS) if threads is None else threads_arg(threads)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cpu":
        layer = _moe.CpuMoe(problem, fc1_q, fc1_scale, fc2_q, fc2_scale, max_tokens=max_tokens, threads=threads,
                            isa=isa)
    elif dev.type == "cuda":
        _k3.cuda_require()
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        w = [_host(a) for a in (fc1_q, fc1_scale, fc2_q, fc2_scale)]
        layer = _CudaLayer(_moe.CudaMoe(problem, *w, max_tokens=max_tokens, device=dev.index), dev)
    else:
        raise ValueError(f"device = {device!r} must be None, 'cpu' or a CUDA device")
    with _lock:
        handle = next(_next_id)
        _layers[handle] = layer
    return handle


def release_moe(handle):
    """Frees a prepared layer (its packed weights)."""
    with _lock:
        _layers.pop(handle, None)


def _layer(handle):
    with _lock:
        layer = _layers.get(handle)
    if layer is None or isinstance(layer, _linear.CpuLinear):
        raise ValueError(f"layer = {handle} is not a prepared k3 MoE layer (prepare_moe returns the handle)")
    return layer


def prepare_linear(codes, scales, bias=None, recipe="w8a16", out_dtype="bf16", max_tokens=4096, threads=None, isa=""):
    """Plans and prepacks one dense layer (k3.linear.CpuLinear) and returns its integer handle for
    ``torch.ops.k3.linear``. codes [N, K] / scales [N, K/32]: uint8 MXFP8 weights (see
    k3.linear.quantize_weight); with recipe "w16a16" codes is the BF16 weight [N, K] (a bfloat16
    tensor or its uint16 bits) and scales is None; bias: float32 [N] or None. ``threads``: None
    takes ``torch.get_num_threads()``; 0 means all logical CPUs."""
    threads = min(torch.get_num_threads(), MAX_THREADS) if threads is None else threads_arg(threads)
    if isinstance(codes, torch.Tensor) and codes.dtype == torch.bfloat16:
        codes = codes.view(torch.uint16)
    args = [_np(a) if isinstance(a, torch.Tensor) else a for a in (codes, scales, bias)]
    layer = _linear.CpuLinear(*args, recipe=recipe, out_dtype=out_dtype, max_tokens=max_tokens, threads=threads,
                              isa=isa)
    with _lock:
        handle = next(_next_id)
        _layers[handle] = layer
    return handle


def release_linear(handle):
    """Frees a prepared dense layer."""
    release_moe(handle)


def _linear_layer(handle):
    with _lock:
        layer = _layers.get(handle)
    if not isinstance(layer, _linear.CpuLinear):
        raise ValueError(f"layer = {handle} is not a prepared k3 linear layer (prepare_linear returns the handle)")
    return layer


# Registered with torch.library.Library (schema + CPU kernel) rather than the custom_op decorator:
# the same op for the dispatcher and the compiler, at about a fifth of the per-call cost.
_lib = torch.library.Library("k3", "DEF")
_lib.define("route(Tensor logits, Tensor bias, int top_k, int n_group, int topk_group, bool renormalize, "
            "float routed_scaling_factor, Tensor(a!) topk_ids, Tensor(b!) topk_weights) -> ()")
_lib.define("moe_run(int layer, Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor(a!) out) -> ()")
_lib.define("linear(int layer, Tensor x, Tensor(a!) out) -> ()")
# KDA: the configuration as scalars (gate, gate_lower_bound, beta_logits, l2norm_qk, scale, layout);
# a_log, dt_bias, cu_seqlens, initial_state and final_state may be empty tensors (absent).
_KDA_CFG = "str gate, float gate_lower_bound, bool beta_logits, bool l2norm_qk, float scale, str layout"
_lib.define("causal_conv1d(Tensor x, Tensor weight, Tensor bias, Tensor cu_seqlens, Tensor(a!) conv_state, bool silu, "
            "Tensor(b!) y) -> ()")
_lib.define("kda_prefill(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor a_log, Tensor dt_bias, "
            "Tensor cu_seqlens, Tensor initial_state, " + _KDA_CFG + ", Tensor(a!) o, Tensor(b!) final_state) -> ()")
_lib.define("kda_decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor a_log, Tensor dt_bias, "
            "Tensor(a!) state_pool, Tensor state_indices, " + _KDA_CFG + ", Tensor(b!) o) -> ()")
_lib.define("kda_verify(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor a_log, Tensor dt_bias, "
            "Tensor(a!) state_pool, Tensor state_indices, Tensor num_accepted, " + _KDA_CFG +
            ", Tensor(b!) o) -> ()")
# Speculative verify without snapshots (k3.kda.verify_replay / commit; the CPU backend only).
_lib.define("kda_verify_replay(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor a_log, Tensor dt_bias, "
            "Tensor cu_seqlens, int window_tokens, Tensor state_pool, Tensor state_indices, Tensor(a!) window_pool, "
            + _KDA_CFG + ", Tensor(b!) o) -> ()")
_lib.define("kda_commit(Tensor(a!) state_pool, Tensor(b!) window_pool, Tensor state_indices, Tensor num_accepted, "
            "int window_tokens, int heads, int head_k, int head_v, str layout) -> ()")


def _route_cpu(logits, bias, top_k, n_group, topk_group, renormalize, routed_scaling_factor, topk_ids, topk_weights):
    _route(_np(logits), _np(bias) if bias.numel() > 0 else None, top_k, n_group, topk_group, renormalize,
           routed_scaling_factor, ids=_np(topk_ids), weights=_np(topk_weights))


def _moe_run_cpu(layer, x, topk_ids, topk_weights, out):
    lay = _layer(layer)
    if isinstance(lay, _CudaLayer):
        raise ValueError(f"layer = {layer} was prepared for {lay.device}, but x is on the CPU")
    o = _out16(out, lay.problem)
    lay.run(_np(_bits(x, "x")), _np(topk_ids), _np(topk_weights), out=_np(o))


def _linear_cpu(layer, x, out):
    lay = _linear_layer(layer)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x has dtype {x.dtype}, expected torch.bfloat16 (the layer's activations are BF16)")
    want = _DTYPES[lay.out_dtype]
    if out.dtype != want:
        raise ValueError(f"out has dtype {out.dtype}, expected {want} (the layer's out_dtype = '{lay.out_dtype}')")
    if x.dim() != 2 or x.shape[1] != lay.k or not x.is_contiguous():
        raise ValueError(f"x has shape {tuple(x.shape)}, expected a contiguous [M, {lay.k}]")
    if tuple(out.shape) != (x.shape[0], lay.n) or not out.is_contiguous():
        raise ValueError(f"out has shape {tuple(out.shape)}, expected a contiguous [{x.shape[0]}, {lay.n}]")
    _disjoint("out", out, "x", x)
    o = _np(out if out.dtype == torch.float32 else out.view(torch.uint16))
    xs = _np(x.view(torch.uint16))
    m, step = x.shape[0], lay.max_tokens
    for r0 in range(0, m, step):  # M above the layer's max_tokens: in row blocks (every row is its own dots)
        r1 = min(m, r0 + step)
        lay._native.run(xs[r0:r1], r1 - r0, o[r0:r1])  # shapes and dtypes checked above


def _disjoint(out_name, out, in_name, x):
    """Refuses an output whose bytes overlap an input's (contiguous tensors): k3 reads the input
    while it writes the output, so rows beyond the first tile would read what it wrote."""
    if out.numel() == 0 or x.numel() == 0:
        return
    o0, x0 = out.data_ptr(), x.data_ptr()
    o1, x1 = o0 + out.numel() * out.element_size(), x0 + x.numel() * x.element_size()
    if o0 < x1 and x0 < o1:
        raise ValueError(f"{out_name} overlaps {in_name} in memory (bytes [{o0:#x}, {o1:#x}) and [{x0:#x}, {x1:#x})); "
                         f"{out_name} must be a separate tensor")


def _refuse_grad(x, what, stock=None):
    """k3 has no backward: an input that requires grad (with grad enabled) runs `stock` (the
    kept torch module, with a one-time warning) or is refused, never silently detached."""
    if not (torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad):
        return False
    if stock is None:
        raise RuntimeError(f"{what}: x requires grad, but k3 has no backward (its output would silently lose the "
                           "graph); run under torch.no_grad() or torch.inference_mode(), or detach x first")
    return True


def _stream(device):
    return torch.cuda.current_stream(device).cuda_stream


# The CUDA kernels: enqueued on the current stream; no synchronization, no host copy, so they are
# captured by torch.cuda.graph like any torch op. Never run on a GPU from Python (the C++ backend
# ran on an H200, 2026-12-04).
def _route_cuda(logits, bias, top_k, n_group, topk_group, renormalize, routed_scaling_factor, topk_ids, topk_weights):
    _k3.cuda_require()
    need("logits", logits, dtype="float32")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [M, E], got shape {tuple(logits.shape)}")
    m, e = logits.shape
    need("bias", bias, (e,) if bias.numel() > 0 else None, "float32")
    need("topk_ids", topk_ids, (m, top_k), "int32")
    need("topk_weights", topk_weights, (m, top_k), "float32")
    m_device = torch.full((1,), m, dtype=torch.int32, device=logits.device)  # a fill kernel (graph-safe)
    _k3.cuda_route(logits, bias if bias.numel() > 0 else None, m_device, e, top_k, n_group, topk_group, renormalize,
                   routed_scaling_factor, topk_ids, topk_weights, _stream(logits.device))


def _moe_run_cuda(layer, x, topk_ids, topk_weights, out):
    _k3.cuda_require()
    lay = _layer(layer)
    if not isinstance(lay, _CudaLayer):
        raise ValueError(f"layer = {layer} was prepared for the CPU, but x is on {x.device} "
                         "(prepare_moe / FusedMoE with device=...)")
    if x.device != lay.device:
        raise ValueError(f"layer = {layer} was prepared for {lay.device}, but x is on {x.device}")
    lay.m_device.fill_(x.shape[0])  # the token count on the device: a fill kernel, no copy
    o = _out16(out, lay.moe.problem)
    lay.moe.run(_bits(x, "x"), topk_ids, topk_weights, o, lay.m_device, lay.workspace, _stream(x.device))


_tls = threading.local()


class kda_options:
    """Context manager: the thread count (None: torch's, ``torch.get_num_threads()``) and the SIMD
    level ("": the best the CPU has; "avx2", "scalar", ...) of the KDA ops called inside it on
    this thread."""

    def __init__(self, threads=None, isa=""):
        self.threads, self.isa = threads_arg(threads, allow_none=True), isa

    def __enter__(self):
        self.saved = (getattr(_tls, "threads", None), getattr(_tls, "isa", ""))
        _tls.threads, _tls.isa = self.threads, self.isa
        return self

    def __exit__(self, *exc):
        _tls.threads, _tls.isa = self.saved
        return False


def kda_threads(threads):
    """``kda_options(threads=threads)``."""
    return kda_options(threads=threads)


def _threads():
    """k3 shares the cores with torch: by default the KDA ops use torch's thread count."""
    t = getattr(_tls, "threads", None)
    return min(torch.get_num_threads(), MAX_THREADS) if t is None else t


def _isa():
    return getattr(_tls, "isa", "")


def _act(t, name):
    """q / k / v: float32 as is, bfloat16 as its uint16 bits (a view); float16 is refused (its bits
    are not BF16; k3.fla widens it exactly to float32 instead)."""
    if t.dtype == torch.float32:
        return t
    if t.dtype != torch.bfloat16:
        raise ValueError(f"{name} has dtype {t.dtype}, expected torch.float32 or torch.bfloat16"
                         + (" (float16 bits are not BF16: convert it, or call k3.fla, which widens float16 "
                            "exactly)" if t.dtype == torch.float16 else ""))
    return _bits(t, name)


def _opt_np(t):
    return _np(t) if t.numel() > 0 else None


def _kda_cfg(gate, gate_lower_bound, beta_logits, l2norm_qk, scale, layout):
    return dict(gate=gate, gate_lower_bound=gate_lower_bound, beta_logits=beta_logits, l2norm_qk=l2norm_qk,
                scale=scale, layout=layout)


def _kda_prefill_cpu(q, k, v, g, beta, a_log, dt_bias, cu_seqlens, initial_state, gate, gate_lower_bound,
                     beta_logits, l2norm_qk, scale, layout, o, final_state):
    _kda.prefill(_np(_act(q, "q")), _np(_act(k, "k")), _np(_act(v, "v")), _np(g), _np(beta), a_log=_opt_np(a_log),
                 dt_bias=_opt_np(dt_bias), cu_seqlens=_opt_np(cu_seqlens), initial_state=_opt_np(initial_state),
                 o=_np(o), final_state=_opt_np(final_state), backend="cpu", threads=_threads(), isa=_isa(),
                 **_kda_cfg(gate, gate_lower_bound, beta_logits, l2norm_qk, scale, layout))


def _kda_decode_cpu(q, k, v, g, beta, a_log, dt_bias, state_pool, state_indices, gate, gate_lower_bound, beta_logits,
                    l2norm_qk, scale, layout, o):
    _kda.decode(_np(_act(q, "q")), _np(_act(k, "k")), _np(_act(v, "v")), _np(g), _np(beta), _np(state_pool),
                _np(state_indices), a_log=_opt_np(a_log), dt_bias=_opt_np(dt_bias), o=_np(o), backend="cpu",
                threads=_threads(), isa=_isa(), **_kda_cfg(gate, gate_lower_bound, beta_logits, l2norm_qk, scale, layout))


def _kda_verify_cpu(q, k, v, g, beta, a_log, dt_bias, state_pool, state_indices, num_accepted, gate,
                    gate_lower_bound, beta_logits, l2norm_qk, scale, layout, o):
    _kda.verify(_np(_act(q, "q")), _np(_act(k, "k")), _np(_act(v, "v")), _np(g), _np(beta), _np(state_pool),
                _np(state_indices), _np(num_accepted), a_log=_opt_np(a_log), dt_bias=_opt_np(dt_bias), o=_np(o),
                backend="cpu", threads=_threads(), isa=_isa(),
                **_kda_cfg(gate, gate_lower_bound, beta_logits, l2norm_qk, scale, layout))


def _kda_verify_replay_cpu(q, k, v, g, beta, a_log, dt_bias, cu_seqlens, window_tokens, state_pool, state_indices,
                           window_pool, gate, gate_lower_bound, beta_logits, l2norm_qk, scale, layout, o):
    _kda.verify_replay(_np(_act(q, "q")), _np(_act(k, "k")), _np(_act(v, "v")), _np(g), _np(beta), _np(state_pool),
                       _np(state_indices), _np(window_pool), window_tokens, cu_seqlens=_opt_np(cu_seqlens),
                       a_log=_opt_np(a_log), dt_bias=_opt_np(dt_bias), o=_np(o), backend="cpu", threads=_threads(),
                       isa=_isa(), **_kda_cfg(gate, gate_lower_bound, beta_logits, l2norm_qk, scale, layout))


def _kda_commit_cpu(state_pool, window_pool, state_indices, num_accepted, window_tokens, heads, head_k, head_v, layout):
    _kda.commit(_np(state_pool), _np(window_pool), _np(state_indices), _np(num_accepted), window_tokens, heads, head_k,
                head_v, layout=layout, backend="cpu", threads=_threads(), isa=_isa())


def _cpu_only(name):
    def refuse(*args):
        raise ValueError(f"k3::{name} runs on the CPU backend only (its CUDA side waits for a GPU window): pass CPU "
                         "tensors, or use k3::kda_verify, which writes every prefix state")
    return refuse


_lib.impl("kda_verify_replay", _kda_verify_replay_cpu, "CPU")
_lib.impl("kda_commit", _kda_commit_cpu, "CPU")
_lib.impl("kda_verify_replay", _cpu_only("kda_verify_replay"), "CUDA")
_lib.impl("kda_commit", _cpu_only("kda_commit"), "CUDA")


@torch.library.register_fake("k3::kda_verify_replay", lib=_lib)
def _(q, k, v, g, beta, a_log, dt_bias, cu_seqlens, window_tokens, state_pool, state_indices, window_pool, gate,
      gate_lower_bound, beta_logits, l2norm_qk, scale, layout, o):
    return None


@torch.library.register_fake("k3::kda_commit", lib=_lib)
def _(state_pool, window_pool, state_indices, num_accepted, window_tokens, heads, head_k, head_v, layout):
    return None


# One k3.kda.CudaKda (plan + workspace) per configuration, device and batch-size bound, made on
# first use (make it once outside a CUDA-graph capture: the plan reads the device's properties).
_cuda_kda = {}


def _cuda_kda_for(q, v, seqs, cfg):
    key = (q.device.index, q.shape[1], q.shape[2], v.shape[2], tuple(sorted(cfg.items())))
    with _lock:
        entry = _cuda_kda.get(key)
        max_seqs = _k3.cuda_kda_replan_max_seqs(0 if entry is None else entry[0].max_seqs, seqs)
        if max_seqs:  # the library's re-plan policy
            plan = _kda.CudaKda(q.shape[1], q.shape[2], v.shape[2], max_seqs=max_seqs, device=q.device.index, **cfg)
            plan.max_seqs = max_seqs
            entry = (plan, torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=q.device))
            _cuda_kda[key] = entry
    return entry


def _opt_cuda(t):
    return t if t.numel() > 0 else None


def _kda_prefill_cuda(q, k, v, g, beta, a_log, dt_bias, cu_seqlens, initial_state, gate, gate_lower_bound,
                      beta_logits, l2norm_qk, scale, layout, o, final_state):
    _k3.cuda_require()
    seqs = cu_seqlens.numel() - 1 if cu_seqlens.numel() > 0 else 1
    plan, ws = _cuda_kda_for(q, v, seqs, _kda_cfg(gate, gate_lower_bound, beta_logits, l2norm_qk, scale, layout))
    plan.prefill(_act(q, "q"), _act(k, "k"), _act(v, "v"), g, beta, o, ws, _stream(q.device), a_log=_opt_cuda(a_log),
                 dt_bias=_opt_cuda(dt_bias), cu_seqlens=_opt_cuda(cu_seqlens), initial_state=_opt_cuda(initial_state),
                 final_state=_opt_cuda(final_state))


def _kda_decode_cuda(q, k, v, g, beta, a_log, dt_bias, state_pool, state_indices, gate, gate_lower_bound,
                     beta_logits, l2norm_qk, scale, layout, o):
    _k3.cuda_require()
    plan, ws = _cuda_kda_for(q, v, q.shape[0], _kda_cfg(gate, gate_lower_bound, beta_logits, l2norm_qk, scale, layout))
    plan.decode(_act(q, "q"), _act(k, "k"), _act(v, "v"), g, beta, state_pool, state_indices, o, ws,
                _stream(q.device), a_log=_opt_cuda(a_log), dt_bias=_opt_cuda(dt_bias))


def _kda_verify_cuda(q, k, v, g, beta, a_log, dt_bias, state_pool, state_indices, num_accepted, gate,
                     gate_lower_bound, beta_logits, l2norm_qk, scale, layout, o):
    _k3.cuda_require()
    plan, ws = _cuda_kda_for(q, v, state_indices.shape[0],
                             _kda_cfg(gate, gate_lower_bound, beta_logits, l2norm_qk, scale, layout))
    plan.verify(_act(q, "q"), _act(k, "k"), _act(v, "v"), g, beta, state_pool, state_indices, num_accepted, o, ws,
                _stream(q.device), a_log=_opt_cuda(a_log), dt_bias=_opt_cuda(dt_bias))


for _name, _cpu, _cuda in (("kda_prefill", _kda_prefill_cpu, _kda_prefill_cuda),
                           ("kda_decode", _kda_decode_cpu, _kda_decode_cuda),
                           ("kda_verify", _kda_verify_cpu, _kda_verify_cuda)):
    _lib.impl(_name, _cpu, "CPU")
    _lib.impl(_name, _cuda, "CUDA")


@torch.library.register_fake("k3::kda_prefill", lib=_lib)
def _(q, k, v, g, beta, a_log, dt_bias, cu_seqlens, initial_state, gate, gate_lower_bound, beta_logits, l2norm_qk,
      scale, layout, o, final_state):
    return None


@torch.library.register_fake("k3::kda_decode", lib=_lib)
def _(q, k, v, g, beta, a_log, dt_bias, state_pool, state_indices, gate, gate_lower_bound, beta_logits, l2norm_qk,
      scale, layout, o):
    return None


@torch.library.register_fake("k3::kda_verify", lib=_lib)
def _(q, k, v, g, beta, a_log, dt_bias, state_pool, state_indices, num_accepted, gate, gate_lower_bound, beta_logits,
      l2norm_qk, scale, layout, o):
    return None


def _conv_cpu(x, weight, bias, cu_seqlens, conv_state, silu, y):
    _kda.causal_conv1d(x, weight, conv_state=conv_state if conv_state.numel() > 0 else None,
                       bias=bias if bias.numel() > 0 else None,
                       cu_seqlens=cu_seqlens if cu_seqlens.numel() > 0 else None, silu=silu, y=y, threads=_threads())


_lib.impl("causal_conv1d", _conv_cpu, "CPU")


@torch.library.register_fake("k3::causal_conv1d", lib=_lib)
def _(x, weight, bias, cu_seqlens, conv_state, silu, y):
    return None


_lib.impl("route", _route_cpu, "CPU")
_lib.impl("moe_run", _moe_run_cpu, "CPU")
_lib.impl("linear", _linear_cpu, "CPU")
_lib.impl("route", _route_cuda, "CUDA")
_lib.impl("moe_run", _moe_run_cuda, "CUDA")


@torch.library.register_fake("k3::route", lib=_lib)
def _(logits, bias, top_k, n_group, topk_group, renormalize, routed_scaling_factor, topk_ids, topk_weights):
    return None


@torch.library.register_fake("k3::linear", lib=_lib)
def _(layer, x, out):
    return None


@torch.library.register_fake("k3::moe_run", lib=_lib)
def _(layer, x, topk_ids, topk_weights, out):
    return None


class FusedMoE(torch.nn.Module):
    """The routed experts of one Kimi-K3 MoE layer, in the call shape engines use:
    ``forward(hidden_states [M, K] bfloat16, router_logits [M, E] float32) -> [M, K]``.

    Routing is the Kimi-K3 router (sigmoid + ``router_bias``, top-k, renormalized, scaled); the
    experts are this EP rank's (``problem.ep_size`` / ``ep_rank``; slots of other ranks contribute
    zero). The weights are prepacked once at construction. ``out=`` in ``forward`` writes into the
    caller's tensor (static buffers for graph capture); otherwise a new tensor is returned.
    ``device``: None (the CPU) or a CUDA device: the experts are uploaded there once and forward
    takes CUDA tensors on it (CUDA-graph capturable; never run on a GPU from Python, see docs/python.md).

    From a checkpoint: ``layer = k3.load_checkpoint_layer(dir, 1, ep_size, ep_rank)`` then
    ``FusedMoE(layer.problem(), **layer.weights, router_bias=layer.router_bias, **layer.routing())``.
    """

    def __init__(self, problem, fc1_q, fc1_scale, fc2_q, fc2_scale, router_bias=None, top_k=None, n_group=1,
                 topk_group=1, renormalize=True, routed_scaling_factor=1.0, max_tokens=8192, threads=None, isa="",
                 device=None):
        super().__init__()
        if top_k is not None and top_k != problem.top_k:
            raise ValueError(f"top_k = {top_k} differs from the problem's top_k = {problem.top_k}")
        self.problem = problem
        self.handle = prepare_moe(problem, fc1_q, fc1_scale, fc2_q, fc2_scale, max_tokens, threads, isa, device)
        bias = torch.empty(0, dtype=torch.float32) if router_bias is None else torch.as_tensor(router_bias)
        dev = _layer(self.handle).device if device is not None and torch.device(device).type == "cuda" else "cpu"
        self.register_buffer("router_bias", bias.to(device=dev, dtype=torch.float32).contiguous(), persistent=False)
        self.route_args = (problem.top_k, n_group, topk_group, renormalize, float(routed_scaling_factor))
        self.num_experts = int(problem.native.num_experts)  # a plain int: torch.compile traces forward
        self.out_dtype = _DTYPES[problem.out_dtype_name]

    def __del__(self):
        release_moe(getattr(self, "handle", None))

    def forward(self, hidden_states, router_logits, out=None):
        # The caller's arguments are checked here, by their names, before the ops see them (whose
        # own checks name the op's tensors: x, ids, bias).
        k = self.problem.hidden
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2 or hidden_states.shape[1] != k:
            raise ValueError(f"hidden_states has shape {tuple(getattr(hidden_states, 'shape', ()))}, expected "
                             f"[M, {k}] (flatten batch and sequence first: hidden_states.view(-1, {k}))")
        if hidden_states.dtype != torch.bfloat16:
            raise ValueError(f"hidden_states has dtype {hidden_states.dtype}, expected torch.bfloat16 (the experts take "
                             "BF16 activations; convert with hidden_states.to(torch.bfloat16))")
        m = hidden_states.shape[0]
        e = self.num_experts
        if (not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2
                or tuple(router_logits.shape) != (m, e)):
            raise ValueError(f"router_logits has shape {tuple(getattr(router_logits, 'shape', ()))}, expected "
                             f"[M, E] = [{m}, {e}] (one row per row of hidden_states, one column per global expert)")
        if router_logits.dtype in (torch.bfloat16, torch.float16):
            router_logits = router_logits.float()  # exact: the router computes in FP32, as the Kimi router does
        elif router_logits.dtype != torch.float32:
            raise ValueError(f"router_logits has dtype {router_logits.dtype}, expected float32, bfloat16 or float16")
        top_k = self.route_args[0]
        ids = torch.empty((m, top_k), dtype=torch.int32, device=hidden_states.device)
        wts = torch.empty((m, top_k), dtype=torch.float32, device=hidden_states.device)
        torch.ops.k3.route(router_logits, self.router_bias, *self.route_args, ids, wts)
        if out is None:
            out = torch.empty((m, self.problem.hidden), dtype=self.out_dtype, device=hidden_states.device)
        torch.ops.k3.moe_run(self.handle, hidden_states, ids, wts, out)
        return out


class Linear(torch.nn.Module):
    """A dense layer on k3: ``forward(x [..., K] bfloat16) -> [..., N]`` in ``out_dtype``, with the
    weight stored as MXFP8 (8.5 bits per weight, half of BF16) or as BF16, and the bias in FP32.

    ``Linear.from_linear(torch_linear)`` quantizes an ``nn.Linear``'s weight once with k3's codec
    (E4M3 + E8M0 per 32 along K, RCEIL). ``recipe``: "w8a16" (BF16 activations) or "w8a8"
    (activations quantized per row to MXFP8), or "w16a16": the weight's BF16 values, unquantized
    (FP32 FMA kernels on every level; the products are exact, the sums in the contract's order)."""

    def __init__(self, codes, scales, bias=None, recipe="w8a16", out_dtype="bf16", max_tokens=4096, threads=None,
                 isa=""):
        super().__init__()
        self.handle = prepare_linear(codes, scales, bias, recipe, out_dtype, max_tokens, threads, isa)
        lay = _linear_layer(self.handle)
        self.in_features, self.out_features, self.recipe = lay.k, lay.n, recipe
        self.out_dtype = _DTYPES[out_dtype]

    @classmethod
    def from_linear(cls, linear, recipe="w8a16", out_dtype="bf16", max_tokens=4096, threads=None, isa=""):
        if recipe == "w16a16":
            codes, scales = linear.weight.detach().to(torch.bfloat16).contiguous().view(torch.uint16), None
        else:
            w = linear.weight.detach().to(torch.float32).contiguous()
            codes, scales = _linear.quantize_weight(_np(w))
        bias = None if linear.bias is None else _np(linear.bias.detach().to(torch.float32).contiguous())
        return cls(codes, scales, bias, recipe, out_dtype, max_tokens, threads, isa)

    @property
    def plan(self):
        return _linear_layer(self.handle).plan

    def __del__(self):
        release_moe(getattr(self, "handle", None))

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, recipe={self.recipe}, k3"

    def forward(self, x, out=None):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"x must be a torch.Tensor [..., {self.in_features}], got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x has shape {tuple(x.shape)}, expected [..., {self.in_features}]")
        stock = getattr(self, "_k3_stock", None)  # k3.hf.patch(dense=..., keep_original=True): the stock module
        if _refuse_grad(x, "k3.torch.Linear", stock):
            _warn_grad_once(self)
            return stock(x)
        lead = x.shape[:-1]
        rows = x.numel() // self.in_features if self.in_features else 0
        # Checked before anything is allocated (an expanded x of a few bytes can stand for a huge
        # output; contiguous() and out would then fail in torch's allocator).
        if x.dtype != torch.bfloat16:
            raise ValueError(f"x has dtype {x.dtype}, expected torch.bfloat16 (the layer's activations are BF16)")
        if rows > MAX_TOKENS:
            raise ValueError(f"x has {rows} rows (the product of its leading dims); at most MAX_TOKENS = {MAX_TOKENS} "
                             "per call")
        x2 = x.reshape(-1, self.in_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if out is None:
            out = torch.empty((x2.shape[0], self.out_features), dtype=self.out_dtype, device=x.device)
        if torch.compiler.is_compiling():
            torch.ops.k3.linear(self.handle, x2, out)
        else:  # eager: the op's CPU kernel without the dispatcher (about 15 us less per call)
            _linear_cpu(self.handle, x2, out)
        return out.view(*lead, self.out_features)


def _warn_grad_once(mod):
    if not getattr(mod, "_k3_warned_grad", False):
        mod._k3_warned_grad = True
        import warnings
        warnings.warn(f"{type(mod).__name__}: an input requires grad and k3 has no backward, so this layer runs "
                      "its kept stock torch module", RuntimeWarning, stacklevel=3)


def __getattr__(name):
    """The fla-compatible entry points (k3.fla), imported on first use (k3.fla imports this module)."""
    if name in ("chunk_kda", "fused_recurrent_kda"):
        from . import fla
        return getattr(fla, name)
    raise AttributeError(f"module 'k3.torch' has no attribute '{name}'")


__all__ += ["chunk_kda", "fused_recurrent_kda", "kda_threads", "kda_options"]
