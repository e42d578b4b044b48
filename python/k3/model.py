"""The native model runner (docs/runner.md): a Kimi-Linear checkpoint directory run end to end in
C++ (``k3::Model``), with no Python per layer.

    model = k3.Model.from_pretrained("path/to/checkpoint")        # MXFP8 trunk, MXFP4 experts
    state = model.new_state()                                      # a slot of the state pool
    logits = model.forward([1, 5, 7], state)                       # [vocab] float32, last token
    ids = model.generate([1, 5, 7], max_new_tokens=32)             # greedy by default

Token ids in, logits and token ids out (numpy). ``python -m k3 generate --checkpoint DIR --prompt
TEXT`` tokenizes with the checkpoint's own tokenizer through transformers.
"""

import numpy as np

from . import _k3
from ._arrays import int_arg, path_arg, threads_arg

_TRUNKS = ("mxfp8", "bf16")
_EXPERTS = ("w4a16", "w4a8")


def _ids(name, ids, vocab):
    a = np.asarray(ids)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence of token ids, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name} has dtype {a.dtype}; token ids are integers")
    bad = np.flatnonzero((a < 0) | (a >= vocab))
    if bad.size:
        raise ValueError(f"{name}[{int(bad[0])}] = {int(a[bad[0]])} is outside the vocabulary [0, {vocab})")
    return np.ascontiguousarray(a, dtype=np.int32)


class State:
    """One sequence's slot in the model's state pool (KDA states, conv states, the MLA latent
    cache). ``position`` is the number of tokens it holds."""

    def __init__(self, model, slot):
        self._model, self.slot = model, slot

    @property
    def position(self):
        return self._model._native.position(self.slot)

    def reset(self):
        self._model._native.reset(self.slot)


class Model:
    """A loaded checkpoint. Use :meth:`from_pretrained`."""

    def __init__(self, native):
        self._native = native
        self.info = native.info
        self._free = list(range(self.info["max_seqs"]))[::-1]

    @classmethod
    def from_pretrained(cls, path, *, trunk="mxfp8", experts="w4a16", threads=0, isa="", max_seqs=1,
                        max_context=4096, max_batch_tokens=512, progress=False):
        """Loads and packs a checkpoint directory (config.json + safetensors).

        trunk: "mxfp8" (W8A16 projections, the default) or "bf16" (the checkpoint's BF16 weights);
        experts: "w4a16" or "w4a8" (MXFP4 experts, quantized once from BF16); threads: 0 = all
        CPUs; max_seqs: slots of the state pool; max_context: tokens per slot; max_batch_tokens:
        tokens per forward call (longer prompts are split by :meth:`generate`)."""
        if trunk not in _TRUNKS:
            raise ValueError(f"trunk = {trunk!r} must be one of {list(_TRUNKS)}")
        if experts not in _EXPERTS:
            raise ValueError(f"experts = {experts!r} must be one of {list(_EXPERTS)}")
        if not isinstance(isa, str):
            raise ValueError(f"isa = {isa!r} must be a string (scalar, avx2, avx512, avx512bf16 or '' for the best)")
        native = _k3.model_load(path_arg("path", path), threads_arg(threads), isa, trunk, experts,
                                int_arg("max_seqs", max_seqs, 1, 1024), int_arg("max_context", max_context, 1, 1 << 20),
                                int_arg("max_batch_tokens", max_batch_tokens, 1, 65536), bool(progress))
        return cls(native)

    @property
    def vocab_size(self):
        return self.info["vocab_size"]

    def new_state(self):
        """A free slot of the state pool, empty (position 0)."""
        if not self._free:
            raise ValueError(f"all max_seqs = {self.info['max_seqs']} slots are in use (load with a larger max_seqs, "
                             "or release_state one)")
        s = State(self, self._free.pop())
        s.reset()
        return s

    def release_state(self, state):
        if not isinstance(state, State) or state._model is not self:
            raise ValueError("state is not a State of this model")
        if state.slot in self._free:
            raise ValueError(f"state (slot {state.slot}) was already released")
        self._free.append(state.slot)

    def forward(self, ids, state, *, all_logits=False):
        """Runs new tokens of one sequence (``state``) or of several (lists of ids and of states,
        one forward for the batch). Returns float32 logits: [vocab] for the last token ([T, vocab]
        with all_logits); for a batch, [N, vocab] (or the per-sequence arrays in a list)."""
        batch = isinstance(state, (list, tuple))
        states = list(state) if batch else [state]
        seqs = list(ids) if batch else [ids]
        if len(seqs) != len(states):
            raise ValueError(f"ids holds {len(seqs)} sequences for {len(states)} states")
        for s in states:
            if not isinstance(s, State) or s._model is not self:
                raise ValueError("state is not a State of this model (use model.new_state())")
        arrs = [_ids("ids", s, self.vocab_size) for s in seqs]
        tokens = np.concatenate(arrs)
        cu = np.zeros(len(arrs) + 1, dtype=np.int64)
        cu[1:] = np.cumsum([a.size for a in arrs])
        slots = np.array([s.slot for s in states], dtype=np.int32)
        rows = tokens.size if all_logits else len(arrs)
        logits = np.empty((rows, self.vocab_size), dtype=np.float32)
        self._native.forward(tokens, cu, slots, bool(all_logits), logits)
        if not batch:
            return logits if all_logits else logits[0]
        if all_logits:
            return [logits[cu[i]:cu[i + 1]] for i in range(len(arrs))]
        return logits

    def generate(self, prompt_ids, max_new_tokens=16, *, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                 stop_ids=None, state=None):
        """Prefill then sample (greedy when temperature = 0). Stops after an id of ``stop_ids``
        (default: the config's eos_token_id; [] never stops early). Returns the new ids (numpy int32)."""
        prompt = _ids("prompt_ids", prompt_ids, self.vocab_size)
        max_new_tokens = int_arg("max_new_tokens", max_new_tokens, 0, 1 << 20)
        top_k = int_arg("top_k", top_k, 0, 1 << 30)
        seed = int_arg("seed", seed, 0, (1 << 64) - 1)
        for name, v in (("temperature", temperature), ("top_p", top_p)):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
                raise ValueError(f"{name} = {v!r} must be a number")
        stop = list(self.info["eos_token_ids"]) if stop_ids is None else [int(i) for i in stop_ids]
        own = state is None
        st = self.new_state() if own else state
        try:
            out = self._native.generate(st.slot, prompt, max_new_tokens, float(temperature), top_k, float(top_p),
                                        seed, stop)
        finally:
            if own:
                self.release_state(st)
        return np.asarray(out, dtype=np.int32)
