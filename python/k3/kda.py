"""Kimi Delta Attention: prefill (chunked on the CPU backend, variable lengths via cu_seqlens),
decode on a state pool and speculative verify.

q, k: [T, H, K]; v: [T, H, V] (float32, or BF16 bit patterns as uint16 — all three alike);
g: [T, H, K] float32 (log decay, or the gate input for the "safe" / "softplus" gates);
beta: [T, H] float32 (logits when beta_logits); a_log: [H]; dt_bias: [H, K]; cu_seqlens: [N + 1]
int64; initial_state: [N, H, K, V] ("k_first") or [N, H, V, K] ("v_first") float32.
Returns (o [T, H, V] float32, final_state or None)."""

import numpy as np

from . import _k3
from ._arrays import (DevicePlan, bf16_bits, host_view, need, need_cuda, no_overlap, out_or_new, seqlens_arg,
                      shape_of, stream_int, threads_arg)


def prefill(q, k, v, g, beta, a_log=None, dt_bias=None, cu_seqlens=None, initial_state=None, gate="safe",
            gate_lower_bound=-5.0, beta_logits=True, l2norm_qk=True, scale=0.0, layout="k_first", backend=None,
            threads=0, isa="", o=None, final_state=None, return_final_state=False):
    q, k, v, g, beta = _host_qkv(q, k, v, g, beta)
    t, h, hk = shape_of("q", q, 3, "[T, H, K]")
    hv = shape_of("v", v, 3, "[T, H, V]")[-1]
    dtype = np.uint16 if str(q.dtype).endswith("uint16") else np.float32
    need("q", q, (t, h, hk), dtype)
    need("k", k, (t, h, hk), dtype)
    need("v", v, (t, h, hv), dtype)
    need("g", g, (t, h, hk), np.float32)
    need("beta", beta, (t, h), np.float32)
    a_log, dt_bias = _gate_args(a_log, dt_bias)
    cu_seqlens = seqlens_arg("cu_seqlens", cu_seqlens, t)
    cfg = _k3.kda_config(h, hk, hv, gate, gate_lower_bound, beta_logits, l2norm_qk, scale, layout)
    n = 1 if cu_seqlens is None else int(cu_seqlens.shape[0]) - 1
    o = out_or_new("o", host_view(o), (t, h, hv), np.float32)
    state_shape = cfg.state_shape(n)
    if initial_state is not None:
        initial_state = need("initial_state", host_view(initial_state), state_shape, np.float32)
    given = final_state
    if final_state is None and return_final_state:
        final_state = np.empty(state_shape, dtype=np.float32)
    elif final_state is not None:
        # checked, never converted: a float64 or strided final_state would be written in a copy
        final_state = out_or_new("final_state", host_view(final_state), state_shape, np.float32)
    ins = (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("a_log", a_log), ("dt_bias", dt_bias),
           ("initial_state", initial_state))
    no_overlap("o", o, ins)
    if final_state is not None:
        no_overlap("final_state", final_state, ins[:7] + (("o", o),))
    _k3.kda_prefill(cfg, q, k, v, g, beta, a_log, dt_bias, cu_seqlens, initial_state, backend or "",
                    threads_arg(threads), isa, o, final_state)
    return o, (final_state if given is None else given)


def _host_qkv(q, k, v, g, beta):
    """Host views of the token inputs; torch bfloat16 q / k / v as their uint16 bits (float16 is
    refused by name)."""
    q, k, v = (bf16_bits(name, host_view(a)) for name, a in (("q", q), ("k", k), ("v", v)))
    return q, k, v, host_view(g), host_view(beta)


def _gate_args(a_log, dt_bias):
    if a_log is not None:
        a_log = need("a_log", host_view(a_log), dtype=np.float32)
    if dt_bias is not None:
        dt_bias = need("dt_bias", host_view(dt_bias), dtype=np.float32)
    return a_log, dt_bias


