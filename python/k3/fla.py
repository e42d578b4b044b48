"""fla-compatible KDA entry points on k3's CPU backend: ``chunk_kda`` and ``fused_recurrent_kda``.

They take the arguments of ``fla.ops.kda.chunk_kda`` / ``fused_recurrent_kda`` as released in
fla-core 0.6.0 (time-first tensors ``[B, T, H, K]``, states ``[N, H, K, V]`` FP32), so a CPU port
of an fla, vLLM or SGLang layer calls k3 by changing the import. Every keyword of fla's
signatures is accepted by name: what k3 computes is honoured, what it cannot is refused with a
``ValueError`` naming the argument (never silently ignored):

============================  ==============================================================
honoured                      ``scale``, ``initial_state``, ``output_final_state``,
                              ``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel`` with
                              ``A_log`` [H] / ``dt_bias`` [H*K] (softplus gate),
                              ``lower_bound`` (+ ``safe_gate``: the bounded sigmoid gate),
                              ``use_beta_sigmoid_in_kernel``, ``cu_seqlens`` (B = 1),
                              ``state_v_first``, ``ssm_state_indices`` /
                              ``num_accepted_tokens`` (decode and speculative verify on a
                              state pool, in place), ``out``; k3's ``replay_window``
                              (speculative verify without snapshots)
no effect on the result       ``chunk_size``, ``disable_recompute``, ``cu_seqlens_cpu``,
                              ``use_graph``, ``max_num_seqs``, ``inplace_final_state=True``
refused                       ``allow_neg_eigval=True``, ``return_intermediate_states=True``,
                              ``cp_context``, grouped value heads (HV != H), head-wise beta
                              ``[B, T, HV, V]``, tensors that require grad (k3 has no
                              backward), tensors not on the CPU, any other keyword
============================  ==============================================================

q, k, v may be float32, bfloat16 (read in place as bit patterns) or float16 (widened exactly to
float32 first). g and beta are computed in float32. The output has v's dtype; the final state
is float32. Threads: torch's thread count (``torch.get_num_threads()``) unless ``threads=`` is
given; ``isa=`` forces a lower SIMD level of k3's kernels ("avx2", ...).
"""

import torch

from . import torch as _k3torch  # noqa: F401  (registers torch.ops.k3.*)
from . import _k3

__all__ = ["chunk_kda", "fused_recurrent_kda"]

_IGNORED = {"chunk_size", "disable_recompute", "cu_seqlens_cpu", "use_graph", "max_num_seqs"}
_EMPTY_F32 = torch.empty(0, dtype=torch.float32)
_EMPTY_I64 = torch.empty(0, dtype=torch.int64)


def _refuse_kwargs(fn, kwargs):
    for name in kwargs:
        if name not in _IGNORED:
            raise ValueError(f"k3.fla.{fn}: argument '{name}' is not supported by k3 (k3 refuses arguments it "
                             "cannot honour instead of ignoring them)")


def _check_tensor(fn, name, t):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"k3.fla.{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"k3.fla.{fn}: {name} is on {t.device}; k3's KDA entry points run on CPU tensors")
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"k3.fla.{fn}: {name} requires grad, but k3's KDA has no backward "
                         "(call it under torch.no_grad() / torch.inference_mode())")


_I32 = (-(1 << 31), (1 << 31) - 1)


def _int32(fn, name, t):
    """An int32 / int64 index or count tensor as contiguous int32, its values checked on the
    caller's dtype first: an int64 value past int32 would wrap to another slot (or count), and a
    float or bool tensor would be truncated."""
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"k3.fla.{fn}: {name} must be an int32 or int64 tensor, got {t.dtype}")
    if t.dtype == torch.int64 and t.numel() > 0:
        lo, hi = int(t.min()), int(t.max())
        if lo < _I32[0] or hi > _I32[1]:
            bad = lo if lo < _I32[0] else hi
            raise ValueError(f"k3.fla.{fn}: {name} holds {bad}, outside the int32 range [{_I32[0]}, {_I32[1]}] "
                             "k3 indexes with")
    return t.to(torch.int32).contiguous()


