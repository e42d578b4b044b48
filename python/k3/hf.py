"""Put a Hugging Face transformers Kimi-Linear model on k3's CPU kernels.

``k3.hf.patch(model, recipe="w4a16")`` takes a ``KimiLinearForCausalLM`` (or ``KimiLinearModel``)
from transformers >= 5.17 and, in place:

- every KDA layer (``KimiLinearDeltaAttention``) runs its core on k3: the chunked prefill, the
  single-token decode and the multi-token continuation with the cache (the module functions
  ``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention`` are served by k3 for the
  patched layers only), and its short convolution's decode update on k3's conv op
  (``causal_conv1d_update``, the cache's BF16 / FP32 state updated in place); the projections,
  the short convolution's prefill, the gate and the output norm stay torch (with ``dense=True``
  the projections run on k3's linear layer);
- every MoE block (``KimiLinearMoE``) routes with k3's router (sigmoid + correction bias + group
  top-k + renormalize + routed scaling) and runs its routed experts with k3's fused MoE on MXFP4
  weights, quantized once here with k3's codec (W4A16: BF16 activations; W4A8: MXFP8
  activations). The stock expert weights are released (moved to the ``meta`` device), so the
  experts take about 3.8x less memory than BF16 (7.5x less than FP32); ``keep_original=True``
  keeps them, so that ``unpatch`` can restore the model exactly;
- the MLA layers decode (one token with the cache) in the absorbed form, in torch: attention in
  the latent space instead of re-expanding the whole cache through ``kv_b_proj`` at every step
  as transformers does, so the step time no longer grows with the prefix (``mla=False`` keeps
  the stock path);
- the shared experts, MLA prefill, norms, embeddings and the LM head stay torch;
- speculative decoding (assisted generation, prompt lookup: transformers >= 5.25) verifies the
  drafts with k3's ``verify_replay`` and folds exactly the accepted ones into the KDA state at the
  rollback (``cache.crop``) with k3's ``commit``, so the tokens are those of plain decoding.

``k3.hf.unpatch(model)`` undoes it (needs ``keep_original=True`` for the experts; otherwise
reload the model). What k3 cannot serve is refused here with an error naming it: a model that
is not Kimi-Linear, training mode, a model not on the CPU, head dims or widths outside k3's
limits, more than 4096 experts, an activation other than SiLU. At call time, inputs that require
grad (k3 has no backward) are left on the stock path with a warning (KDA, and the MoE when the
original weights were kept) or refused (the MoE without them). Threads: k3 uses torch's thread
count (``torch.get_num_threads()``) unless ``threads=`` is given.
"""

import threading
import types
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from . import fla as _fla
from . import _k3 as _k3_native
from . import kda as _kda_mod
from . import moe as _moe
from . import mx
from . import linear as _linear
from . import torch as _k3torch
from ._arrays import MAX_THREADS

__all__ = ["patch", "unpatch", "is_patched", "check_isa", "mxfp4_roundtrip_", "TESTED_TRANSFORMERS"]

#: transformers releases the integration is tested with (the oldest and the newest pip serves here).
TESTED_TRANSFORMERS = ("5.17.0", "5.25.0")

_MAX_EXPERTS = 4096
_MAX_TOP_K = 32
_MAX_HEAD_DIM = 512

_tls = threading.local()  # the KDA layer whose forward is running on this thread (None: not patched)
_lock = threading.Lock()
_installed = {}  # module function name -> the stock function, while any model is patched
_patched_count = 0
_warned = set()


def _modeling():
    try:
        from transformers.models.kimi_linear import modeling_kimi_linear as m
    except ImportError as e:
        raise ImportError("k3.hf needs transformers >= 5.17 (it ships KimiLinearForCausalLM): "
                          "pip install 'transformers>=5.17'") from e
    return m


def _warn_once(key, msg):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


# ---- KDA ------------------------------------------------------------------------------------


class _KdaLayer:
    def __init__(self, index, threads, isa):
        self.index, self.threads, self.isa = index, threads, isa
        self.calls = {"prefill": 0, "decode": 0, "conv": 0, "verify": 0, "commit": 0}


def _needs_grad(*ts):
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in ts)


def _warn_grad(rec):
    _warn_once(("kda-grad", rec.index), f"k3.hf: KDA layer {rec.index} got inputs that require grad; k3 has no "
               "backward, so this call runs the stock torch function (use torch.no_grad() for k3)")


def _k3_chunk(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
    rec = getattr(_tls, "kda", None)
    stock = _installed.get("chunk_kimi_delta_attention")
    if rec is None or stock is None or _needs_grad(query, key, value, g, beta, initial_state):
        if rec is not None:
            _warn_grad(rec)
        return stock(query, key, value, g, beta, chunk_size=chunk_size, initial_state=initial_state,
                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     **kwargs)
    # The stock function's math is fla's chunk_kda with g the log decay and beta given: the
    # fla-compatible entry point serves it (B equal sequences, the state [B, H, K, V]).
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32).contiguous()
    o, final = _fla.chunk_kda(query, key, value, g, beta, initial_state=initial_state,
                              output_final_state=output_final_state,
                              use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel), threads=rec.threads, isa=rec.isa)
    rec.calls["prefill"] += 1
    return o.to(query.dtype), final


