"""The Kimi-K3 router: sigmoid scores + correction bias, grouped top-k, renormalization."""

import numpy as np

from . import _k3
from ._arrays import host_view, int_arg, need, no_overlap, out_or_new


MAX_EXPERTS = 4096  # the router's limits (docs/moe.md)
MAX_TOP_K = 32


def route(logits, bias=None, top_k=16, n_group=1, topk_group=1, renormalize=True, routed_scaling_factor=1.0,
          ids=None, weights=None):
    """logits: [M, E] float32; bias: [E] float32 or None. Returns (ids [M, top_k] int32 global
    expert ids best first, weights [M, top_k] float32) — the same bits as the C++ and CUDA routers."""
    logits = host_view(logits)
    need("logits", logits, dtype=np.float32)
    if len(logits.shape) != 2:
        raise ValueError(f"logits must be 2-D [M, E], got shape {tuple(logits.shape)}")
    m, e = (int(d) for d in logits.shape)
    int_arg("num_experts (logits' columns)", e, 1, MAX_EXPERTS)
    top_k = int_arg("top_k", top_k, 1, min(MAX_TOP_K, e))
    n_group = int_arg("n_group", n_group, 1, e)
    topk_group = int_arg("topk_group", topk_group, 1, n_group)
    if bias is not None:
        bias = host_view(bias)
        need("bias", bias, (e,), np.float32)
    given = ids, weights
    ids = out_or_new("ids", host_view(ids) if ids is not None else None, (m, top_k), np.int32)
    weights = out_or_new("weights", host_view(weights) if weights is not None else None, (m, top_k), np.float32)
    no_overlap("ids", ids, (("logits", logits), ("bias", bias), ("weights", weights)))
    no_overlap("weights", weights, (("logits", logits), ("bias", bias)))
    _k3.route(logits, bias, m, e, top_k, n_group, topk_group, renormalize, routed_scaling_factor, ids, weights)
    return (ids if given[0] is None else given[0]), (weights if given[1] is None else given[1])