def _act(fn, q, k, v):
    """q, k, v as one dtype k3 reads: bfloat16 (in place) or float32 (float16 widened exactly)."""
    dts = {q.dtype, k.dtype, v.dtype}
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"k3.fla.{fn}: {name} has dtype {t.dtype}, expected float32, bfloat16 or float16")
    if dts == {torch.bfloat16}:
        return [t.contiguous() for t in (q, k, v)]
    return [t.to(torch.float32).contiguous() for t in (q, k, v)]


def _gate(fn, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate, h, hk):
    """(gate mode, lower bound, a_log tensor, dt_bias tensor) in k3's terms."""
    if not use_gate_in_kernel:
        # fla: lower_bound / A_log / dt_bias are only read with use_gate_in_kernel; g is the log decay.
        return "log_decay", -5.0, _EMPTY_F32, _EMPTY_F32
    if lower_bound is None and safe_gate:
        raise ValueError(f"k3.fla.{fn}: safe_gate = True with use_gate_in_kernel needs lower_bound (fla's rule)")
    if lower_bound is None and A_log is None:
        raise ValueError(f"k3.fla.{fn}: use_gate_in_kernel = True needs A_log [H] (or lower_bound)")
    if A_log is None:  # fla: lower_bound * sigmoid(g + dt_bias), i.e. exp(A_log) = 1
        a = torch.zeros(h, dtype=torch.float32)
    else:
        _check_tensor(fn, "A_log", A_log)
        a = A_log.detach().reshape(-1).to(torch.float32).contiguous()
        if a.numel() < h:
            raise ValueError(f"k3.fla.{fn}: A_log has {a.numel()} elements, expected at least H = {h}")
    if dt_bias is None:
        b = _EMPTY_F32
    else:
        _check_tensor(fn, "dt_bias", dt_bias)
        b = dt_bias.detach().reshape(-1).to(torch.float32).contiguous()
        if b.numel() != h * hk:
            raise ValueError(f"k3.fla.{fn}: dt_bias has {b.numel()} elements, expected H * K = {h * hk}")
        b = b.view(h, hk)
    if lower_bound is None:
        return "softplus", -5.0, a, b
    lb = float(lower_bound)
    if not lb < 0.0:
        raise ValueError(f"k3.fla.{fn}: lower_bound = {lower_bound} must be negative (a log decay bound)")
    return "safe", lb, a, b


def _common(fn, q, k, v, g, beta, scale, allow_neg_eigval, state_v_first):
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_tensor(fn, name, t)
    if allow_neg_eigval:
        raise ValueError(f"k3.fla.{fn}: allow_neg_eigval = True (beta in [0, 2)) is not supported by k3")
    if q.dim() != 4:
        raise ValueError(f"k3.fla.{fn}: q must be [B, T, H, K], got shape {tuple(q.shape)}")
    b, t, h, hk = q.shape
    if tuple(k.shape) != (b, t, h, hk):
        raise ValueError(f"k3.fla.{fn}: k has shape {tuple(k.shape)}, expected {(b, t, h, hk)} (q's)")
    if v.dim() != 4 or tuple(v.shape[:2]) != (b, t):
        raise ValueError(f"k3.fla.{fn}: v has shape {tuple(v.shape)}, expected [{b}, {t}, H, V]")
    if v.shape[2] != h:
        raise ValueError(f"k3.fla.{fn}: v has {v.shape[2]} heads and q {h}: grouped value heads (HV != H) are "
                         "not supported by k3")
    hv = v.shape[3]
    if tuple(g.shape) != (b, t, h, hk):
        raise ValueError(f"k3.fla.{fn}: g has shape {tuple(g.shape)}, expected {(b, t, h, hk)}")
    if beta.dim() == 4:
        raise ValueError(f"k3.fla.{fn}: head-wise beta [B, T, H, V] is not supported by k3 (beta must be [B, T, H])")
    if tuple(beta.shape) != (b, t, h):
        raise ValueError(f"k3.fla.{fn}: beta has shape {tuple(beta.shape)}, expected {(b, t, h)}")
    if scale is None:
        sc = 0.0  # k3: K^-0.5
    else:
        sc = float(scale)
        if not sc > 0.0:
            raise ValueError(f"k3.fla.{fn}: scale = {scale} must be positive (or None for K^-0.5)")
    layout = "v_first" if state_v_first else "k_first"
    return b, t, h, hk, hv, sc, layout


