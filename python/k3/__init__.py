"""k3: Kimi-K3 fused MoE, MX formats, routing and Kimi Delta Attention kernels.

Arrays are exchanged through DLPack (numpy, torch CPU tensors, ...) without copies: every
function accepts an ``out=`` array and writes into it; when none is given a numpy array is
allocated. Errors raise ``ValueError`` (bad argument: the message names it, the limit and the
value) or ``RuntimeError`` (anything else), carrying the library's message.

Sub-modules: :mod:`k3.mx` (MXFP4 / MXFP8), :mod:`k3.moe` (fused MoE), :mod:`k3.kda`,
:mod:`k3.linear` (dense MXFP8 linear layers),
:mod:`k3.torch` (torch custom ops and the FusedMoE module; import it explicitly, it needs torch).
"""

from . import _k3
from . import kda, linear, moe, mx
from .checkpoint import MoeLayer, load_checkpoint_layer
from .model import Model
from .routing import route
from .tools import bench, validate

__all__ = ["info", "Model", "route", "load_checkpoint_layer", "MoeLayer", "validate", "bench", "mx", "moe", "kda", "linear",
           "__version__"]
__version__ = "0.1.0"


def info() -> dict:
    """The CPU's SIMD level, the default thread count and every backend of each op with its
    availability (and the reason when it is not available)."""
    return _k3.info()