def _step_checks(q, k, v, g, beta, rows):
    if not hasattr(q, "shape"):
        raise ValueError(f"q must be an array (numpy, torch, ...), got {type(q).__name__}")
    if len(q.shape) != 3 or q.shape[0] != rows:
        raise ValueError(f"q must be [{rows}, H, K], got shape {tuple(q.shape)}")
    _, h, hk = q.shape
    hv = shape_of("v", v, 3, f"[{rows}, H, V]")[-1]
    dtype = np.uint16 if str(q.dtype).endswith("uint16") else np.float32
    need("q", q, (rows, h, hk), dtype)
    need("k", k, (rows, h, hk), dtype)
    need("v", v, (rows, h, hv), dtype)
    need("g", g, (rows, h, hk), np.float32)
    need("beta", beta, (rows, h), np.float32)
    return h, hk, hv


def decode(q, k, v, g, beta, state_pool, state_indices, a_log=None, dt_bias=None, gate="safe", gate_lower_bound=-5.0,
           beta_logits=True, l2norm_qk=True, scale=0.0, layout="k_first", backend=None, threads=0, isa="", o=None):
    """One token per sequence: q, k, v, g, beta of N tokens; the state of sequence n is
    ``state_pool[state_indices[n]]`` (float32 [slots, H, K, V] or [slots, H, V, K]), read and
    updated in place; ``state_indices`` int32 [N], distinct, < 0 for padding rows (skipped, o = 0).
    Returns o [N, H, V] float32."""
    q, k, v, g, beta = _host_qkv(q, k, v, g, beta)
    state_indices, state_pool = host_view(state_indices), host_view(state_pool)
    if len(getattr(state_indices, "shape", ())) != 1:
        raise ValueError(f"state_indices must be [N] int32, got shape {tuple(getattr(state_indices, 'shape', ()))}")
    n = int(state_indices.shape[0])
    h, hk, hv = _step_checks(q, k, v, g, beta, n)
    need("state_indices", state_indices, (n,), np.int32)
    need("state_pool", state_pool, dtype=np.float32, writable=True)
    a_log, dt_bias = _gate_args(a_log, dt_bias)
    cfg = _k3.kda_config(h, hk, hv, gate, gate_lower_bound, beta_logits, l2norm_qk, scale, layout)
    given = o
    o = out_or_new("o", host_view(o), (n, h, hv), np.float32)
    ins = (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("a_log", a_log), ("dt_bias", dt_bias),
           ("state_indices", state_indices))
    no_overlap("o", o, ins + (("state_pool", state_pool),))
    no_overlap("state_pool", state_pool, ins)
    _k3.kda_decode(cfg, q, k, v, g, beta, a_log, dt_bias, state_pool, state_indices, backend or "",
                   threads_arg(threads), isa, o)
    return o if given is None else given


def verify(q, k, v, g, beta, state_pool, state_indices, num_accepted, a_log=None, dt_bias=None, gate="safe",
           gate_lower_bound=-5.0, beta_logits=True, l2norm_qk=True, scale=0.0, layout="k_first", backend=None,
           threads=0, isa="", o=None):
    """Speculative verify: T draft tokens for each of N sequences (tokens [n T, (n + 1) T) are
    sequence n's). ``state_indices`` int32 [N, T]; ``num_accepted`` int32 [N] in [1, T]: the state
    read is ``state_pool[state_indices[n, num_accepted[n] - 1]]``, and the state after draft token t
    is written to ``state_pool[state_indices[n, t]]`` (< 0: not stored). Returns o [N T, H, V]."""
    q, k, v, g, beta = _host_qkv(q, k, v, g, beta)
    state_indices, state_pool, num_accepted = host_view(state_indices), host_view(state_pool), host_view(num_accepted)
    if len(getattr(state_indices, "shape", ())) != 2:
        raise ValueError(f"state_indices must be [N, T] int32, got shape {tuple(getattr(state_indices, 'shape', ()))}")
    n, t = (int(d) for d in state_indices.shape)
    h, hk, hv = _step_checks(q, k, v, g, beta, n * t)
    need("state_indices", state_indices, (n, t), np.int32)
    need("num_accepted", num_accepted, (n,), np.int32)
    need("state_pool", state_pool, dtype=np.float32, writable=True)
    a_log, dt_bias = _gate_args(a_log, dt_bias)
    cfg = _k3.kda_config(h, hk, hv, gate, gate_lower_bound, beta_logits, l2norm_qk, scale, layout)
    given = o
    o = out_or_new("o", host_view(o), (n * t, h, hv), np.float32)
    ins = (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("a_log", a_log), ("dt_bias", dt_bias),
           ("state_indices", state_indices), ("num_accepted", num_accepted))
    no_overlap("o", o, ins + (("state_pool", state_pool),))
    no_overlap("state_pool", state_pool, ins)
    _k3.kda_verify(cfg, q, k, v, g, beta, a_log, dt_bias, t, state_pool, state_indices, num_accepted, backend or "",
                   threads_arg(threads), isa, o)
    return o if given is None else given