def _state_shape(layout, n, h, hk, hv):
    """The library's state shape for the layout (k3::kda::state_shape)."""
    return _k3.kda_config(h, hk, hv, "log_decay", -5.0, True, True, 0.0, layout).state_shape(n)


def _cu(fn, cu_seqlens, b, t):
    """cu_seqlens as a contiguous int64 tensor (fla: varlen needs B = 1), or the B equal sequences."""
    if cu_seqlens is None:
        return torch.arange(0, (b + 1) * t, t, dtype=torch.int64) if b > 1 else _EMPTY_I64, b
    _check_tensor(fn, "cu_seqlens", cu_seqlens)
    if b != 1:
        raise ValueError(f"k3.fla.{fn}: cu_seqlens needs B = 1 (sequences packed along T), got B = {b}")
    if cu_seqlens.dtype not in (torch.int64, torch.int32) or cu_seqlens.dim() != 1:
        raise ValueError(f"k3.fla.{fn}: cu_seqlens must be a 1-D int64 (or int32) tensor, got {cu_seqlens.dtype} "
                         f"of shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"k3.fla.{fn}: cu_seqlens has {cu_seqlens.numel()} entries, expected at least 2 ([0, ..., T])")
    return cu_seqlens.to(torch.int64).contiguous(), cu_seqlens.numel() - 1


def _initial(fn, initial_state, shape):
    if initial_state is None:
        return _EMPTY_F32
    _check_tensor(fn, "initial_state", initial_state)
    if initial_state.dtype != torch.float32:
        raise ValueError(f"k3.fla.{fn}: initial_state has dtype {initial_state.dtype}, expected float32 (fla's rule)")
    if tuple(initial_state.shape) != shape:
        raise ValueError(f"k3.fla.{fn}: initial_state has shape {tuple(initial_state.shape)}, expected {shape}")
    return initial_state.contiguous()


def _out(fn, out, v, shape):
    if out is None:
        return None
    _check_tensor(fn, "out", out)
    if tuple(out.shape) != tuple(shape) or out.dtype != v.dtype:
        raise ValueError(f"k3.fla.{fn}: out has shape {tuple(out.shape)} and dtype {out.dtype}, expected "
                         f"{tuple(shape)} and {v.dtype} (v's)")
    return out


def _prefill(fn, q, k, v, g, beta, b, t, h, hk, hv, sc, layout, cu_seqlens, initial_state, output_final_state,
             l2norm, beta_logits, gate, threads, isa, out):
    cu, n = _cu(fn, cu_seqlens, b, t)
    shape = _state_shape(layout, n, h, hk, hv)
    init = _initial(fn, initial_state, shape)
    out = _out(fn, out, v, (b, t, h, hv))
    qa, ka, va = _act(fn, q, k, v)
    rows = b * t
    mode, lb, a_log, dt_bias = gate
    o = torch.empty((rows, h, hv), dtype=torch.float32)
    final = torch.empty(shape, dtype=torch.float32) if output_final_state else _EMPTY_F32
    with _k3torch.kda_options(threads, isa):
        torch.ops.k3.kda_prefill(qa.view(rows, h, hk), ka.view(rows, h, hk), va.view(rows, h, hv),
                                 g.detach().to(torch.float32).reshape(rows, h, hk).contiguous(),
                                 beta.detach().to(torch.float32).reshape(rows, h).contiguous(), a_log, dt_bias, cu,
                                 init, mode, lb, beta_logits, l2norm, sc, layout, o, final)
    return _finish(o, out, v, b, t, h, hv), (final if output_final_state else None)


def _replay(fn, q, k, v, g, beta, b, t, h, hk, hv, sc, layout, cu_seqlens, pool, indices, num_accepted, window,
            l2norm, beta_logits, gate, threads, isa, out):
    """fused_recurrent_kda with replay_window: commit the previous drafts' accepted prefix, then
    verify this call's drafts without writing the pool."""
    if indices.dim() != 1:
        raise ValueError(f"k3.fla.{fn}: with replay_window, ssm_state_indices must be [N] (one slot per sequence), "
                         f"got shape {tuple(indices.shape)}")
    _check_tensor(fn, "replay_window", window)
    slots, n = pool.shape[0], indices.shape[0]
    row = 2 * hk + hv + 2
    if (window.dtype != torch.float32 or window.dim() != 2 or not window.is_contiguous() or window.shape[0] != slots
            or window.shape[1] < 1 or (window.shape[1] - 1) % (h * row) != 0):
        raise ValueError(f"k3.fla.{fn}: replay_window must be a contiguous float32 [slots = {slots}, "
                         f"Tw * H * (2K + V + 2) + 1 = Tw * {h * row} + 1] tensor (k3.kda.replay_window_floats), got "
                         f"{window.dtype} of shape {tuple(window.shape)}")
    tw = (window.shape[1] - 1) // (h * row)
    rows = b * t
    if cu_seqlens is not None:
        cu, seqs = _cu(fn, cu_seqlens, b, t)
    elif b == n:
        cu, seqs = torch.arange(0, (n + 1) * t, t, dtype=torch.int64), n
    else:
        raise ValueError(f"k3.fla.{fn}: ssm_state_indices names {n} sequences but q has B = {b} (without "
                         "cu_seqlens, one sequence per batch row)")
    if seqs != n:
        raise ValueError(f"k3.fla.{fn}: cu_seqlens holds {seqs} sequences, ssm_state_indices {n}")
    idx = _int32(fn, "ssm_state_indices", indices)
    out = _out(fn, out, v, (b, t, h, hv))
    mode, lb, a_log, dt_bias = gate
    with _k3torch.kda_options(threads, isa):
        if num_accepted is not None:
            _check_tensor(fn, "num_accepted_tokens", num_accepted)
            if tuple(num_accepted.shape) != (n,):
                raise ValueError(f"k3.fla.{fn}: num_accepted_tokens has shape {tuple(num_accepted.shape)}, "
                                 f"expected ({n},)")
            torch.ops.k3.kda_commit(pool, window, idx, _int32(fn, "num_accepted_tokens", num_accepted), tw, h, hk, hv,
                                    layout)
        qa, ka, va = _act(fn, q, k, v)
        o = torch.empty((rows, h, hv), dtype=torch.float32)
        torch.ops.k3.kda_verify_replay(qa.view(rows, h, hk), ka.view(rows, h, hk), va.view(rows, h, hv),
                                       g.detach().to(torch.float32).reshape(rows, h, hk).contiguous(),
                                       beta.detach().to(torch.float32).reshape(rows, h).contiguous(), a_log, dt_bias,
                                       cu, tw, pool, idx, window, mode, lb, beta_logits, l2norm, sc, layout, o)
    return _finish(o, out, v, b, t, h, hv), pool


def _finish(o, out, v, b, t, h, hv):
    """k3's float32 [B T, H, V] output as [B, T, H, V] in v's dtype, or copied into ``out``."""
    o = o.view(b, t, h, hv)
    if out is not None:
        out.copy_(o)
        return out
    return o if v.dtype == torch.float32 else o.to(v.dtype)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, return_intermediate_states=False,
              state_v_first=False, cu_seqlens=None, cp_context=None, A_log=None, dt_bias=None, threads=None,
              isa="", **kwargs):
    """fla's ``chunk_kda`` on k3's CPU backend (chunked prefill, variable lengths). Returns
    ``(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] float32 or None)``."""
    fn = "chunk_kda"
    _refuse_kwargs(fn, kwargs)
    if return_intermediate_states:
        raise ValueError(f"k3.fla.{fn}: return_intermediate_states = True is not supported by k3 (use "
                         "fused_recurrent_kda with ssm_state_indices to keep per-token states in a pool)")
    if cp_context is not None:
        raise ValueError(f"k3.fla.{fn}: cp_context (context parallelism) is not supported by k3")
    b, t, h, hk, hv, sc, layout = _common(fn, q, k, v, g, beta, scale, allow_neg_eigval, state_v_first)
    gate = _gate(fn, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate, h, hk)
    return _prefill(fn, q, k, v, g, beta, b, t, h, hk, hv, sc, layout, cu_seqlens, initial_state, output_final_state,
                    bool(use_qk_l2norm_in_kernel), bool(use_beta_sigmoid_in_kernel), gate, threads, isa, None)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        state_v_first=False, cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                        inplace_final_state=True, out=None, replay_window=None, threads=None, isa="", **kwargs):
    """fla's ``fused_recurrent_kda`` on k3's CPU backend.

    Without ``ssm_state_indices``: the recurrence over each sequence from ``initial_state``
    ([N, H, K, V]), as fla (k3 computes it with its prefill, same definition).

    With ``ssm_state_indices`` (continuous batching, as vLLM and SGLang call it), ``initial_state``
    is the state pool [slots, H, K, V] float32, updated in place:

    - ``[N]`` indices, one token per sequence: decode. Sequence n reads and writes slot
      ``ssm_state_indices[n]`` (< 0: a padding row, skipped, output 0).
    - ``[N, T]`` indices, T tokens per sequence: speculative verify. Sequence n starts from slot
      ``ssm_state_indices[n, num_accepted_tokens[n] - 1]`` (``num_accepted_tokens`` int32 [N] in
      [1, T]; absent: 1) and the state after its token t is written to slot
      ``ssm_state_indices[n, t]``.

    Tokens are ``[N, T, H, K]`` or packed ``[1, N T, H, K]`` with ``cu_seqlens`` of equal lengths.

    ``replay_window`` (a k3 extension: speculative verify without snapshots) is a float32
    ``[slots, F]`` tensor beside the pool, zeros at first, with
    ``F = k3.kda.replay_window_floats(H, K, V, Tw)`` for a window of Tw draft tokens. With it,
    ``ssm_state_indices`` is ``[N]`` (one slot per sequence) and the call first folds the first
    ``num_accepted_tokens[n]`` tokens of the previous call's drafts into slot n's state (absent:
    nothing is folded), bit-identical to decoding them one by one, then runs this call's draft
    tokens (``[N, T]``, or packed with ``cu_seqlens``, each at most Tw) from that state without
    writing it, keeping their inputs in the window. Pool memory per sequence: one state instead of T.
    Returns ``(o in v's dtype, the pool or None)``."""
    fn = "fused_recurrent_kda"
    _refuse_kwargs(fn, kwargs)
    b, t, h, hk, hv, sc, layout = _common(fn, q, k, v, g, beta, scale, allow_neg_eigval, state_v_first)
    gate = _gate(fn, use_gate_in_kernel, A_log, dt_bias, lower_bound, lower_bound is not None, h, hk)
    l2norm, beta_logits = bool(use_qk_l2norm_in_kernel), bool(use_beta_sigmoid_in_kernel)
    if ssm_state_indices is None:
        if num_accepted_tokens is not None:
            raise ValueError(f"k3.fla.{fn}: num_accepted_tokens needs ssm_state_indices (a state pool)")
        return _prefill(fn, q, k, v, g, beta, b, t, h, hk, hv, sc, layout, cu_seqlens, initial_state,
                        output_final_state, l2norm, beta_logits, gate, threads, isa, out)
    if not inplace_final_state:
        raise ValueError(f"k3.fla.{fn}: inplace_final_state = False with ssm_state_indices (per-token states in a "
                         "new tensor) is not supported by k3; the pool is updated in place")
    _check_tensor(fn, "ssm_state_indices", ssm_state_indices)
    if initial_state is None:
        raise ValueError(f"k3.fla.{fn}: ssm_state_indices needs initial_state (the state pool [slots, H, K, V])")
    _check_tensor(fn, "initial_state", initial_state)
    pool = initial_state
    if pool.dtype != torch.float32 or pool.dim() != 4 or not pool.is_contiguous():
        raise ValueError(f"k3.fla.{fn}: initial_state (the state pool) must be a contiguous float32 "
                         f"[slots, H, K, V] tensor (updated in place), got {pool.dtype} of shape {tuple(pool.shape)}")
    want = _state_shape(layout, pool.shape[0], h, hk, hv)
    if tuple(pool.shape) != want:
        raise ValueError(f"k3.fla.{fn}: initial_state (the state pool) has shape {tuple(pool.shape)}, expected "
                         f"{want}")
    if ssm_state_indices.dtype not in (torch.int32, torch.int64) or ssm_state_indices.dim() not in (1, 2):
        raise ValueError(f"k3.fla.{fn}: ssm_state_indices must be a 1-D [N] or 2-D [N, T] integer tensor, got "
                         f"{ssm_state_indices.dtype} of shape {tuple(ssm_state_indices.shape)}")
    if replay_window is not None:
        return _replay(fn, q, k, v, g, beta, b, t, h, hk, hv, sc, layout, cu_seqlens, pool, ssm_state_indices,
                       num_accepted_tokens, replay_window, l2norm, beta_logits, gate, threads, isa, out)
    rows = b * t
    if ssm_state_indices.dim() == 1:
        n, steps = ssm_state_indices.shape[0], 1
    else:
        n, steps = ssm_state_indices.shape
    if n * steps != rows:
        raise ValueError(f"k3.fla.{fn}: ssm_state_indices has shape {tuple(ssm_state_indices.shape)} ({n * steps} "
                         f"tokens) but q holds B * T = {rows} tokens")
    if cu_seqlens is not None:
        _check_tensor(fn, "cu_seqlens", cu_seqlens)
        expect = torch.arange(0, (n + 1) * steps, steps, dtype=torch.int64)
        if b != 1 or cu_seqlens.numel() != n + 1 or not torch.equal(cu_seqlens.to(torch.int64), expect):
            raise ValueError(f"k3.fla.{fn}: with ssm_state_indices, cu_seqlens must hold {n} sequences of "
                             f"{steps} tokens each (k3 runs equal-length decode / verify), got "
                             f"{cu_seqlens.tolist() if cu_seqlens.numel() <= 16 else tuple(cu_seqlens.shape)}")
    elif b != n:
        raise ValueError(f"k3.fla.{fn}: ssm_state_indices names {n} sequences but q has B = {b} (without "
                         "cu_seqlens, one sequence per batch row)")
    if output_final_state is False:
        pass  # the pool is the state either way (fla's in-place mode)
    out = _out(fn, out, v, (b, t, h, hv))
    qa, ka, va = _act(fn, q, k, v)
    mode, lb, a_log, dt_bias = gate
    cfg = (mode, lb, beta_logits, l2norm, sc, layout)
    idx = _int32(fn, "ssm_state_indices", ssm_state_indices)
    gg = g.detach().to(torch.float32).reshape(rows, h, hk).contiguous()
    bb = beta.detach().to(torch.float32).reshape(rows, h).contiguous()
    o = torch.empty((rows, h, hv), dtype=torch.float32)
    with _k3torch.kda_options(threads, isa):
        if ssm_state_indices.dim() == 1:
            if num_accepted_tokens is not None:
                raise ValueError(f"k3.fla.{fn}: num_accepted_tokens needs 2-D ssm_state_indices [N, T]")
            torch.ops.k3.kda_decode(qa.view(rows, h, hk), ka.view(rows, h, hk), va.view(rows, h, hv), gg, bb, a_log,
                                    dt_bias, pool, idx, *cfg, o)
        else:
            if num_accepted_tokens is None:
                acc = torch.ones(n, dtype=torch.int32)
            else:
                _check_tensor(fn, "num_accepted_tokens", num_accepted_tokens)
                if tuple(num_accepted_tokens.shape) != (n,):
                    raise ValueError(f"k3.fla.{fn}: num_accepted_tokens has shape "
                                     f"{tuple(num_accepted_tokens.shape)}, expected ({n},)")
                acc = _int32(fn, "num_accepted_tokens", num_accepted_tokens)
            torch.ops.k3.kda_verify(qa.view(rows, h, hk), ka.view(rows, h, hk), va.view(rows, h, hv), gg, bb, a_log,
                                    dt_bias, pool, idx, acc, *cfg, o)
    return _finish(o, out, v, b, t, h, hv), pool
