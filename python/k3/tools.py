"""``k3.validate`` / ``k3.bench``: the `k3` tool's correctness matrix and benchmarks from Python,
returning the same records as the tool's ``--output`` JSON (the tool installed with the package
runs them; nothing is re-implemented here)."""

import json
import os
import subprocess
import sys
import tempfile

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


def validate(env=None, **options):
    """``k3 validate`` with the given options (``op="moe"``, ``suite="smoke"``, ``backend="cpu"``,
    ...; underscores become dashes). Returns the tool's JSON as a dict — ``records`` holds one
    entry per check with ``pass`` — plus ``exit_code`` (1 when a check failed) and ``log``.
    ``env`` adds environment variables (``{"K3_ISA": "avx2"}``)."""
    return _with_json(["validate"], options, env)


def bench(target="moe", env=None, **options):
    """``k3 bench TARGET`` (moe, kda, limits, ...) with the given options (``m=[1, 128]``,
    ``recipe="w4a8"``, ...). Returns the tool's JSON as a dict, plus ``exit_code`` and ``log``."""
    return _with_json(["bench", target], options, env)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_tool(*sys.argv[1:])[0])