def replay_window_floats(heads, head_k, head_v, window_tokens):
    """Floats per slot of a replay window pool (:func:`verify_replay` / :func:`commit`):
    ``window_tokens * heads * (2 head_k + head_v + 2) + 1``. Allocate the pool as
    ``np.zeros((slots, replay_window_floats(...)), np.float32)``, with as many slots as the state
    pool (zeros: no verified tokens pending)."""
    cfg = _k3.kda_config(int(heads), int(head_k), int(head_v), "log_decay", -5.0, True, True, 0.0, "k_first")
    return int(_k3.kda_replay_window_floats(cfg, int(window_tokens)))


def verify_replay(q, k, v, g, beta, state_pool, state_indices, window_pool, window_tokens, cu_seqlens=None,
                  a_log=None, dt_bias=None, gate="safe", gate_lower_bound=-5.0, beta_logits=True, l2norm_qk=True,
                  scale=0.0, layout="k_first", backend=None, threads=0, isa="", o=None):
    """Speculative verify without snapshots. Sequence n's draft tokens (``window_tokens`` each, or
    ``[cu_seqlens[n], cu_seqlens[n + 1])``, each at most ``window_tokens``) run from the state
    ``state_pool[state_indices[n]]``, which is only read (< 0: padding, o rows 0). Their update
    inputs are kept in ``window_pool[state_indices[n]]`` (float32 [slots, replay_window_floats(...)],
    as many slots as the state pool) for :func:`commit`. Returns o [tokens, H, V] float32."""
    q, k, v, g, beta = _host_qkv(q, k, v, g, beta)
    state_indices, state_pool, window_pool = host_view(state_indices), host_view(state_pool), host_view(window_pool)
    if len(getattr(state_indices, "shape", ())) != 1:
        raise ValueError(f"state_indices must be [N] int32, got shape {tuple(getattr(state_indices, 'shape', ()))}")
    if not hasattr(q, "shape") or len(q.shape) != 3:
        raise ValueError(f"q must be [tokens, H, K], got shape {tuple(getattr(q, 'shape', ()))}")
    rows = int(q.shape[0])
    h, hk, hv = _step_checks(q, k, v, g, beta, rows)
    n = int(state_indices.shape[0])
    need("state_indices", state_indices, (n,), np.int32)
    need("state_pool", state_pool, dtype=np.float32)
    need("window_pool", window_pool, dtype=np.float32, writable=True)
    if cu_seqlens is not None:
        cu_seqlens = need("cu_seqlens", host_view(cu_seqlens), (n + 1,), np.int64)
    a_log, dt_bias = _gate_args(a_log, dt_bias)
    cfg = _k3.kda_config(h, hk, hv, gate, gate_lower_bound, beta_logits, l2norm_qk, scale, layout)
    given = o
    o = out_or_new("o", host_view(o), (rows, h, hv), np.float32)
    ins = (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("a_log", a_log), ("dt_bias", dt_bias),
           ("state_indices", state_indices), ("cu_seqlens", cu_seqlens), ("state_pool", state_pool))
    no_overlap("o", o, ins + (("window_pool", window_pool),))
    no_overlap("window_pool", window_pool, ins)
    _k3.kda_verify_replay(cfg, q, k, v, g, beta, a_log, dt_bias, cu_seqlens, int(window_tokens), state_pool,
                          state_indices, window_pool, backend or "", threads_arg(threads), isa, o)
    return o if given is None else given


