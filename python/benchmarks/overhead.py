"""Per-call overhead of k3.moe.CpuMoe.run from Python over the C++ run() on the same buffers.

A tiny problem (K = N = 32, 1 expert, top-1, M = 1) keeps the kernel time small, so the
difference between the Python call and the C++ call is the binding's cost: argument checks,
DLPack conversion, GIL release. Prints both medians and the overhead in microseconds.
Usage: python python/benchmarks/overhead.py [--iters 20000] [--torch]
"""

import argparse
import time

import numpy as np

import k3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--torch", action="store_true", help="also time torch tensors and torch.ops.k3.moe_run")
    a = ap.parse_args()
    rng = np.random.default_rng(1)
    k = n = 32
    p = k3.moe.problem(hidden=k, intermediate=n, num_experts=1, top_k=1, out_dtype="bf16")
    w = dict(fc1_q=rng.integers(0, 256, (1, 2 * n, k // 2), dtype=np.uint8),
             fc1_scale=np.full((1, 2 * n, k // 32), 120, np.uint8),
             fc2_q=rng.integers(0, 256, (1, k, n // 2), dtype=np.uint8),
             fc2_scale=np.full((1, k, n // 32), 120, np.uint8))
    layer = k3.moe.CpuMoe(p, **w, max_tokens=1, threads=1)
    x = np.zeros((1, k), np.uint16)
    ids = np.zeros((1, 1), np.int32)
    wts = np.ones((1, 1), np.float32)
    out = np.empty((1, k), np.uint16)
    native = layer._native.time_native(x, ids, wts, 1, out, a.iters)

    def median_call(fn):
        t = []
        for _ in range(a.iters):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
        return float(np.median(t))

    py = median_call(lambda: layer.run(x, ids, wts, out=out))
    print(f"C++ cpu::run                : {native * 1e6:8.2f} us (median of {a.iters})")
    print(f"k3.moe.CpuMoe.run (numpy)   : {py * 1e6:8.2f} us   overhead {(py - native) * 1e6:6.2f} us")
    if a.torch:
        import torch
        import k3.torch as k3t
        tx, tids, twts = torch.zeros((1, k), dtype=torch.bfloat16), torch.from_numpy(ids), torch.from_numpy(wts)
        tout = torch.empty((1, k), dtype=torch.bfloat16)
        xb, ob = tx.view(torch.uint16), tout.view(torch.uint16)
        pt = median_call(lambda: layer.run(xb, tids, twts, out=ob))
        print(f"k3.moe.CpuMoe.run (torch)   : {pt * 1e6:8.2f} us   overhead {(pt - native) * 1e6:6.2f} us")
        h = k3t.prepare_moe(p, **w, max_tokens=1, threads=1)
        op = median_call(lambda: torch.ops.k3.moe_run(h, tx, tids, twts, tout))
        print(f"torch.ops.k3.moe_run        : {op * 1e6:8.2f} us   overhead {(op - native) * 1e6:6.2f} us")


if __name__ == "__main__":
    main()
