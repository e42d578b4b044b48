"""k3.validate / k3.bench (the tool's JSON records from Python) and `python -m k3 plot`."""

import json
import subprocess
import sys

import pytest

import k3


def test_validate_returns_the_tools_records():
    r = k3.validate(op="formats", suite="smoke")
    assert r["exit_code"] == 0, r["log"]
    assert r["records"] and all(rec["pass"] for rec in r["records"])
    assert {"case", "backend", "cosine", "nrmse", "digest"} <= set(r["records"][0])
    # A bad option is the tool's error, raised with its message.
    with pytest.raises(RuntimeError, match="--suite"):
        k3.validate(op="formats", suite="nonsense")


def test_bench_records_and_env():
    r = k3.bench("moe", m=[1], recipe="w4a16", hidden=64, intermediate=64, experts=4, top_k=2, ep_size=1, ep_rank=0,
                 routing="uniform", iters=2, bandwidth_mib=64, env={"K3_ISA": "scalar"})
    assert r["exit_code"] == 0, r["log"]
    rec = r["records"][0]
    assert rec["m"] == 1 and rec["isa"] == "scalar" and rec["recipe"] == "w4a16"
    assert rec["timing"]["median_s"] > 0


def fake_bench():
    recs = []
    for m in (1, 8, 128):
        t = 1e-3 * (1 + m / 16)
        recs.append({"backend": "cpu", "recipe": "w4a8", "isa": "avx2", "m": m, "timing": {"median_s": t},
                     "weight_bytes_per_call": 1e7, "flop_per_call": 2e5 * m, "GFLOPs": 2e5 * m / t / 1e9,
                     "fraction_of_read_bandwidth": 0.3, "fraction_of_dot_peak": 0.5 + m / 1000,
                     "bound": "memory" if m < 16 else "compute"})
    return {"machine": {"cpu": "test", "isa": "avx2", "threads": 2}, "read_bandwidth_Bps": {"value": 2e10},
            "dot_peak_flops": {"value": 1e11}, "records": recs}


def test_plot_writes_a_picture(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (plots are optional)")
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(fake_bench()))
    out = tmp_path / "bench.png"
    p = subprocess.run([sys.executable, "-m", "k3", "plot", str(src), "-o", str(out)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10000
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    p = subprocess.run([sys.executable, "-m", "k3", "plot", str(empty), "-o", str(out)], capture_output=True, text=True)
    assert p.returncode == 1 and "no records" in p.stderr