def commit(state_pool, window_pool, state_indices, num_accepted, window_tokens, heads, head_k, head_v,
           layout="k_first", backend=None, threads=0, isa=""):
    """Folds the first ``num_accepted[n]`` draft tokens kept by :func:`verify_replay` into
    ``state_pool[state_indices[n]]``, in place: bit-identical to :func:`decode` run token by token
    on those tokens. ``num_accepted`` int32 [N], each in [0, the tokens verified into that window]
    (0: the state is untouched); a slot named twice is refused. Each named window is consumed: a
    second commit before the next verify_replay is refused."""
    state_pool, window_pool = host_view(state_pool), host_view(window_pool)
    state_indices, num_accepted = host_view(state_indices), host_view(num_accepted)
    if len(getattr(state_indices, "shape", ())) != 1:
        raise ValueError(f"state_indices must be [N] int32, got shape {tuple(getattr(state_indices, 'shape', ()))}")
    n = int(state_indices.shape[0])
    need("state_indices", state_indices, (n,), np.int32)
    need("num_accepted", num_accepted, (n,), np.int32)
    need("state_pool", state_pool, dtype=np.float32, writable=True)
    need("window_pool", window_pool, dtype=np.float32, writable=True)
    no_overlap("state_pool", state_pool, (("window_pool", window_pool), ("state_indices", state_indices),
                                          ("num_accepted", num_accepted)))
    no_overlap("window_pool", window_pool, (("state_indices", state_indices), ("num_accepted", num_accepted)))
    cfg = _k3.kda_config(int(heads), int(head_k), int(head_v), "log_decay", -5.0, True, True, 0.0, layout)
    _k3.kda_commit(cfg, int(window_tokens), state_pool, window_pool, state_indices, num_accepted, backend or "",
                   threads_arg(threads), isa)


