"""Checkpoint loading: one EP rank's experts of a Kimi-K3-format checkpoint layer."""

from . import _k3
from ._arrays import int_arg, path_arg
from . import moe as _moe


class MoeLayer:
    """One layer's experts for one EP rank, loaded from a checkpoint directory (config.json +
    safetensors, sharded or not). Arrays are numpy views of the loaded buffers (no copy):
    ``fc1_q``, ``fc1_scale``, ``fc2_q``, ``fc2_scale`` (uint8, checkpoint layout), ``router_bias``
    ([E] float32, or None), ``router_weight`` ([E, hidden_size] BF16 bits, or None); ``config`` is
    the dict of facts read from config.json."""

    def __init__(self, d):
        self.fc1_q, self.fc1_scale = d["fc1_q"], d["fc1_scale"]
        self.fc2_q, self.fc2_scale = d["fc2_q"], d["fc2_scale"]
        self.router_bias = d.get("router_bias")
        self.router_weight = d.get("router_weight")
        self.config = d["config"]
        self.layer = d["layer"]
        self._routing = d.get("routing")
        self._routing_error = d.get("routing_error")
        self._problem_error = d.get("problem_error")

    @property
    def weights(self):
        """The four expert tensors as keyword arguments of k3.moe.run / CpuMoe / FusedMoE."""
        return dict(fc1_q=self.fc1_q, fc1_scale=self.fc1_scale, fc2_q=self.fc2_q, fc2_scale=self.fc2_scale)

    def problem(self, recipe="w4a8", out_dtype="bf16"):
        """The fused-MoE problem of this layer: shape and activation from config.json."""
        if self._problem_error is not None:
            raise ValueError(self._problem_error)
        c = self.config
        return _moe.problem(hidden=c["hidden"], intermediate=c["intermediate"], num_experts=c["num_experts"],
                            top_k=c["top_k"], ep_size=c["ep_size"], ep_rank=c["ep_rank"], recipe=recipe,
                            activation=c["hidden_act"], out_dtype=out_dtype, situ_beta=c["situ_beta"],
                            situ_linear_beta=c["situ_linear_beta"])

    def routing(self):
        """Keyword arguments of k3.route / FusedMoE for this checkpoint's router. A checkpoint k3
        cannot route (scoring_func other than sigmoid) raises ValueError naming the value."""
        if self._routing is None:
            raise ValueError(self._routing_error)
        return dict(self._routing)

    def __repr__(self):
        c = self.config
        return (f"MoeLayer(layer {self.layer}, EP{c['ep_size']} rank {c['ep_rank']}: {self.fc1_q.shape[0]} experts, "
                f"K {c['hidden']}, N {c['intermediate']}, top-{c['top_k']}, {c['hidden_act']})")


def load_checkpoint_layer(path, layer, ep_size=1, ep_rank=0):
    """Loads layer ``layer``'s experts of EP rank ``ep_rank`` of ``ep_size`` (only that rank's
    experts are read; any ``ep_size`` up to the layer's expert count, the partition of
    :func:`k3.moe.expert_range`). Errors name the missing experts, tensor or config key (ValueError /
    RuntimeError with the library's message)."""
    path = path_arg("path", path)
    ep_size = int_arg("ep_size", ep_size, 1, 4096)
    return MoeLayer(_k3.load_checkpoint_layer(path, int_arg("layer", layer, 0, 2 ** 31 - 1), ep_size,
                                              int_arg("ep_rank", ep_rank, 0, ep_size - 1)))
