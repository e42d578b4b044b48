"""Kimi Delta Attention: prefill (chunked on the CPU backend, variable lengths via cu_seqlens),
decode on a state pool and speculative verify.

q, k: [T, H, K]; v: [T, H, V] (float32, or BF16 bit patterns as uint16 — all three alike);
g: [T, H, K] float32 (log decay, or the gate input for the "safe" / "softplus" gates);
beta: [T, H] float32 (logits when beta_logits); a_log: [H]; dt_bias: [H, K]; cu_seqlens: [N + 1]
int64; initial_state: [N, H, K, V] ("k_first") or [N, H, V, K] ("v_first") float32.
Returns (o [T, H, V] float32, final_state or None)."""

import numpy as np

from . import _k3
from ._arrays import need, out_or_new


def prefill(q, k, v, g, beta, a_log=None, dt_bias=None, cu_seqlens=None, initial_state=None, gate="safe",
            gate_lower_bound=-5.0, beta_logits=True, l2norm_qk=True, scale=0.0, layout="k_first", backend=None,
            threads=0, isa="", o=None, final_state=None, return_final_state=False):
    if len(q.shape) != 3:
        raise ValueError(f"q must be 3-D [T, H, K], got shape {tuple(q.shape)}")
    t, h, hk = q.shape
    hv = v.shape[-1]
    dtype = np.uint16 if str(q.dtype).endswith("uint16") else np.float32
    need("q", q, (t, h, hk), dtype)
    need("k", k, (t, h, hk), dtype)
    need("v", v, (t, h, hv), dtype)
    need("g", g, (t, h, hk), np.float32)
    need("beta", beta, (t, h), np.float32)
    cfg = _k3.kda_config(h, hk, hv, gate, gate_lower_bound, beta_logits, l2norm_qk, scale, layout)
    n = 1 if cu_seqlens is None else len(cu_seqlens) - 1
    o = out_or_new("o", o, (t, h, hv), np.float32)
    state_shape = (n, h, hk, hv) if layout == "k_first" else (n, h, hv, hk)
    if final_state is None and return_final_state:
        final_state = np.empty(state_shape, dtype=np.float32)
    _k3.kda_prefill(cfg, q, k, v, g, beta, a_log, dt_bias, cu_seqlens, initial_state, backend or "", threads, isa,
                    o, final_state)
    return o, final_state


def _step_checks(q, k, v, g, beta, rows):
    if len(q.shape) != 3 or q.shape[0] != rows:
        raise ValueError(f"q must be [{rows}, H, K], got shape {tuple(q.shape)}")
    _, h, hk = q.shape
    hv = v.shape[-1]
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
    n = state_indices.shape[0]
    h, hk, hv = _step_checks(q, k, v, g, beta, n)
    need("state_indices", state_indices, (n,), np.int32)
    need("state_pool", state_pool, dtype=np.float32)
    cfg = _k3.kda_config(h, hk, hv, gate, gate_lower_bound, beta_logits, l2norm_qk, scale, layout)
    o = out_or_new("o", o, (n, h, hv), np.float32)
    _k3.kda_decode(cfg, q, k, v, g, beta, a_log, dt_bias, state_pool, state_indices, backend or "", threads, isa, o)
    return o


def verify(q, k, v, g, beta, state_pool, state_indices, num_accepted, a_log=None, dt_bias=None, gate="safe",
           gate_lower_bound=-5.0, beta_logits=True, l2norm_qk=True, scale=0.0, layout="k_first", backend=None,
           threads=0, isa="", o=None):
    """Speculative verify: T draft tokens for each of N sequences (tokens [n T, (n + 1) T) are
    sequence n's). ``state_indices`` int32 [N, T]; ``num_accepted`` int32 [N] in [1, T]: the state
    read is ``state_pool[state_indices[n, num_accepted[n] - 1]]``, and the state after draft token t
    is written to ``state_pool[state_indices[n, t]]`` (< 0: not stored). Returns o [N T, H, V]."""
    if len(state_indices.shape) != 2:
        raise ValueError(f"state_indices must be [N, T] int32, got shape {tuple(state_indices.shape)}")
    n, t = state_indices.shape
    h, hk, hv = _step_checks(q, k, v, g, beta, n * t)
    need("state_indices", state_indices, (n, t), np.int32)
    need("num_accepted", num_accepted, (n,), np.int32)
    need("state_pool", state_pool, dtype=np.float32)
    cfg = _k3.kda_config(h, hk, hv, gate, gate_lower_bound, beta_logits, l2norm_qk, scale, layout)
    o = out_or_new("o", o, (n * t, h, hv), np.float32)
    _k3.kda_verify(cfg, q, k, v, g, beta, a_log, dt_bias, t, state_pool, state_indices, num_accepted, backend or "",
                   threads, isa, o)
    return o