class CudaKda(DevicePlan):
    """The CUDA backend's serving form (this binding has never run on a GPU; the C++ backend ran on an H200).

    The plan is made once for one configuration and CUDA device; ``prefill`` / ``decode`` /
    ``verify`` take CUDA arrays (torch / CuPy, through DLPack, used in place), the outputs, a
    workspace of ``workspace_bytes`` (uint8, on the device; ``new_workspace()`` allocates one once)
    and a stream (an int cudaStream_t, a torch.cuda.Stream or a CuPy stream; 0 = the default
    stream). They only enqueue kernels: no allocation, no copy, no synchronization, so they can be
    captured in a CUDA graph. Arrays and dtypes are those of :func:`decode` / :func:`verify` /
    :func:`prefill`; the state pool may also be BF16 (bfloat16, or its bits as uint16).

    Values the host cannot see without a synchronization (state_indices, num_accepted, cu_seqlens,
    a_log) are checked on the device: an offending sequence is skipped (NaN outputs) and
    ``status(workspace)`` — which synchronizes the stream — raises naming the problem.

    ``caps``: plan for a device described by hand (keys of ``k3._k3.cuda_device_caps``) instead of
    reading ``device``: sizes the workspace without a GPU. Raises RuntimeError when the package
    was built without CUDA."""

    def __init__(self, heads, head_k, head_v, gate="safe", gate_lower_bound=-5.0, beta_logits=True, l2norm_qk=True,
                 scale=0.0, layout="k_first", max_seqs=1024, algorithm="auto", device=0, caps=None):
        self.device = int(device)
        self.layout = layout
        _k3.cuda_require()
        self._cfg = _k3.kda_config(heads, head_k, head_v, gate, gate_lower_bound, beta_logits, l2norm_qk, scale,
                                   layout)
        self._native = _k3.cuda_kda_plan(self._cfg, self.device, max_seqs, algorithm, caps)

    def _common(self, q, k, v, g, beta, a_log, dt_bias, rows):
        dev = self.device
        h, hk, hv = self._cfg.num_heads, self._cfg.head_k, self._cfg.head_v
        q = need_cuda("q", q, dev)
        if len(q.shape) != 3 or (rows is not None and q.shape[0] != rows):
            want = f"[{rows if rows is not None else 'T'}, {h}, {hk}]"
            raise ValueError(f"q has shape {tuple(q.shape)}, expected {want}")
        t = q.shape[0]
        dtype = np.uint16 if str(q.dtype).endswith("uint16") else np.float32
        q = need_cuda("q", q, dev, (t, h, hk), dtype)
        k = need_cuda("k", k, dev, (t, h, hk), dtype)
        v = need_cuda("v", v, dev, (t, h, hv), dtype)
        g = need_cuda("g", g, dev, (t, h, hk), np.float32)
        beta = need_cuda("beta", beta, dev, (t, h), np.float32)
        a_log = need_cuda("a_log", a_log, dev, dtype=np.float32)
        dt_bias = need_cuda("dt_bias", dt_bias, dev, dtype=np.float32)
        return t, q, k, v, g, beta, a_log, dt_bias

    def _pool(self, state_pool):
        pool = need_cuda("state_pool", state_pool, self.device)
        if str(pool.dtype).split(".")[-1] not in ("float32", "uint16"):
            raise ValueError(f"state_pool has dtype {state_pool.dtype}, expected float32 or BF16 (bfloat16 / uint16)")
        return pool

    def prefill(self, q, k, v, g, beta, o, workspace, stream=0, a_log=None, dt_bias=None, cu_seqlens=None,
                initial_state=None, final_state=None):
        """Writes o [T, H, V] float32 (and final_state [N, H, K, V] / [N, H, V, K] when given)."""
        t, q, k, v, g, beta, a_log, dt_bias = self._common(q, k, v, g, beta, a_log, dt_bias, None)
        h, hv = self._cfg.num_heads, self._cfg.head_v
        o = need_cuda("o", o, self.device, (t, h, hv), np.float32)
        cu_seqlens = need_cuda("cu_seqlens", cu_seqlens, self.device, dtype=np.int64)
        initial_state = need_cuda("initial_state", initial_state, self.device, dtype=np.float32)
        final_state = need_cuda("final_state", final_state, self.device, dtype=np.float32)
        self._native.prefill(q, k, v, g, beta, a_log, dt_bias, cu_seqlens, initial_state, o, final_state,
                             need_cuda("workspace", workspace, self.device, dtype=np.uint8), stream_int(stream))
        return o

    def decode(self, q, k, v, g, beta, state_pool, state_indices, o, workspace, stream=0, a_log=None, dt_bias=None):
        """One token per sequence; state_pool [slots, H, K, V] (or V, K) float32 or BF16, updated in
        place at ``state_indices`` (int32 [N], < 0 = padding row). Writes o [N, H, V] float32."""
        n = state_indices.shape[0] if hasattr(state_indices, "shape") and len(state_indices.shape) == 1 else None
        if n is None:
            raise ValueError(f"state_indices must be a 1-D int32 CUDA array [N], got {type(state_indices).__name__} "
                             f"of shape {tuple(getattr(state_indices, 'shape', ()))}")
        _, q, k, v, g, beta, a_log, dt_bias = self._common(q, k, v, g, beta, a_log, dt_bias, n)
        idx = need_cuda("state_indices", state_indices, self.device, (n,), np.int32)
        o = need_cuda("o", o, self.device, (n, self._cfg.num_heads, self._cfg.head_v), np.float32)
        self._native.decode(q, k, v, g, beta, a_log, dt_bias, self._pool(state_pool), idx, o,
                            need_cuda("workspace", workspace, self.device, dtype=np.uint8), stream_int(stream))
        return o

    def verify(self, q, k, v, g, beta, state_pool, state_indices, num_accepted, o, workspace, stream=0, a_log=None,
               dt_bias=None):
        """Speculative verify as :func:`verify` (state_indices int32 [N, T], num_accepted int32 [N]).
        Writes o [N T, H, V] float32."""
        shape = tuple(getattr(state_indices, "shape", ()))
        if len(shape) != 2:
            raise ValueError(f"state_indices must be [N, T] int32, got shape {shape}")
        n, t = shape
        _, q, k, v, g, beta, a_log, dt_bias = self._common(q, k, v, g, beta, a_log, dt_bias, n * t)
        idx = need_cuda("state_indices", state_indices, self.device, (n, t), np.int32)
        acc = need_cuda("num_accepted", num_accepted, self.device, (n,), np.int32)
        o = need_cuda("o", o, self.device, (n * t, self._cfg.num_heads, self._cfg.head_v), np.float32)
        self._native.verify(q, k, v, g, beta, a_log, dt_bias, t, self._pool(state_pool), idx, acc, o,
                            need_cuda("workspace", workspace, self.device, dtype=np.uint8), stream_int(stream))
        return o

    def status(self, workspace, stream=0):
        """Synchronizes the stream (not inside a graph capture) and raises when the last call on
        ``workspace`` found a bad value on the device (bad cu_seqlens, slot out of range, duplicate
        slot, num_accepted out of range, a_log out of range)."""
        self._native.status(need_cuda("workspace", workspace, self.device, dtype=np.uint8), stream_int(stream))


