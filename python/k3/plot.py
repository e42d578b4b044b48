"""``python -m k3 plot bench.json -o bench.png``: a `k3 bench moe` sweep against the machine's
limits measured in the same run — time per call, the fraction of the read bandwidth or of the
dot-product peak per M (one line per backend / recipe), and a roofline view. Needs matplotlib."""

import argparse
import json
import math
import sys

__all__ = ["plot_bench", "main"]


def _series(records):
    groups = {}
    for r in records:
        key = f"{r.get('backend', '?')} {r.get('recipe', '')} {r.get('isa', '')}".strip()
        groups.setdefault(key, []).append(r)
    for rs in groups.values():
        rs.sort(key=lambda r: r["m"])
    return groups


def plot_bench(bench, output):
    """bench: the dict of `k3 bench moe --output` (or a path to it). Writes the picture to
    ``output`` (any matplotlib format) and returns the path."""
    if isinstance(bench, str):
        with open(bench) as f:
            bench = json.load(f)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("plotting needs matplotlib (pip install matplotlib)") from e
    records = bench.get("records", [])
    if not records:
        raise ValueError("the bench file has no records (write one with `k3 bench moe --output F.json`)")
    bw = bench.get("read_bandwidth_Bps", {}).get("value")
    peak = bench.get("dot_peak_flops", {}).get("value")
    machine = bench.get("machine", {})
    fig, (ax_t, ax_f, ax_r) = plt.subplots(1, 3, figsize=(16, 4.8))
    for name, rs in _series(records).items():
        ms = [r["m"] for r in rs]
        ax_t.plot(ms, [r["timing"]["median_s"] * 1e3 for r in rs], "o-", label=name)
        frac = [r["fraction_of_read_bandwidth"] if r.get("bound") == "memory" else r["fraction_of_dot_peak"] for r in rs]
        ax_f.plot(ms, [100 * f for f in frac], "o-", label=name)
        ai = [r["flop_per_call"] / max(r["weight_bytes_per_call"], 1) for r in rs]
        ax_r.plot(ai, [r["GFLOPs"] for r in rs], "o", label=name)
        for x, y, m in zip(ai, [r["GFLOPs"] for r in rs], ms):
            ax_r.annotate(f"M={m}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax_t.set(xscale="log", yscale="log", xlabel="M (tokens)", ylabel="median time per call (ms)", title="time")
    ax_f.set(xscale="log", xlabel="M (tokens)", ylabel="% of the measured limit",
             title="% of read bandwidth (memory-bound M) or dot peak")
    ax_f.axhline(100, color="gray", lw=0.8)
    if bw and peak:
        lo = min(r["flop_per_call"] / max(r["weight_bytes_per_call"], 1) for r in records) / 2
        hi = max(r["flop_per_call"] / max(r["weight_bytes_per_call"], 1) for r in records) * 2
        xs = [lo * (hi / lo) ** (i / 63) for i in range(64)]
        ax_r.plot(xs, [min(bw * x, peak) / 1e9 for x in xs], "k--", lw=1,
                  label=f"roof: {bw / 1e9:.1f} GB/s, {peak / 1e9:.0f} GFLOP/s")
    ax_r.set(xscale="log", yscale="log", xlabel="FLOP per weight byte", ylabel="GFLOP/s", title="roofline (measured limits)")
    for ax in (ax_t, ax_f, ax_r):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    title = f"k3 bench moe — {machine.get('cpu', '?')}, isa {machine.get('isa', '?')}, {machine.get('threads', '?')} threads"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m k3 plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_json")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args(argv)
    try:
        print(plot_bench(a.bench_json, a.output))
    except (OSError, ValueError, RuntimeError, KeyError, json.JSONDecodeError) as e:
        print(f"python -m k3 plot: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
