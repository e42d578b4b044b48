"""k3 and torch sharing the cores: a patched Kimi-Linear model's decode and prefill with k3 at
torch's thread count (the default) against k3 forced to other counts.

    python python/benchmarks/hf_threads.py [--workdir DIR] [--output F.json]

Builds (or reuses in --workdir) the random preset model of ``python -m k3 hf`` (Kimi-Linear-48B
widths, 4 layers, 64 experts), then for each (torch threads, k3 threads) pair patches a fresh
BF16 copy and times greedy ``generate``: decode ms/token at batch 1 (median of 16 steps) and
prefill tokens/s at T = 128, two interleaved rounds. Also lists the OpenMP runtimes mapped into
the process (torch's and k3's ``libgomp.so.1`` resolve to one)."""

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

import k3.hf
from k3.hf_cli import _generate_times, _load, _machine, _random_checkpoint, bench_config


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--output", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        path = a.workdir or os.path.join(tmp, "model")
        if not os.path.isfile(os.path.join(path, "config.json")):
            _random_checkpoint(bench_config(), path)
        pairs = []
        for tt in sorted({1, cores}):
            pairs.append((tt, None))  # k3 follows torch
            pairs.append((tt, 2 * cores))  # k3 oversubscribed
        models = {}
        for tt, kt in pairs:
            torch.set_num_threads(tt)
            m = _load(path, "bfloat16")
            k3.hf.patch(m, threads=kt)
            models[(tt, kt)] = m
        gen = torch.Generator().manual_seed(3)
        dec_ids = torch.randint(3, 32000, (1, 16), generator=gen)
        pre_ids = torch.randint(3, 32000, (1, 128), generator=gen)
        raw = {p: {"decode": [], "prefill": []} for p in pairs}
        for _ in range(a.rounds):
            for p in pairs:
                torch.set_num_threads(p[0])
                _, steps = _generate_times(models[p], dec_ids, 16)
                raw[p]["decode"].extend(steps)
                pre, _ = _generate_times(models[p], pre_ids, 1)
                raw[p]["prefill"].append(pre)
        gomp = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line})
    rows = []
    print(f"OpenMP runtimes mapped: {gomp}")
    print(f"{'torch threads':>13} {'k3 threads':>22} {'decode ms/token':>16} {'prefill T=128 tok/s':>20}")
    for p in pairs:
        dec = statistics.median(raw[p]["decode"])
        pre = statistics.median(raw[p]["prefill"])
        k3_threads = f"{p[0]} (default: torch's)" if p[1] is None else f"{p[1]} (forced)"
        rows.append(dict(torch_threads=p[0], k3_threads=p[1] if p[1] is not None else p[0], default=p[1] is None,
                         decode_ms=dec * 1e3, prefill_tokens_per_s=128 / pre))
        print(f"{p[0]:>13} {k3_threads:>22} {dec * 1e3:>16.1f} {128 / pre:>20.1f}")
    if a.output:
        with open(a.output, "w") as f:
            json.dump(dict(machine=_machine(), openmp_runtimes=gomp, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