MAX_CONV_WIDTH = 8  # the conv op's limits (k3/kda_ops.hpp)
MAX_CONV_STATE_LEN = 64


def causal_conv1d(x, weight, conv_state=None, bias=None, cu_seqlens=None, silu=True, y=None, threads=0):
    """The KDA layer's short convolution (depthwise, causal, width W) with SiLU, on the CPU:
    ``y[t, c] = silu(bias[c] + sum_i weight[c, i] * x[t - W + 1 + i, c])`` within each sequence of
    ``cu_seqlens`` (int64 [N + 1], or a list of ints; None: one sequence).

    ``conv_state`` [N, D, S] (S >= W - 1; None: zeros) holds each sequence's inputs before its
    first token (the newest last) and is updated in place to its last S inputs, so decode is the
    same call with one token per sequence. transformers' cache keeps S = W, fla's S = W - 1.

    Storage: x [T, D], weight [D, W], conv_state and y all float32, or all BF16 (torch.bfloat16
    tensors or uint16 bit patterns); bias float32 [D]. Arithmetic is FP32; a BF16 y is rounded once.
    Returns y [T, D] (written into ``y`` when given)."""
    bf16 = str(getattr(x, "dtype", "")) in ("torch.bfloat16", "uint16", "torch.uint16")
    dt = np.uint16 if bf16 else np.float32
    conv = bf16_bits if bf16 else (lambda name, a: a)
    x = need("x", conv("x", host_view(x)), dtype=dt)
    if len(x.shape) != 2:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected [T, D]")
    t, d = (int(v) for v in x.shape)
    weight = need("weight", conv("weight", host_view(weight)), dtype=dt)
    if len(weight.shape) != 2 or int(weight.shape[0]) != d:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected [D, W] = [{d}, W]")
    w = int(weight.shape[1])
    cu_seqlens = seqlens_arg("cu_seqlens", cu_seqlens, t)
    n = 1 if cu_seqlens is None else int(cu_seqlens.shape[0]) - 1
    state_len = 0
    if conv_state is not None:
        conv_state = need("conv_state", conv("conv_state", host_view(conv_state)), dtype=dt, writable=True)
        if len(conv_state.shape) != 3 or tuple(int(v) for v in conv_state.shape[:2]) != (n, d):
            raise ValueError(f"conv_state has shape {tuple(conv_state.shape)}, expected [N, D, S] = [{n}, {d}, S]")
        state_len = int(conv_state.shape[2])
    if bias is not None:
        bias = need("bias", host_view(bias), (d,), np.float32)
    given = y
    if y is not None:
        y = conv("y", host_view(y))
    y = out_or_new("y", y, (t, d), dt)
    no_overlap("y", y, (("x", x), ("weight", weight), ("bias", bias), ("cu_seqlens", cu_seqlens),
                        ("conv_state", conv_state)))
    if conv_state is not None:
        no_overlap("conv_state", conv_state, (("x", x), ("weight", weight), ("bias", bias)))
    fn = _k3.kda_conv_bf16 if bf16 else _k3.kda_conv_f32
    fn(d, w, bool(silu), x, weight, bias, cu_seqlens, conv_state, y, state_len, threads_arg(threads))
    return y if given is None else given
