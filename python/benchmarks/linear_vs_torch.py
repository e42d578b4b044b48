"""k3's dense linear layer (MXFP8 weights, or with --recipe w16a16 the same BF16 weights) against
torch's BF16 F.linear, side by side on the same CPU and threads (the baseline of `k3 bench
linear`, which has no torch in C++).

Both sides rotate over copies of the weights (at least --pool-mib each) so that small M reads
them from memory; rounds interleave k3 and torch so that drift falls on both. k3 runs through
its Python object (CpuLinear.run on preallocated buffers, about 5 us of call overhead); torch
through F.linear(out=...). Prints a table and writes JSON.

    python python/benchmarks/linear_vs_torch.py --threads 2 -o linear_vs_torch.json
"""

import argparse
import json
import platform
import time

import numpy as np
import torch

import k3

SHAPES = ["1536x7168", "7168x3584", "3584x7168", "2304x4096", "4096x2304"]


def _time(fn, iters):
    fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--m", default="1,8,256")
    ap.add_argument("--recipe", default="w8a16", choices=["w8a16", "w8a8", "w16a16"],
                    help="k3's recipe; w16a16 serves the same BF16 weights as torch (the same bytes)")
    ap.add_argument("--threads", type=int, default=0, help="torch and k3 threads (default: torch's)")
    ap.add_argument("--isa", default="", help="k3's SIMD level (torch is not affected)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--pool-mib", type=int, default=256)
    ap.add_argument("-o", "--output", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    ms = [int(v) for v in a.m.split(",")]
    rng = np.random.default_rng(0)
    cases = []
    for s in a.shapes.split(","):
        k, n = (int(v) for v in s.split("x"))
        w = torch.from_numpy((rng.standard_normal((n, k)) * 0.02).astype(np.float32))
        codes, scales = k3.linear.quantize_weight(w.numpy())
        copies = max(1, (a.pool_mib << 20) // (n * k * 2) + 1)  # by torch's (larger) BF16 bytes
        wb = [w.to(torch.bfloat16).clone() for _ in range(copies)]
        if a.recipe == "w16a16":
            kl = [k3.linear.CpuLinear(b.view(torch.uint16).numpy(), None, recipe=a.recipe, max_tokens=max(ms),
                                      threads=threads, isa=a.isa) for b in wb]
        else:
            kl = [k3.linear.CpuLinear(codes.copy(), scales.copy(), recipe=a.recipe, max_tokens=max(ms),
                                      threads=threads, isa=a.isa) for _ in range(copies)]
        cases.append(dict(k=k, n=n, wb=wb, kl=kl))
    x_all = torch.randn(max(ms), max(c["k"] for c in cases)).to(torch.bfloat16)
    samples = {}
    for rnd in range(a.rounds):
        for c in cases:
            k, n = c["k"], c["n"]
            for m in ms:
                x = x_all[:m, :k].contiguous()
                xn = x.view(torch.uint16).numpy()
                out_t = torch.empty(m, n, dtype=torch.bfloat16)
                out_k = np.empty((m, n), dtype=np.uint16)
                iters = max(1, min(a.iters, int(2e10 / (2 * m * n * k))))
                it_t, it_k = iter(range(10 ** 9)), iter(range(10 ** 9))

                def run_torch():
                    i = next(it_t) % len(c["wb"])
                    torch.nn.functional.linear(x, c["wb"][i], out=out_t)

                def run_k3():
                    i = next(it_k) % len(c["kl"])
                    c["kl"][i].run(xn, out=out_k)

                for name, fn in (("torch", run_torch), ("k3", run_k3)) if rnd % 2 == 0 else (("k3", run_k3),
                                                                                               ("torch", run_torch)):
                    samples.setdefault((k, n, m, name), []).extend(_time(fn, iters))
    records = []
    print(f"{platform.processor() or 'cpu'}, {threads} threads, k3 plan: {cases[0]['kl'][0].plan}")
    print(f"{'K x N':>11} {'M':>5} | {'torch bf16 ms':>14} | {'k3 ' + a.recipe + ' ms':>14} | speed-up")
    for c in cases:
        for m in ms:
            t = sorted(samples[(c["k"], c["n"], m, "torch")])
            q = sorted(samples[(c["k"], c["n"], m, "k3")])
            tm, qm = t[len(t) // 2], q[len(q) // 2]
            print(f"{c['k']:5d}x{c['n']:<5d} {m:5d} | {tm * 1e3:14.3f} | {qm * 1e3:14.3f} | {tm / qm:6.2f}x")
            records.append(dict(k=c["k"], n=c["n"], m=m, torch_bf16=dict(median_s=tm, min_s=t[0], max_s=t[-1]),
                                k3=dict(median_s=qm, min_s=q[0], max_s=q[-1]), speedup=tm / qm))
    if a.output:
        with open(a.output, "w") as f:
            json.dump(dict(threads=threads, recipe=a.recipe, isa=a.isa or k3.info()["isa"], torch=torch.__version__,
                           cpu=k3.info().get("cpu", {}), rounds=a.rounds, pool_mib=a.pool_mib, records=records), f,
                      indent=1)
        print("JSON:", a.output)


if __name__ == "__main__":
    main()