def _k3_recurrent(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel=False,
                  **kwargs):
    rec = getattr(_tls, "kda", None)
    stock = _installed.get("recurrent_kimi_delta_attention")
    b, t = query.shape[:2]
    if rec is not None and t != 1:  # the stock layer only calls it with one token; serve more with the prefill
        return _k3_chunk(query, key, value, g, beta, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if rec is None or stock is None or _needs_grad(query, key, value, g, beta, initial_state):
        if rec is not None:
            _warn_grad(rec)
        return stock(query, key, value, g, beta, initial_state, output_final_state,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
    h, hk = query.shape[2:]
    hv = value.shape[-1]
    if initial_state is None:
        pool = torch.zeros((b, h, hk, hv), dtype=torch.float32)
    elif (output_final_state and initial_state.dtype == torch.float32 and initial_state.is_contiguous()
          and tuple(initial_state.shape) == (b, h, hk, hv)):
        # In place: the patched layer's caller (transformers' KDA forward) passes the cache's state
        # and stores the returned final state straight back into it (a copy onto itself: no
        # work), so the state is neither cloned nor copied back (16 MB per layer at batch 8).
        pool = initial_state
    else:  # a copy: the caller's state stays as it was (the stock function returns a new tensor too)
        pool = initial_state.to(torch.float32, copy=True).contiguous()
    # Decode on a pool of B slots, sequence n in slot n: fla's continuous-batching call.
    o, _ = _fla.fused_recurrent_kda(query, key, value, g, beta, initial_state=pool,
                                    ssm_state_indices=torch.arange(b, dtype=torch.int32),
                                    use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel), threads=rec.threads,
                                    isa=rec.isa)
    rec.calls["decode"] += 1
    return o.to(query.dtype), (pool if output_final_state else None)


def _k3_conv_update(hidden_states, conv_state, weight, bias=None, activation=None):
    """transformers' `causal_conv1d_update` (the KDA layer's short convolution at decode: [B, C, T]
    inputs, the cache's state [B, C, S] updated in place) on k3's conv op: one call instead of
    concatenate + conv1d + SiLU + copy. Same storage as the stock function (BF16 or FP32), FP32
    arithmetic, the output rounded once (the stock BF16 path rounds the convolution, then SiLU)."""
    rec = getattr(_tls, "kda", None)
    stock = _installed.get("causal_conv1d_update")
    dt = hidden_states.dtype
    if (rec is None or stock is None or _needs_grad(hidden_states, conv_state, weight, bias)
            or activation not in (None, "silu", "swish") or hidden_states.device.type != "cpu"
            or dt not in (torch.bfloat16, torch.float32) or conv_state.dtype != dt or weight.dtype != dt
            or hidden_states.dim() != 3 or weight.dim() != 2 or conv_state.dim() != 3 or not conv_state.is_contiguous()
            or tuple(conv_state.shape[:2]) != tuple(hidden_states.shape[:2])
            or not weight.shape[1] - 1 <= conv_state.shape[2] <= _kda_mod.MAX_CONV_STATE_LEN
            or not 2 <= weight.shape[1] <= _kda_mod.MAX_CONV_WIDTH):
        return stock(hidden_states, conv_state, weight, bias=bias, activation=activation)
    b, c, t = hidden_states.shape
    x = hidden_states.transpose(1, 2).reshape(b * t, c)  # token-major [B T, C]: a view at decode
    if not x.is_contiguous():
        x = x.contiguous()
    if not weight.is_contiguous():
        weight = weight.contiguous()
    y = torch.empty((b, t, c), dtype=dt)
    cu = _conv_offsets(b, t)
    f32 = None if bias is None else _np(bias.detach().to(torch.float32).contiguous())
    # Shapes and dtypes were checked above: the binding directly (k3.kda.causal_conv1d's argument
    # checks cost more than the convolution at decode).
    if dt == torch.bfloat16:
        u16 = torch.uint16
        _k3_native.kda_conv_bf16(c, weight.shape[1], activation is not None, _np(x.view(u16)), _np(weight.view(u16)),
                                 f32, cu, _np(conv_state.view(u16)), _np(y.view(u16).view(b * t, c)),
                                 conv_state.shape[2], rec.threads or torch.get_num_threads())
    else:
        _k3_native.kda_conv_f32(c, weight.shape[1], activation is not None, _np(x), _np(weight), f32, cu,
                                _np(conv_state), _np(y.view(b * t, c)), conv_state.shape[2],
                                rec.threads or torch.get_num_threads())
    rec.calls["conv"] += 1
    return y.transpose(1, 2)


_np = _k3torch._np  # a CPU tensor as a numpy array over the same memory
_offsets_cache = {}


def _conv_offsets(b, t):
    """cu_seqlens of B sequences of T tokens (int64 numpy, cached: the same few shapes every step)."""
    r = _offsets_cache.get((b, t))
    if r is None:
        r = _offsets_cache[(b, t)] = np.arange(0, b * t + 1, t, dtype=np.int64)
    return r


_K3_FUNCS = {"chunk_kimi_delta_attention": _k3_chunk, "recurrent_kimi_delta_attention": _k3_recurrent,
             "causal_conv1d_update": _k3_conv_update}


def _install(m):
    global _patched_count
    with _lock:
        if _patched_count == 0:
            for name, fn in _K3_FUNCS.items():
                _installed[name] = getattr(m, name)
                setattr(m, name, fn)
        _patched_count += 1


def _uninstall(m):
    global _patched_count
    with _lock:
        _patched_count -= 1
        if _patched_count == 0:
            for name, fn in list(_installed.items()):
                if getattr(m, name) is _K3_FUNCS[name]:
                    setattr(m, name, fn)
            _installed.clear()


def _wrap_kda_forward(layer, rec):
    stock = layer.forward

    def forward(*args, **kwargs):
        saved = getattr(_tls, "kda", None)
        _tls.kda = rec
        try:
            # transformers >= 5.25 records the past on the cache when it will roll drafts back
            # (assisted generation): that step runs on k3's verify + replay commit.
            cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            if (cache is not None and hidden is not None and hasattr(cache, "get_recurrent_states_to_keep")
                    and cache.is_recording_past(layer.layer_idx) and not _needs_grad(hidden)):
                mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
                return _speculative_forward(layer, rec, hidden, cache, mask)
            if _decode_fast_path(layer, cache, hidden):
                mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
                return _decode_forward(layer, rec, hidden, cache, mask)
            return stock(*args, **kwargs)
        finally:
            _tls.kda = saved

    layer.forward = forward


# ---- single-token decode: the layer step without the module function's glue -----------------
#
# With transformers >= 5.25's cache API a KDA layer's decode step runs here: the stock modules for
# the projections, the forget gate, beta and the output norm (so the numbers are those of the
# stock step, bit for bit), k3's conv update, and k3's decode called directly on the cache's state
# in place (no module function, no fla-signature checks, no dispatcher, no state copy-back).


def _decode_fast_path(mod, cache, hidden):
    if (cache is None or hidden is None or hidden.dim() != 3 or hidden.shape[1] != 1 or _needs_grad(hidden)
            or hidden.dtype not in (torch.bfloat16, torch.float32) or not hasattr(cache, "get_conv_state")
            or not hasattr(cache, "get_recurrent_states_to_keep") or cache.is_recording_past(mod.layer_idx)
            or "causal_conv1d_update" not in _installed):
        return False
    conv = cache.get_conv_state(mod.layer_idx)
    state = cache.get_recurrent_state(mod.layer_idx)
    width = mod.conv1d.kernel_size[0]
    return (conv is not None and state is not None and state.dtype == torch.float32 and state.is_contiguous()
            and tuple(state.shape) == (hidden.shape[0], mod.num_heads, mod.head_dim, mod.head_dim)
            # what k3's conv op serves (else the stock step runs, with the stock conv update)
            and mod.activation in ("silu", "swish") and conv.dtype == hidden.dtype and conv.is_contiguous()
            and mod.conv1d.weight.dtype == hidden.dtype and not _needs_grad(mod.conv1d.weight)
            and tuple(conv.shape[:2]) == (hidden.shape[0], 3 * mod.num_heads * mod.head_dim)
            and 2 <= width <= _kda_mod.MAX_CONV_WIDTH and width - 1 <= conv.shape[2] <= _kda_mod.MAX_CONV_STATE_LEN)


def _decode_cfg(mod, rec):
    cfg = getattr(rec, "decode_cfg", None)
    if cfg is None:
        d = mod.head_dim
        cfg = rec.decode_cfg = _k3_native.kda_config(mod.num_heads, d, d, "log_decay", -5.0, False, True, 0.0,
                                                     "k_first")
    return cfg


def _version(t):
    """A tensor's version counter, or a fresh object (equal to nothing) for an inference tensor,
    which has none (tensors made under ``torch.inference_mode()``): what is keyed on it is then
    recomputed at every call."""
    return object() if t.is_inference() else t._version


def _bits(t):
    """q / k / v for k3: bfloat16 as its uint16 bits, float32 as is (contiguous numpy views)."""
    t = t.contiguous()
    return _np(t.view(torch.uint16) if t.dtype == torch.bfloat16 else t)


def _gate_params(rec, gate):
    """The forget gate's parameters as the stock forward computes them: -exp(A_log) (its unary
    minus applied first, as ``-decay_rate * g_softplus`` does) and dt_bias in FP32, kept until a
    parameter changes (in place or replaced)."""
    key = (gate.A_log.data_ptr(), _version(gate.A_log), gate.dt_bias.data_ptr(), _version(gate.dt_bias))
    cached = getattr(rec, "gate_params", None)
    if cached is None or cached[0] != key:
        neg_decay = -torch.exp(gate.A_log.detach().float())
        cached = rec.gate_params = (key, neg_decay, gate.dt_bias.detach().float().view(1, 1, -1))
    return cached[1], cached[2]


def _conv_weight(rec, conv1d):
    """The short convolution's weight [C, W] and FP32 bias as numpy views (kept until they change)."""
    w, bias = conv1d.weight, conv1d.bias
    key = (w.data_ptr(), _version(w), w.dtype, None if bias is None else (bias.data_ptr(), _version(bias)))
    cached = getattr(rec, "conv_weight", None)
    if cached is None or cached[0] != key:
        w2 = w.detach().squeeze(1).contiguous()
        arr = _np(w2.view(torch.uint16) if w2.dtype == torch.bfloat16 else w2)
        f32 = None if bias is None else _np(bias.detach().to(torch.float32).contiguous())
        cached = rec.conv_weight = (key, w2, arr, f32)
    return cached[2], cached[3]


def _qkv_and_fused(mod, hs):
    """q | k | v side by side [B, 1, 3 H D]: with fused projections (``dense=True``) the columns of
    the group's one k3 output that hold them (no concatenation), else the stock modules' outputs
    concatenated."""
    fused = [getattr(mod, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    if all(isinstance(f, _FusedSlice) for f in fused) and len({id(f._fused) for f in fused}) == 1:
        grp, idx = fused[0]._fused, [f._index for f in fused]
        if idx == [idx[0], idx[0] + 1, idx[0] + 2]:
            return grp.columns(idx, hs)
    return torch.cat([mod.q_proj(hs), mod.k_proj(hs), mod.v_proj(hs)], dim=-1)


def _decode_forward(mod, rec, hidden_states, cache, attention_mask):
    m = _modeling()
    idx = mod.layer_idx
    hs = m.apply_mask_to_padding_states(hidden_states, attention_mask)
    b = hs.shape[0]
    h, d = mod.num_heads, mod.head_dim
    threads = rec.threads or torch.get_num_threads()
    # The short convolution's decode update (what causal_conv1d_forward does for one token on the
    # cache: count the token, then causal_conv1d_update, here k3's conv op called directly).
    mixed = _qkv_and_fused(mod, hs).reshape(b, -1)
    if not mixed.is_contiguous():
        mixed = mixed.contiguous()
    conv_state = cache.get_conv_state(idx)
    cache.increase_count(idx, 0)
    c, dt = mixed.shape[1], mixed.dtype
    w, bias = _conv_weight(rec, mod.conv1d)
    qkv = torch.empty((b, 3, h, d), dtype=dt)
    if dt == torch.bfloat16:
        u16 = torch.uint16
        _k3_native.kda_conv_bf16(c, mod.conv1d.kernel_size[0], True, _np(mixed.view(u16)), w, bias,
                                 _conv_offsets(b, 1), _np(conv_state.view(u16)), _np(qkv.view(u16).view(b, c)),
                                 conv_state.shape[2], threads)
    else:
        _k3_native.kda_conv_f32(c, mod.conv1d.kernel_size[0], True, _np(mixed), w, bias, _conv_offsets(b, 1),
                                _np(conv_state), _np(qkv.view(b, c)), conv_state.shape[2], threads)
    rec.calls["conv"] += 1
    # The forget gate with the stock forward's operations (the same bits), its parameters kept.
    fg = mod.forget_gate
    neg_decay, dt_bias = _gate_params(rec, fg)
    g = (fg.f_b_proj(fg.f_a_proj(hs)).float() + dt_bias).reshape(b, 1, h, d)
    sp = torch.exp(g).add_(1.0).log_()  # log(1 + exp(g)), as stock
    g = torch.where(g > 20.0, g, sp).mul_(neg_decay).reshape(b, h, d).contiguous()
    beta = torch.sigmoid(mod.b_proj(hs)).reshape(b, h).float().contiguous()
    o = torch.empty((b, h, d), dtype=torch.float32)
    _k3_native.kda_decode(_decode_cfg(mod, rec), _bits(qkv[:, 0]), _bits(qkv[:, 1]), _bits(qkv[:, 2]), _np(g),
                          _np(beta), None, None, _np(cache.get_recurrent_state(idx)), _decode_slots(b), "cpu",
                          threads, rec.isa, _np(o))
    rec.calls["decode"] += 1
    core = o.view(b, 1, h, d).to(hs.dtype)
    gate = mod.g_b_proj(mod.g_a_proj(hs)).view(b, 1, h, d)
    return mod.o_proj(mod.o_norm(core, gate).reshape(b, 1, -1))


_slots_cache = {}


def _decode_slots(b):
    r = _slots_cache.get(b)
    if r is None:
        r = _slots_cache[b] = np.arange(b, dtype=np.int32)
    return r


# ---- speculative decoding: verify the drafts, commit the accepted prefix at the rollback -----
#
# transformers >= 5.25 runs assisted generation (an assistant model's or prompt lookup's drafts)
# on Kimi-Linear: it calls `cache.activate_past_recording(...)`, runs the target model on the last
# token plus the drafts, and rolls the rejected drafts back with `cache.crop(-n)`. Its own rollback
# restores the KDA recurrent state from a list of snapshots that is one state short when no draft
# is accepted, so its tokens can differ from plain decoding. On a patched model such a step runs
# here instead: the draft tokens are verified from the layer's state without writing it
# (k3.kda.verify_replay: their inputs are kept in a replay window), and the crop folds exactly the
# accepted tokens into the state (k3.kda.commit: bit-identical to decoding them one by one). Memory
# per layer: the state and one window (at most MAX_DRAFT_TOKENS tokens), not one state per draft.

#: the most tokens a patched KDA layer can roll back in one crop (k3's replay window, kMaxWindowTokens)
MAX_DRAFT_TOKENS = 64


class _Pending:
    """Draft tokens verified but not yet committed, kept on the cache layer until its crop: one
    replay window per forward since the last crop (oldest first), the layer's state they start
    from, and (once a second forward came) ``head``, a copy of that state with every pending token
    folded in, which the next forward's drafts start from."""
    __slots__ = ("windows", "state", "head", "head_windows", "index", "rec")

    def __init__(self, state, index, rec):
        self.windows, self.state, self.head, self.head_windows, self.index, self.rec = [], state, None, 0, index, rec

    @property
    def tokens(self):
        return sum(t for _, t in self.windows)

    def fold_into_state(self, accepted):
        """Commits the first `accepted` pending tokens into the layer's state; consumes every window."""
        for window, t in self.windows:
            a = min(accepted, t)
            if a:
                _commit(self.rec, self.state, window, t, a)
            accepted -= a
        self.windows, self.head, self.head_windows = [], None, 0

    def start(self):
        """The state after every pending token: this forward's drafts start there."""
        if self.head is None:
            self.head, self.head_windows = self.state.clone(), 0
        for window, t in self.windows[self.head_windows:]:
            _commit(self.rec, self.head, window.clone(), t, t)  # a copy: the window stays for the crop
        self.head_windows = len(self.windows)
        return self.head


def _speculative_forward(mod, rec, hidden_states, cache, attention_mask):
    """The stock KDA layer forward, with the recurrence on k3's verify + replay commit. The
    projections, short convolution (transformers records its inputs for the rollback), gates and
    output norm are the stock modules'."""
    m = _modeling()
    idx = mod.layer_idx
    hs = m.apply_mask_to_padding_states(hidden_states, attention_mask)
    b, t = hs.shape[:2]
    shape = (b, t, -1, mod.head_dim)
    mixed = torch.cat([mod.q_proj(hs), mod.k_proj(hs), mod.v_proj(hs)], dim=-1).transpose(1, 2)
    mixed = m.causal_conv1d_forward(mod.conv1d, mixed, cache, idx, activation=mod.activation)
    q, k, v = torch.split(mixed.transpose(1, 2), [mod.qkv_dim] * 3, dim=-1)
    q, k, v = q.reshape(shape), k.reshape(shape), v.reshape(shape)
    g = mod.forget_gate(hs)
    beta = torch.sigmoid(mod.b_proj(hs))
    core = _verify_drafts(rec, cache, idx, q, k, v, g, beta).to(q.dtype)
    gate = mod.g_b_proj(mod.g_a_proj(hs)).view(shape)
    return mod.o_proj(mod.o_norm(core, gate).reshape(b, t, -1))


def _layer_state(cache, idx, b, h, hk, hv):
    """The cache's recurrent state of layer idx as float32 [B, H, K, V], contiguous, created
    (zeros) on the first call; the drafts are committed into it in place."""
    shape = (b, h, hk, hv)
    state = cache.get_recurrent_state(idx)
    if state is None or state.dtype != torch.float32 or not state.is_contiguous() or tuple(state.shape) != shape:
        fresh = torch.zeros(shape, dtype=torch.float32) if state is None else state.to(torch.float32).contiguous()
        if tuple(fresh.shape) != shape:
            raise ValueError(f"k3.hf: KDA layer {idx}: the cache's recurrent state has shape {tuple(fresh.shape)}, "
                             f"expected {shape} for this batch")
        cache.update_recurrent_state(fresh, idx)
        state = cache.get_recurrent_state(idx)
        if state.dtype != torch.float32 or not state.is_contiguous():
            raise ValueError(f"k3.hf: KDA layer {idx}: the cache keeps its recurrent state as {state.dtype}"
                             f"{'' if state.is_contiguous() else ', not contiguous'}; k3's commit needs float32")
    return state


def _verify(rec, state, q, k, v, g, beta):
    """k3's verify of [B, T] draft tokens from state (not written); returns (o [B, T, H, V] float32,
    the replay window holding their inputs)."""
    b, t, h, hk = q.shape
    window = torch.zeros((b, _kda_mod.replay_window_floats(h, hk, v.shape[-1], t)), dtype=torch.float32)
    # fla's contract: o in v's dtype (a BF16 / FP16 model's); the caller rounds to it anyway.
    o, _ = _fla.fused_recurrent_kda(q, k, v, g, beta, initial_state=state,
                                    ssm_state_indices=torch.arange(b, dtype=torch.int32), replay_window=window,
                                    use_qk_l2norm_in_kernel=True, threads=rec.threads, isa=rec.isa)
    rec.calls["verify"] += 1
    return o, window


def _commit(rec, state, window, tokens, accepted):
    b, h, hk, hv = state.shape
    with _k3torch.kda_options(rec.threads, rec.isa):
        torch.ops.k3.kda_commit(state, window, torch.arange(b, dtype=torch.int32),
                                torch.full((b,), accepted, dtype=torch.int32), tokens, h, hk, hv, "k_first")
    rec.calls["commit"] += 1


def _rollback_tokens(cache, idx):
    """How many of a forward's last tokens a later crop may roll back: transformers' own count for
    the layer while it records the past (``get_recurrent_states_to_keep``: the drafts of assisted
    generation or prompt lookup, any number), and at least MAX_DRAFT_TOKENS."""
    keep = 0
    get = getattr(cache, "get_recurrent_states_to_keep", None)
    if get is not None:
        try:
            keep = int(get(idx))
        except (TypeError, ValueError, IndexError, AttributeError):
            keep = 0
    return max(MAX_DRAFT_TOKENS, keep)


def _verify_drafts(rec, cache, idx, q, k, v, g, beta):
    """This forward's T tokens, after any drafts still pending on the layer (several forwards may
    come before one crop, as an assistant model drafts token by token): verified from the state
    after the pending ones, kept pending for the crop, in replay windows of at most
    MAX_DRAFT_TOKENS tokens each (k3's window). At least ``keep`` tokens (``_rollback_tokens``)
    stay pending: older windows are committed now, and a longer forward (the prompt) prefills its
    head, which can no longer be rolled back. Returns the T tokens' outputs [B, T, H, V] in v's
    dtype."""
    lay = cache.layers[idx]
    _hook_crop(lay)
    b, t, h, hk = q.shape
    keep = _rollback_tokens(cache, idx)
    state = _layer_state(cache, idx, b, h, hk, v.shape[-1])
    drafts = (q, k, v, g.to(torch.float32), beta.to(torch.float32))
    pend = lay.__dict__.get("_k3_pending")
    if pend is not None and (pend.state is not state or pend.state.shape[0] != b):
        pend = None  # the cache was reset or reassigned since: the drafts went with it
    if pend is None or t > keep:
        if pend is not None:
            pend.fold_into_state(pend.tokens)
        pend = lay._k3_pending = _Pending(state, idx, rec)
    outs = []
    fold = max(0, t - keep)
    if fold:  # a long forward (the prompt): its head is never rolled back, prefill it
        o, final = _fla.chunk_kda(*[x[:, :fold] for x in drafts], initial_state=state, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, threads=rec.threads, isa=rec.isa)
        state.copy_(final)
        outs.append(o.to(v.dtype))
        rec.calls["prefill"] += 1
    for t0 in range(fold, t, MAX_DRAFT_TOKENS):  # one replay window per MAX_DRAFT_TOKENS tokens
        part = tuple(x[:, t0:t0 + MAX_DRAFT_TOKENS] for x in drafts)
        o, window = _verify(rec, pend.start() if pend.windows else state, *part)
        outs.append(o)
        pend.windows.append((window, part[0].shape[1]))
    # The oldest windows leave while the rest still hold `keep` tokens: theirs can no longer be rolled back.
    while len(pend.windows) > 1 and pend.tokens - pend.windows[0][1] >= keep:
        old, tokens = pend.windows.pop(0)
        _commit(rec, state, old, tokens, tokens)
        pend.head_windows -= 1
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


def _hook_crop(lay):
    """Puts k3's commit in front of the cache layer's own crop (once per cache layer)."""
    if "_k3_stock_crop" in lay.__dict__:
        return
    stock = lay.crop
    lay._k3_stock_crop = stock

    def crop(tokens_to_remove):
        pend = lay.__dict__.get("_k3_pending")
        n = -int(tokens_to_remove)
        if pend is None or not pend.windows or n < 0:
            return stock(tokens_to_remove)
        if n > pend.tokens:
            raise ValueError(f"k3.hf: cache.crop({int(tokens_to_remove)}) rolls back {n} tokens of KDA layer "
                             f"{pend.index}, which keeps only its last {pend.tokens} verified tokens (k3 keeps "
                             f"max(MAX_DRAFT_TOKENS = {MAX_DRAFT_TOKENS}, the cache's recurrent_states_to_keep) "
                             "tokens per layer)")
        del lay._k3_pending
        pend.fold_into_state(pend.tokens - n)
        if n:  # transformers' crop then takes its rolled-back state from this list: the committed one
            lay.recurrent_states_history[0] = [pend.state] * n
        return stock(tokens_to_remove)

    lay.crop = crop


# ---- MoE ------------------------------------------------------------------------------------


def _quantize_experts(w, rows, cols):
    """[E, rows, cols] weights -> MXFP4 codes [E, rows, cols / 2] and E8M0 scales [E, rows, cols / 32],
    one expert at a time (never a float32 copy of the whole tensor)."""
    e = w.shape[0]
    q = np.empty((e, rows, cols // 2), dtype=np.uint8)
    s = np.empty((e, rows, cols // 32), dtype=np.uint8)
    for i in range(e):
        x = w[i].detach().to(torch.float32).contiguous().numpy()
        mx.quantize(x, "mxfp4", "rceil", q=q[i], scales=s[i])
    return q, s


def mxfp4_roundtrip_(model):
    """Replaces every routed expert weight of a Kimi-Linear model, in place, by its MXFP4
    round trip (k3's codec, RCEIL scales: the values ``patch`` serves), keeping the dtype. The
    stock model then computes with exactly the weights k3 holds: the reference for comparing a
    patched model with stock. Returns the model."""
    m = _modeling()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, m.KimiLinearExperts):
                for name in ("gate_up_proj", "down_proj"):
                    p = getattr(mod, name)
                    e, rows, cols = p.shape
                    q, s = _quantize_experts(p, rows, cols)
                    for i in range(e):
                        deq = mx.dequantize(q[i], s[i], cols, "mxfp4")
                        p[i].copy_(torch.from_numpy(deq).to(p.dtype))
    return model


def _mxfp8_round(t):
    """t rounded per 32 along its last dimension to MXFP8 by k3's codec (RCEIL) and back, same dtype."""
    w = t.detach().to(torch.float32).reshape(-1, t.shape[-1]).contiguous().numpy()
    q, s = _linear.quantize_weight(w)
    return torch.from_numpy(mx.dequantize(q, s, t.shape[-1], "mxfp8")).reshape(t.shape).to(t.dtype).contiguous()


def mxfp8_roundtrip_dense_(model):
    """Replaces the weight of every ``nn.Linear`` that ``patch(dense=True)`` serves (input width a
    multiple of 32), in place, by its MXFP8 round trip (k3's codec, RCEIL), keeping the dtype: with
    :func:`mxfp4_roundtrip_`, the stock model then holds exactly the weights a ``dense=True`` patch
    serves. Returns the model."""
    with torch.no_grad():
        for mod in model.modules():
            if type(mod) is torch.nn.Linear and mod.in_features % 32 == 0:
                mod.weight.copy_(_mxfp8_round(mod.weight))
    return model


class _MoeLayer:
    def __init__(self, index, module, handle, problem, route_args, out_dtype, max_tokens, originals, threads):
        self.index, self.handle, self.problem = index, handle, problem
        self.route_args, self.out_dtype, self.max_tokens = route_args, out_dtype, max_tokens
        self.originals, self.threads = originals, threads
        self.calls = 0
        gate = module.gate
        self.bias = gate.e_score_correction_bias.detach().to(torch.float32).contiguous()
        # The router's FP32 weight, converted once (the stock router converts it at every call):
        # the same logits, without a conversion of E x hidden values per step.
        self.gate_weight = gate.weight.detach().to(torch.float32)
        self.bias_np = self.bias.numpy()
        self.native = _k3torch._layer(handle)._native  # the prepared CPU layer, for the eager path

    def release(self):
        _k3torch.release_moe(self.handle)


def _moe_forward(module, rec, stock_forward):
    def forward(hidden_states):
        if _needs_grad(hidden_states) or module.training:
            why = "inputs that require grad" if _needs_grad(hidden_states) else "training mode"
            if rec.originals is None:
                raise RuntimeError(f"k3.hf: MoE layer {rec.index} got {why}, but k3 has no backward and the stock "
                                   "expert weights were released by k3.hf.patch(keep_original=False); run under "
                                   "torch.no_grad() in eval mode, or patch with keep_original=True")
            _warn_once(("moe-grad", rec.index), f"k3.hf: MoE layer {rec.index} got {why}; k3 has no backward, so "
                       "it runs the stock torch path")
            return stock_forward(hidden_states)
        if rec.threads is None and torch.get_num_threads() != rec.plan_threads:
            _warn_once(("moe-threads", rec.index), f"k3.hf: torch now uses {torch.get_num_threads()} threads but the "
                       f"MoE layers were prepared for {rec.plan_threads}; patch again to follow torch")
        shape = hidden_states.shape
        hid = shape[-1]
        x = hidden_states.reshape(-1, hid)
        m = x.shape[0]
        logits = F.linear(x.to(torch.float32), rec.gate_weight)
        top_k = rec.route_args[0]
        ids = torch.empty((m, top_k), dtype=torch.int32)
        wts = torch.empty((m, top_k), dtype=torch.float32)
        xb = x.to(torch.bfloat16).contiguous()
        out = torch.empty((m, hid), dtype=rec.out_dtype)
        if torch.compiler.is_compiling():
            torch.ops.k3.route(logits, rec.bias, *rec.route_args, ids, wts)
            for r0 in range(0, m, rec.max_tokens):
                r1 = min(m, r0 + rec.max_tokens)
                torch.ops.k3.moe_run(rec.handle, xb[r0:r1], ids[r0:r1], wts[r0:r1], out[r0:r1])
        else:  # eager: the ops' CPU kernels without the dispatcher and the argument checks (the
            # shapes and dtypes are made right here): the same calls, about 0.2 ms less per block (measured alone)
            e = logits.shape[1]
            _k3_native.route(_np(logits), rec.bias_np, m, e, top_k, *rec.route_args[1:], _np(ids), _np(wts))
            xs = _np(xb.view(torch.uint16))
            os_ = _np(out if out.dtype == torch.float32 else out.view(torch.uint16))
            ids_np, wts_np = _np(ids), _np(wts)
            for r0 in range(0, m, rec.max_tokens):
                r1 = min(m, r0 + rec.max_tokens)
                rec.native.run(xs[r0:r1], ids_np[r0:r1], wts_np[r0:r1], r1 - r0, os_[r0:r1])
        rec.calls += 1
        y = out.to(hidden_states.dtype).view(shape)
        return y + module.shared_experts(hidden_states)

    return forward


# ---- RMSNorm -------------------------------------------------------------------------------


def _norm_forward(mod, rec, stock):
    """transformers' RMSNorm (x * rsqrt(mean(x^2) + eps), rounded to the input dtype, times the
    weight) as one k3 call (k3/norm.hpp) for CPU tensors whose weight has their dtype (BF16 or
    FP32); anything else (grad, other devices or dtypes, torch.compile tracing) runs the stock
    forward."""
    def forward(hidden_states):
        x, w = hidden_states, mod.weight
        dt = x.dtype
        if (x.device.type != "cpu" or dt not in (torch.bfloat16, torch.float32) or w.dtype != dt or x.dim() == 0
                or x.shape[-1] != w.shape[0] or w.dim() != 1 or _needs_grad(x, w) or torch.compiler.is_compiling()
                or not (0.0 <= float(mod.variance_epsilon) < float("inf"))):
            return stock(hidden_states)
        d = x.shape[-1]
        xc = x.contiguous()
        y = torch.empty(x.shape, dtype=dt)
        threads = rec.threads or torch.get_num_threads()
        if dt == torch.bfloat16:
            u16 = torch.uint16
            _k3_native.rms_norm_bf16(_np(xc.view(u16).view(-1, d)), _np(w.detach().view(u16)),
                                     _np(y.view(u16).view(-1, d)), d, float(mod.variance_epsilon), threads)
        else:
            _k3_native.rms_norm_f32(_np(xc.view(-1, d)), _np(w.detach()), _np(y.view(-1, d)), d,
                                    float(mod.variance_epsilon), threads)
        return y

    return forward


def _gated_norm_forward(mod, rec, stock):
    """transformers' KimiLinearRMSNormGated (the KDA output norm: RMSNorm of each head's row, times
    the weight and sigmoid(gate), in FP32, rounded once) as one k3 call for BF16 CPU tensors with
    a BF16 weight and a gate of the input's shape; anything else runs the stock forward."""
    def forward(hidden_states, gate=None):
        x, w = hidden_states, mod.weight
        if (gate is None or getattr(mod, "activation", "sigmoid") != "sigmoid" or x.device.type != "cpu"
                or x.dtype != torch.bfloat16 or gate.dtype != torch.bfloat16 or w.dtype != torch.bfloat16
                or gate.shape != x.shape or x.dim() == 0 or w.dim() != 1 or x.shape[-1] != w.shape[0]
                or _needs_grad(x, gate, w) or torch.compiler.is_compiling()
                or not (0.0 <= float(mod.variance_epsilon) < float("inf"))):
            return stock(hidden_states, gate)
        d = x.shape[-1]
        u16 = torch.uint16
        y = torch.empty(x.shape, dtype=torch.bfloat16)
        _k3_native.rms_norm_gated_bf16(_np(x.contiguous().view(u16).view(-1, d)),
                                       _np(gate.contiguous().view(u16).view(-1, d)), _np(w.detach().view(u16)),
                                       _np(y.view(u16).view(-1, d)), d, float(mod.variance_epsilon),
                                       rec.threads or torch.get_num_threads())
        return y

    return forward


# ---- MLA decode -----------------------------------------------------------------------------


class _MlaLayer:
    """Transformers' MLA re-expands the whole latent cache through kv_b_proj at every step, so its
    decode time grows with the prefix (8x at 2048 tokens). The absorbed form computes the same
    attention in the latent space: scores = (W_uk^T q_nope) . c + q_rope . k_rot, output =
    W_uv (softmax . c): O(prefix x (kv_lora_rank + rope)) per head and step. The scores, softmax
    and the sums over the cache run in FP32. The products with W_uk / W_uv: for one token of a BF16
    model, k3's per-head product (BF16 weights, FP32 operands and sums, read once at the stream
    rate; torch's BF16 bmm reads them at 6-17 GB/s and rounds its output to BF16); otherwise
    torch's bmm in the model's dtype (as kv_b_proj computes)."""

    def __init__(self, mod, threads=None, isa=""):
        self.index = mod.layer_idx
        self.calls = 0
        self.threads, self.isa = threads, isa
        self.absorb(mod, mod.kv_b_proj.weight.detach())

    def head_products(self):
        """(W_uk, W_uv^T) as BF16 bits for k3's per-head product (k3._k3.head_gemv_bf16), or None
        when the model is not BF16 (torch's bmm then)."""
        w = (self.w_uk, self.w_uv_t)
        if self.w_uk.dtype != torch.bfloat16:
            return None
        cached = getattr(self, "_bits", None)
        if cached is None or cached[0][0] is not w[0] or cached[0][1] is not w[1]:
            cached = self._bits = (w, _np(w[0].view(torch.uint16)), _np(w[1].view(torch.uint16)))
        return cached[1], cached[2]

    def absorb(self, mod, weight):
        """W_uk / W_uv from kv_b_proj's weight [H (nope + V), C], in the model's dtype (as kv_b_proj
        computes)."""
        h, nope, vd = mod.num_heads, mod.qk_nope_head_dim, mod.v_head_dim
        w = weight.view(h, nope + vd, mod.kv_lora_rank)
        self.w_uk = w[:, :nope, :].contiguous()  # [H, nope, C]
        self.w_uv_t = w[:, nope:, :].transpose(1, 2).contiguous()  # [H, C, V]

    def round_to_mxfp8(self):
        """``patch(dense=True)`` serves kv_b_proj with MXFP8 weights (prefill uses them): decode takes
        the same values, each row of kv_b_proj's weight rounded along C by k3's codec (exact in BF16)."""
        self.w_uk = _mxfp8_round(self.w_uk)
        self.w_uv_t = _mxfp8_round(self.w_uv_t.transpose(1, 2)).transpose(1, 2).contiguous()


def _cache_kwarg(cls):
    """The name transformers gives the cache argument of cls.forward: `cache` from 5.24,
    `past_key_values` before."""
    import inspect
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def _mla_forward(mod, rec, stock):
    name = _cache_kwarg(type(mod))

    def forward(hidden_states, attention_mask=None, **kwargs):
        # transformers >= 5.24 names the cache `cache`, 5.17-5.23 `past_key_values`: pass it back
        # to the stock forward under the name the caller used.
        cache = kwargs.get(name)
        b, t = hidden_states.shape[:2]
        if (cache is None or t != 1 or mod.training or _needs_grad(hidden_states)
                or kwargs.get("output_attentions")):
            return stock(hidden_states, attention_mask, **kwargs)
        kwargs.pop(name)
        h, nope = mod.num_heads, mod.qk_nope_head_dim
        if mod.q_lora_rank is None:
            q = mod.q_proj(hidden_states)
        else:
            q = mod.q_b_proj(mod.q_a_layernorm(mod.q_a_proj(hidden_states)))
        q = q.view(b, t, h, mod.qk_head_dim)  # [B, T, H, D]
        compressed = mod.kv_a_proj_with_mqa(hidden_states)
        kv_nope, k_rot = torch.split(compressed, [mod.kv_lora_rank, mod.qk_rope_head_dim], dim=-1)
        kv_nope = mod.kv_a_layernorm(kv_nope).view(b, 1, t, mod.kv_lora_rank)
        k_rot = k_rot.view(b, 1, t, mod.qk_rope_head_dim)
        if name == "cache":
            kv_nope, k_rot = cache.update(kv_nope, k_rot, mod.layer_idx, kwargs=kwargs)
        else:
            kv_nope, k_rot = cache.update(kv_nope, k_rot, mod.layer_idx)
        c = kv_nope[:, 0].to(torch.float32)  # [B, S, C]
        r = k_rot[:, 0].to(torch.float32)  # [B, S, R]
        heads = rec.head_products() if b * t == 1 else None
        threads = rec.threads or torch.get_num_threads()
        c_dim = rec.w_uk.shape[2]
        if heads is not None:  # one token: k3's per-head product, FP32 out
            q_lat = torch.empty((h, c_dim), dtype=torch.float32)
            _k3_native.head_gemv_bf16(heads[0], _np(q[0, 0, :, :nope].float().contiguous()), _np(q_lat), h, nope,
                                      c_dim, threads, rec.isa)
            q_lat = q_lat.view(1, h, 1, c_dim)
        else:  # W_uk^T q_nope per head, all tokens of the batch at once: [H, B T, nope] @ [H, nope, C]
            q_nope = q[..., :nope].permute(2, 0, 1, 3).reshape(h, b * t, nope).to(rec.w_uk.dtype)
            q_lat = torch.bmm(q_nope, rec.w_uk).view(h, b, t, -1).permute(1, 0, 2, 3).to(torch.float32)  # [B, H, T, C]
        q_rope = q[..., nope:].transpose(1, 2).to(torch.float32)  # [B, H, T, R]
        # One GEMM per sequence over all heads (the cache is read once, not once per head).
        scores = (torch.matmul(q_lat.reshape(b, h * t, -1), c.transpose(1, 2))
                  + torch.matmul(q_rope.reshape(b, h * t, -1), r.transpose(1, 2))).view(b, h, t, -1)
        scores = scores * mod.scaling
        if attention_mask is not None:
            mask = attention_mask[..., : scores.shape[-1]]
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, float("-inf"))
            else:
                scores = scores + mask.to(torch.float32)
        p = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(p.reshape(b, h * t, -1), c).view(b, h, t, -1)  # [B, H, T, C]
        if heads is not None:
            o = torch.empty((h, mod.v_head_dim), dtype=torch.float32)
            _k3_native.head_gemv_bf16(heads[1], _np(ctx.reshape(h, c_dim).contiguous()), _np(o), h, c_dim,
                                      mod.v_head_dim, threads, rec.isa)
            o = o.view(1, 1, h * mod.v_head_dim).to(hidden_states.dtype)
        else:
            ctx = ctx.permute(1, 0, 2, 3).reshape(h, b * t, -1).to(rec.w_uv_t.dtype)
            o = torch.bmm(ctx, rec.w_uv_t).view(h, b, t, -1)  # W_uv per head: [H, B T, V]
            o = o.permute(1, 2, 0, 3).reshape(b, t, h * mod.v_head_dim).to(hidden_states.dtype)
        rec.calls += 1
        return mod.o_proj(o), None

    return forward


# ---- patch / unpatch ------------------------------------------------------------------------


class Patch:
    """What ``patch`` did to a model (``model._k3_patch``): the KDA and MoE layers served by k3,
    the recipe, the threads, the expert memory before and after, and call counters."""

    def __init__(self, recipe, threads, isa=""):
        self.recipe, self.threads, self.isa = recipe, threads, isa
        self.kda, self.moe, self.mla = [], [], []
        self.norms = []  # KimiLinearRMSNorm modules served by k3's RMSNorm
        self.dense = []  # (parent module, attribute name, stock nn.Linear or None, k3 Linear)
        self.expert_bytes_stock = 0
        self.expert_bytes_k3 = 0
        self.dense_bytes_stock = 0
        self.dense_bytes_k3 = 0
        self.dense_format = "MXFP8"
        self.fused_groups = 0  # k3 layers that serve several projections of one input (dense=True)
        self.hooks = []  # load_state_dict guards (removed by unpatch)
        self.installed = False  # k3's KDA module functions installed for this model

    def summary(self):
        return (f"k3.hf: {len(self.kda)} KDA layers and {len(self.moe)} MoE blocks on k3, {len(self.norms)} RMSNorms "
                f"on k3, {len(self.mla)} MLA "
                f"layers decoding in the absorbed form (recipe {self.recipe}, "
                f"threads {self.threads if self.threads is not None else 'torch'}, isa {self.isa or 'best'}); "
                f"routed experts "
                f"{self.expert_bytes_stock / 2**20:.1f} MiB stock -> {self.expert_bytes_k3 / 2**20:.1f} MiB MXFP4"
                + (f"; {len(self.dense)} dense projections on k3 ({self.fused_groups} groups of projections of one "
                   f"input fused), {self.dense_bytes_stock / 2**20:.1f} MiB stock -> "
                   f"{self.dense_bytes_k3 / 2**20:.1f} MiB {self.dense_format}" if self.dense else ""))

    def __repr__(self):
        return self.summary()


def is_patched(model):
    return getattr(model, "_k3_patch", None) is not None


def _check_config(cfg, moe, kda):
    def bad(key, limit, value):
        raise ValueError(f"k3.hf.patch: config.{key} = {value} is outside k3's limit ({limit})")

    if kda:
        for key in ("linear_head_dim",):
            v = getattr(cfg, key)
            if not 1 <= v <= _MAX_HEAD_DIM:
                bad(key, f"1 <= head dim <= {_MAX_HEAD_DIM}", v)
        if not 1 <= cfg.linear_num_heads <= 1024:
            bad("linear_num_heads", "1 <= heads <= 1024", cfg.linear_num_heads)
    if moe:
        if cfg.num_local_experts > _MAX_EXPERTS:
            bad("num_experts", f"at most {_MAX_EXPERTS} experts", cfg.num_local_experts)
        if not 1 <= cfg.num_experts_per_tok <= min(_MAX_TOP_K, cfg.num_local_experts):
            bad("num_experts_per_token", f"1 <= top-k <= {_MAX_TOP_K} and <= num_experts", cfg.num_experts_per_tok)
        if cfg.hidden_size % 32:
            bad("hidden_size", "a multiple of 32 (one MXFP4 scale per 32 weights)", cfg.hidden_size)
        if cfg.moe_intermediate_size % 32:
            bad("moe_intermediate_size", "a multiple of 32 (one MXFP4 scale per 32 weights)",
                cfg.moe_intermediate_size)
        if cfg.hidden_act != "silu":
            bad("hidden_act", "'silu' (the SiLU-gated experts k3 computes)", repr(cfg.hidden_act))
        if cfg.n_group < 1 or cfg.num_local_experts % cfg.n_group:
            bad("n_group", "a divisor of num_experts", cfg.n_group)


def _restore(model, rec, m):
    """Undoes whatever stages of ``patch`` ran (a patch that fails part-way): the stock forwards,
    functions and projections back, k3's layers and hooks released. The stock expert weights are
    still in place (``patch`` releases them only once every stage succeeded)."""
    for h in rec.hooks:
        h.remove()
    rec.hooks.clear()
    for parent, name, stock, _ in rec.dense:
        setattr(parent, name, stock)
    for r in rec.moe:
        r.release()
    for mod, _ in rec.kda + rec.mla:
        mod.__dict__.pop("forward", None)
    for mod in rec.norms:
        mod.__dict__.pop("forward", None)
    if rec.installed:
        _uninstall(m)
        rec.installed = False


def _refuse_load(module, *args, **kwargs):
    raise RuntimeError("k3.hf: load_state_dict on a patched model would report its keys matched while k3 keeps "
                       "serving the weights it packed at patch time (experts, router, projections, absorbed MLA "
                       "weights); load the weights first and patch then, or k3.hf.unpatch(model) before loading")


def _guard_state_dict(model, rec):
    """A load_state_dict pre-hook that refuses the load on the model and on every module that
    holds (or is) something k3 serves, so new weights never silently miss k3's packed copies."""
    served = {id(mod) for mod, _ in rec.kda + rec.mla}
    served |= {id(r.module) for r in rec.moe} | {id(mod) for mod in rec.norms}
    served |= {id(parent) for parent, _, _, _ in rec.dense}
    names = [name for name, mod in model.named_modules() if id(mod) in served]
    guard = {""}
    for name in names:
        parts = name.split(".")
        guard.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    for name, mod in model.named_modules():
        if name in guard:
            rec.hooks.append(mod.register_load_state_dict_pre_hook(_refuse_load))


def check_isa(isa):
    """Raises ValueError unless ``isa`` names a SIMD level this CPU runs (the library's own check,
    on a one-token KDA call)."""
    one = np.zeros((1, 1, 32), dtype=np.float32)
    try:
        _kda_mod.prefill(one, one, one, one, np.zeros((1, 1), dtype=np.float32), gate="log_decay", isa=isa,
                         backend="cpu")
    except (ValueError, RuntimeError) as e:
        raise ValueError(str(e)) from None


def patch(model, recipe="w4a16", kda=True, moe=True, mla=True, threads=None, keep_original=False,
          max_tokens=4096, isa="", dense=False, fuse=True, norms=True):
    """Serves a transformers Kimi-Linear model's KDA layers and routed experts with k3 (in place).

    ``recipe``: "w4a16" (BF16 activations) or "w4a8" (MXFP8 activations) for the experts.
    ``kda`` / ``moe``: which parts to serve. ``mla``: decode the MLA layers in the absorbed form
    (torch, in the latent space: per-step time independent of the prefix but for reading the
    cache). ``threads``: k3's thread count (None: torch's, read
    per KDA call and at patch time for the MoE). ``keep_original``: keep the stock expert weights
    (so that ``unpatch`` restores the model exactly and grad-requiring calls can fall back).
    ``max_tokens``: rows per fused-MoE call (longer inputs are split). ``isa``: k3's SIMD level
    ("" the best the CPU has; "avx2", "avx512", "scalar" force a lower one, as ``K3_ISA`` does for
    the k3 tool; torch's own kernels are not affected). ``dense``: also serve the dense projections
    (attention, shared experts, dense MLPs, the LM head: every ``nn.Linear`` whose input width is
    a multiple of 32) with k3's linear layer: ``True`` or ``"mxfp8"`` on MXFP8 weights (half of
    BF16's bytes; recipe "w8a16", or "w8a8" with ``recipe="w4a8"``), ``"bf16"`` on the model's own
    BF16 weights (recipe "w16a16": no weight rounding, the stock bytes); needs a bfloat16 model.
    ``fuse`` (with ``dense``): the projections of a layer that read the same input (a KDA layer's
    q / k / v / forget-gate / beta / output-gate inputs, MLA's query and latent inputs, an MLP's
    gate and up) run as one k3 layer, their weights stacked: the same bits, fewer calls.
    ``norms``: a BF16 model's RMSNorms (``KimiLinearRMSNorm``: the decoder layers' two, the final
    one, MLA's latent norms; ``KimiLinearRMSNormGated``: the KDA output norm) run on k3's (k3/norm.hpp:
    transformers' arithmetic with the sum of squares in k3's order and the C library's exp in the
    sigmoid, so an output can differ from stock by one BF16 rounding) on CPU tensors without grad:
    one call instead of about ten torch operations. An FP32 model keeps
    torch's (there the summation order is visible at the FP32 level the tests compare at).
    Returns a :class:`Patch`."""
    m = _modeling()
    if recipe not in ("w4a16", "w4a8"):
        raise ValueError(f"k3.hf.patch: recipe = {recipe!r} must be 'w4a16' or 'w4a8'")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"k3.hf.patch: model must be a transformers Kimi-Linear model, got {type(model).__name__}")
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) != "kimi_linear":
        raise TypeError(f"k3.hf.patch: model is {type(model).__name__} (model_type "
                        f"{getattr(cfg, 'model_type', None)!r}), not a Kimi-Linear model (model_type 'kimi_linear')")
    if is_patched(model):
        raise ValueError("k3.hf.patch: model is already patched (k3.hf.unpatch(model) first)")
    if model.training:
        raise ValueError("k3.hf.patch: model is in training mode (model.training = True); k3 has no backward: "
                         "call model.eval() first")
    for name, p in model.named_parameters():
        if p.device.type != "cpu":
            raise ValueError(f"k3.hf.patch: parameter {name} is on {p.device}; k3.hf serves models on the CPU")
        break
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or not 0 <= threads <= MAX_THREADS):
        raise ValueError(f"k3.hf.patch: threads = {threads!r} must be None (torch's count) or an int in "
                         f"[0, {MAX_THREADS}] (0: all logical CPUs)")
    if not isinstance(isa, str):
        raise ValueError(f"k3.hf.patch: isa = {isa!r} must be a string ('' for the best level)")
    if isa:
        try:
            check_isa(isa)
        except ValueError as e:
            raise ValueError(f"k3.hf.patch: isa = {isa!r}: {e}") from None
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= 1 << 20:
        raise ValueError(f"k3.hf.patch: max_tokens = {max_tokens!r} must be an int in [1, 1048576]")
    _check_config(cfg, moe, kda)
    if not isinstance(norms, bool):
        raise TypeError(f"k3.hf.patch: norms = {norms!r} must be True or False")
    if dense not in (False, True, "mxfp8", "bf16"):
        raise ValueError(f"k3.hf.patch: dense = {dense!r} must be False, True / 'mxfp8' (MXFP8 weights) or 'bf16' "
                         "(the model's BF16 weights)")
    if dense:
        dt = next(model.parameters()).dtype
        if dt != torch.bfloat16:
            raise ValueError(f"k3.hf.patch: dense=True needs a bfloat16 model (k3's linear layer takes BF16 "
                             f"activations); this model is {dt}")

    rec = Patch(recipe, threads, isa)
    kda_layers = [mod for mod in model.modules() if isinstance(mod, m.KimiLinearDeltaAttention)] if kda else []
    moe_blocks = [mod for mod in model.modules() if isinstance(mod, m.KimiLinearMoE)] if moe else []
    plan_threads = min(torch.get_num_threads(), MAX_THREADS) if threads is None else threads
    try:  # every stage: on any failure the model is left exactly as it was (_restore)
        for mod in moe_blocks:
            rec.moe.append(_patch_moe(mod, len(rec.moe), cfg, recipe, threads, plan_threads, keep_original,
                                      max_tokens, rec, isa))
        for mod in kda_layers:
            r = _KdaLayer(mod.layer_idx, threads, isa)
            rec.kda.append((mod, r))
            _wrap_kda_forward(mod, r)
        if kda_layers:
            _install(m)
            rec.installed = True
        if norms:
            for mod in model.modules():
                if type(mod) is m.KimiLinearRMSNorm and mod.weight.dtype == torch.bfloat16:
                    rec.norms.append(mod)
                    mod.forward = _norm_forward(mod, rec, mod.forward)
                elif type(mod) is m.KimiLinearRMSNormGated and mod.weight.dtype == torch.bfloat16:
                    rec.norms.append(mod)
                    mod.forward = _gated_norm_forward(mod, rec, mod.forward)
        if mla:
            for mod in model.modules():
                # The absorbed decode multiplies by kv_b_proj's weight: a layer whose kv_b_proj has
                # no weight tensor (torch.ao's dynamically quantized Linear, say) keeps the stock forward.
                if isinstance(mod, m.KimiLinearAttention) and isinstance(getattr(mod.kv_b_proj, "weight", None),
                                                                         torch.Tensor):
                    r = _MlaLayer(mod, threads, isa)
                    rec.mla.append((mod, r))
                    mod.forward = _mla_forward(mod, r, mod.forward)
        if dense:
            dense_recipe = "w16a16" if dense == "bf16" else "w8a8" if recipe == "w4a8" else "w8a16"
            rec.dense_format = "BF16" if dense == "bf16" else "MXFP8"
            _patch_dense(model, m, rec, dense_recipe, plan_threads, keep_original, max_tokens, isa, fuse)
            if dense_recipe != "w16a16":  # the absorbed MLA decode on the MXFP8 kv_b_proj weights prefill uses
                for mod, r in rec.mla:
                    if isinstance(mod.kv_b_proj, _k3torch.Linear):
                        r.round_to_mxfp8()
        _guard_state_dict(model, rec)
    except BaseException:
        _restore(model, rec, m)
        raise
    # Release (or keep) the stock expert weights only once everything above succeeded.
    for r in rec.moe:
        mod = r.module
        if not keep_original:
            with torch.no_grad():
                for name in ("gate_up_proj", "down_proj"):
                    p = getattr(mod.experts, name)
                    setattr(mod.experts, name, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                                  requires_grad=False))
        mod.forward = _moe_forward(mod, r, r.stock_forward)
    model._k3_patch = rec
    return rec


def _patch_moe(mod, index, cfg, recipe, threads, plan_threads, keep_original, max_tokens, rec, isa):
    experts = mod.experts
    w1, w2 = experts.gate_up_proj, experts.down_proj
    e, two_i, hid = w1.shape
    inter = two_i // 2
    dtype = w1.dtype
    out_name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    p = _moe.problem(hidden=hid, intermediate=inter, num_experts=e, top_k=cfg.num_experts_per_tok, recipe=recipe,
                     activation="silu", out_dtype=out_name)
    fc1_q, fc1_s = _quantize_experts(w1, two_i, hid)
    fc2_q, fc2_s = _quantize_experts(w2, hid, inter)
    handle = _k3torch.prepare_moe(p, fc1_q, fc1_s, fc2_q, fc2_s, max_tokens=max_tokens, threads=plan_threads,
                                  isa=isa)
    rec.expert_bytes_stock += (w1.numel() + w2.numel()) * w1.element_size()
    rec.expert_bytes_k3 += sum(a.nbytes for a in (fc1_q, fc1_s, fc2_q, fc2_s))
    route_args = (cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, bool(cfg.norm_topk_prob),
                  float(cfg.routed_scaling_factor))
    originals = (w1, w2) if keep_original else None
    r = _MoeLayer(index, mod, handle, p, route_args, {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
        out_name, torch.float32), max_tokens, originals, threads)
    r.module, r.plan_threads = mod, plan_threads
    r.stock_forward = types.MethodType(type(mod).forward, mod)
    return r


def _input_groups(model, m):
    """The projections of one layer that read the same input tensor: (parent, attribute) pairs, in
    the order the stock forwards call them. Each group becomes one k3 layer (their weights stacked
    along N), so a decode step makes one call (one weight stream, one thread fork) where it made
    up to six."""
    groups = []
    for mod in model.modules():
        if isinstance(mod, m.KimiLinearDeltaAttention):
            groups.append([(mod, "q_proj"), (mod, "k_proj"), (mod, "v_proj"), (mod.forget_gate, "f_a_proj"),
                           (mod, "b_proj"), (mod, "g_a_proj")])
        elif isinstance(mod, m.KimiLinearAttention):
            q = "q_proj" if getattr(mod, "q_lora_rank", None) is None else "q_a_proj"
            groups.append([(mod, q), (mod, "kv_a_proj_with_mqa")])
        elif isinstance(mod, m.KimiLinearMLP):
            groups.append([(mod, "gate_proj"), (mod, "up_proj")])
    return groups


class _FusedProjections:
    """One k3 layer serving several projections of the same input (``_input_groups``). Each
    projection is a :class:`_FusedSlice`; the first one called with an input runs the layer for
    all of them and the others take their columns of that output (same tensor object, same
    version), so the stock forwards run unchanged. Stacking the weights along N changes no bit:
    every output column is its own dot product (k3's linear contract), and the W8A8 activation
    quantization is per row of X. A projection called with another input runs the whole layer.
    The last output is kept per thread, so threads sharing a model do not see each other's."""

    def __init__(self, lin, widths):
        self.lin = lin
        self.bounds = []
        n0 = 0
        for w in widths:
            self.bounds.append((n0, n0 + w))
            n0 += w
        self._last = threading.local()  # per thread: (input, its version, output, indices taken)

    @staticmethod
    def _stamp(x):
        """What tells whether x changed since its output was made: its version counter, or for an
        inference tensor (``torch.inference_mode()``: no version counter) a copy of its values."""
        return x.clone() if x.is_inference() else x._version

    @staticmethod
    def _same(x, stamp):
        if x.is_inference():
            return isinstance(stamp, torch.Tensor) and torch.equal(x, stamp)
        return not isinstance(stamp, torch.Tensor) and x._version == stamp

    def _output(self, indices, x):
        last = getattr(self._last, "v", None)
        if last is None or last[0] is not x or not self._same(x, last[1]) or any(i in last[3] for i in indices):
            last = (x, self._stamp(x), self.lin(x), set())
        last[3].update(indices)
        # Once every projection took its columns, hold nothing.
        self._last.v = None if len(last[3]) == len(self.bounds) else last
        return last[2]

    def __call__(self, i, x):
        a, b = self.bounds[i]
        return self._output((i,), x)[..., a:b]

    def columns(self, indices, x):
        """The columns of the adjacent projections ``indices`` at once (what concatenating their
        outputs gives, as a view)."""
        return self._output(indices, x)[..., self.bounds[indices[0]][0]:self.bounds[indices[-1]][1]]


class _FusedSlice(torch.nn.Module):
    """A projection served by a :class:`_FusedProjections` (``k3.hf.patch(dense=True)``)."""

    def __init__(self, fused, index, stock, keep_original=False):
        super().__init__()
        self._fused, self._index = fused, index  # not a submodule: the k3 layer belongs to the group
        self.in_features, self.out_features = stock.in_features, stock.out_features
        # The stock module (keep_original=True) for inputs that require grad; kept outside the
        # module tree so that parameters() and state_dict() stay the patched model's.
        self.__dict__["_k3_stock"] = stock if keep_original else None

    @property
    def weight_bytes(self):
        """This projection's share of the fused layer's packed bytes (the shares sum to them)."""
        total = _k3torch._linear_layer(self._fused.lin.handle).packed_bytes
        a, b = self._fused.bounds[self._index]
        n = self._fused.bounds[-1][1]
        return total - total * a // n if b == n else total * b // n - total * a // n

    def extra_repr(self):
        a, b = self._fused.bounds[self._index]
        return f"in_features={self.in_features}, out_features={self.out_features}, columns {a}:{b} of a fused k3 layer"

    def forward(self, x):
        stock = self._k3_stock
        if _k3torch._refuse_grad(x, "k3.hf dense projection", stock):
            _k3torch._warn_grad_once(self)
            return stock(x)
        return self._fused(self._index, x)


def _patch_dense(model, m, rec, recipe, threads, keep_original, max_tokens, isa, fuse):
    """Every nn.Linear of the decoder layers and the LM head -> k3.torch.Linear (MXFP8 weights, or
    the BF16 weights with recipe "w16a16"); the projections of a layer that read the same input
    (``_input_groups``) -> one fused k3 layer.
    The routed experts are not nn.Linear (they are served by the MoE path); the router is not one."""
    def servable(child):
        return type(child) is torch.nn.Linear and child.in_features % 32 == 0

    def prepare(weight, bias):
        return _k3torch.Linear.from_linear(types.SimpleNamespace(weight=weight, bias=bias), recipe=recipe, out_dtype="bf16",
                                           max_tokens=max_tokens, threads=threads, isa=isa)

    for group in _input_groups(model, m) if fuse else []:
        stock = [getattr(parent, name, None) for parent, name in group]
        if (not all(servable(c) for c in stock) or len({c.in_features for c in stock}) != 1
                or len({c.bias is None for c in stock}) != 1 or len({c.weight.dtype for c in stock}) != 1):
            continue  # served one by one below
        with torch.no_grad():
            weight = torch.cat([c.weight.detach() for c in stock], 0)
            bias = None if stock[0].bias is None else torch.cat([c.bias.detach() for c in stock], 0)
        fused = _FusedProjections(prepare(weight, bias), [c.out_features for c in stock])
        del weight, bias
        rec.dense_bytes_k3 += _k3torch._linear_layer(fused.lin.handle).packed_bytes
        for i, ((parent, name), child) in enumerate(zip(group, stock)):
            rec.dense_bytes_stock += child.weight.numel() * child.weight.element_size()
            sl = _FusedSlice(fused, i, child, keep_original)
            setattr(parent, name, sl)
            rec.dense.append((parent, name, child if keep_original else None, sl))
        rec.fused_groups += 1
    targets = []
    for parent in model.modules():
        if isinstance(parent, (_k3torch.Linear, _FusedSlice)):
            continue
        for name, child in parent.named_children():
            if servable(child):
                targets.append((parent, name, child))
    for parent, name, child in targets:
        lin = prepare(child.weight.detach(), child.bias)
        if keep_original:  # for inputs that require grad; outside the module tree (see _FusedSlice)
            lin.__dict__["_k3_stock"] = child
        rec.dense_bytes_stock += child.weight.numel() * child.weight.element_size()
        rec.dense_bytes_k3 += _k3torch._linear_layer(lin.handle).packed_bytes
        setattr(parent, name, lin)
        rec.dense.append((parent, name, child if keep_original else None, lin))


def unpatch(model):
    """Undoes :func:`patch`: the stock functions and forwards again, the stock expert weights back
    (only possible with ``keep_original=True``; otherwise this raises before changing anything:
    reload the model). Frees k3's packed weights."""
    rec = getattr(model, "_k3_patch", None)
    if rec is None:
        raise ValueError("k3.hf.unpatch: model is not patched by k3.hf.patch")
    missing = [r.index for r in rec.moe if r.originals is None]
    if any(stock is None for _, _, stock, _ in rec.dense):
        raise ValueError("k3.hf.unpatch: the stock dense projections were released by k3.hf.patch(dense=True, "
                         "keep_original=False); reload the model (from_pretrained), or patch with keep_original=True")
    if missing:
        raise ValueError(f"k3.hf.unpatch: the stock expert weights of MoE blocks {missing} were released by "
                         "k3.hf.patch(keep_original=False); reload the model (from_pretrained), or patch with "
                         "keep_original=True to be able to unpatch")
    m = _modeling()
    for h in rec.hooks:
        h.remove()
    rec.hooks.clear()
    for mod, _ in rec.kda + rec.mla:
        del mod.forward
    for mod in rec.norms:
        del mod.forward
    if rec.installed:
        _uninstall(m)
    for r in rec.moe:
        del r.module.forward
        r.module.experts.gate_up_proj, r.module.experts.down_proj = r.originals
        r.release()
    for parent, name, stock, _ in rec.dense:
        setattr(parent, name, stock)
    model._k3_patch = None
    return model
