"""``k3.validate`` / ``k3.bench``: the correctness matrix and benchmarks from Python, returning the
same records as ``k3 validate --output`` / ``k3 bench --output``. Both call the library's harness
in this process; only ``bench("comm")`` (a multi-rank run under mpirun) runs the `k3` tool
installed with the package."""

import json
import os
import subprocess
import sys
import tempfile

from . import _k3

__all__ = ["validate", "bench", "run_tool"]


def _tool():
    path = os.path.join(os.path.dirname(__file__), "bin", "k3")
    if not os.path.exists(path):
        raise RuntimeError(f"the k3 tool was not installed with this package ({path})")
    return path


def _flags(options):
    args = []
    for key, value in options.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif isinstance(value, (list, tuple)):
            args += [flag, ",".join(str(v) for v in value)]
        else:
            args += [flag, str(value)]
    return args


def run_tool(*args, env=None):
    """Runs ``k3 ARGS...``; returns (exit code, stdout + stderr)."""
    p = subprocess.run([_tool(), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=None if env is None else {**os.environ, **env})
    return p.returncode, p.stdout


def _with_json(sub, options, env):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        code, text = run_tool(*sub, *_flags(options), "--output", out, env=env)
        if not os.path.exists(out):
            raise RuntimeError(f"k3 {' '.join(sub)} failed (exit {code}):\n{text}")
        with open(out) as f:
            result = json.load(f)
    result["exit_code"] = code
    result["log"] = text
    return result


def validate(op="all", *, suite="all", backend="all", require=(), seed=20261129, recipe=None, activation=None,
             checkpoint=None, layer=1, ep_size=1, ep_rank=0, threads=None, isa=None, cuda_path=None):
    """The correctness matrix of ``k3 validate``, run in this process by the library's harness.

    ``op``: formats, kda, linear, moe or all; ``suite``: smoke, real, nonfinite, determinism or all;
    ``backend``: all, reference, cpu or cuda; ``require``: capabilities that must be present (a
    backend name, a recipe, an activation); ``recipe`` / ``activation`` / ``checkpoint`` (with
    ``layer``, ``ep_size``, ``ep_rank``) narrow ``op="moe"``. ``threads`` (default: all logical
    CPUs), ``isa`` ("avx2", ...; default: the best level) and ``cuda_path`` are the backends'
    options. Returns the document ``k3 validate --output`` writes — ``records`` holds one entry per
    check with ``pass`` and ``skipped`` — plus ``failed`` (the count of failed checks) and ``ok``.
    An unknown op, suite, ISA level or a bad thread count raises ``ValueError`` naming it; a failed
    check does not raise."""
    if isinstance(require, str):
        require = [require]
    options = {"suite": suite, "backend": backend, "require": list(require), "seed": seed, "recipe": recipe,
               "activation": activation, "checkpoint": os.fspath(checkpoint) if checkpoint else None,
               "layer": layer, "ep_size": ep_size, "ep_rank": ep_rank, "threads": threads, "isa": isa,
               "cuda_path": cuda_path}
    text, failed = _k3.validate(str(op), {k: v for k, v in options.items() if v is not None})
    result = json.loads(text)
    result["failed"] = failed
    result["ok"] = failed == 0
    return result


_HARNESS_BENCHES = ("moe", "kda", "linear", "limits")
_LIST_OPTIONS = ("shapes", "recipes")  # also given as one comma-joined string, as on the command line


def bench(target="moe", env=None, **options):
    """A benchmark of ``k3 bench TARGET``; returns the document ``k3 bench TARGET --output`` writes
    (``machine``, the limits measured in the same run, ``records``) as a dict.

    ``moe``, ``kda``, ``linear`` and ``limits`` run in this process through the library's harness;
    their options are the tool's flags with underscores (``m=[1, 128]``, ``recipe="w4a8"``,
    ``ep_size=32``, ``prefill_t=[64, 1024]``, ``shapes=["1536x7168"]`` or ``"1536x7168,7168x3584"``,
    ``torch_python="off"``, ``threads=2``, ``isa="avx2"``; default threads: all logical CPUs;
    ``linear``'s torch baseline runs in this interpreter, ``sys.executable``, unless told otherwise).
    An unknown option, a wrong type or a refused value raises (``ValueError`` / ``TypeError``)
    naming it. A device sweep that went on past a failed case returns its records with ``error``
    set. ``env`` is refused for these two: pass ``threads`` / ``isa`` instead.

    ``comm`` (a multi-rank benchmark, started under mpirun) runs the `k3` tool installed with the
    package (lists are comma-joined, ``env`` adds environment variables) and the dict also holds
    ``exit_code`` and ``log``."""
    if target in _HARNESS_BENCHES:
        if env:
            raise ValueError(f"k3.bench({target!r}): env is not used in process; pass threads= / isa= instead")
        opts = {}
        for key, value in options.items():
            if value is None:
                continue
            if key in _LIST_OPTIONS and isinstance(value, str):
                value = value.split(",")
            elif isinstance(value, os.PathLike):
                value = os.fspath(value)
            opts[key] = value
        if target == "linear":  # torch's baseline runs in this interpreter unless told otherwise
            opts.setdefault("torch_python", sys.executable)
        text, error = _k3.bench(target, opts)
        result = json.loads(text)
        result["ok"] = not error
        if error:
            result["error"] = error
        return result
    if target != "comm":
        raise ValueError(f"k3.bench: target {target!r} is not one of moe, kda, linear, limits, comm")
    return _with_json(["bench", target], options, env)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_tool(*sys.argv[1:])[0])
