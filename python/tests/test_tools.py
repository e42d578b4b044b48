"""k3.validate / k3.bench (the tool's JSON records from Python) and `python -m k3 plot`."""

import json
import subprocess
import sys

import pytest

import k3


def test_validate_runs_the_harness_in_process_with_the_tools_records(tmp_path):
    r = k3.validate(op="formats", suite="smoke")
    assert r["ok"] and r["failed"] == 0
    assert r["records"] and all(rec["pass"] for rec in r["records"])
    assert {"case", "backend", "cosine", "nrmse", "digest"} <= set(r["records"][0])
    # The same harness as `k3 validate`: the tool's --output records, digests included, are these.
    out = tmp_path / "v.json"
    code, log = k3.tools.run_tool("validate", "--op", "formats", "--suite", "smoke", "--output", out)
    assert code == 0, log
    tool = json.loads(out.read_text())
    assert [(x["case"], x["backend"], x["digest"]) for x in tool["records"]] == \
        [(x["case"], x["backend"], x["digest"]) for x in r["records"]]


def test_validate_options_reach_the_backends_and_bad_ones_name_themselves():
    # isa / threads are the backends' options: the linear determinism row names the levels it ran.
    r = k3.validate(op="moe", suite="determinism", backend="cpu", recipe="w4a16", activation="silu", isa="scalar",
                    threads=1)
    assert r["ok"], [x for x in r["records"] if not x["pass"]]
    assert any("1, 2, 3 threads" in x["note"] for x in r["records"])
    with pytest.raises(ValueError, match="--suite 'nonsense'"):
        k3.validate(op="formats", suite="nonsense")
    with pytest.raises(ValueError, match="--op nope is not known"):
        k3.validate(op="nope")
    with pytest.raises(ValueError, match="avx9"):
        k3.validate(op="formats", suite="smoke", isa="avx9")
    # The binding takes its options through k3.bench's table: wrong types and unknown keys name themselves.
    with pytest.raises(TypeError, match="k3.validate: option 'threads' has the wrong type"):
        k3.validate(op="formats", suite="smoke", threads="two")
    with pytest.raises(ValueError, match=r"k3.validate: unknown option 'sweet' \(known: suite, backend"):
        k3._k3.validate("formats", {"sweet": "smoke"})
    # A missing capability is a FAIL row, not an exception.
    r = k3.validate(op="moe", suite="smoke", backend="cpu", recipe="w4a16", activation="silu", require="no-such-cap")
    assert not r["ok"] and r["failed"] >= 1
    assert any(x["case"] == "require no-such-cap" and not x["pass"] for x in r["records"])


def test_bench_moe_runs_the_harness_in_process():
    r = k3.bench("moe", m=[1, 3], recipe="w4a16", hidden=64, intermediate=64, experts=4, top_k=2, ep_size=1, ep_rank=0,
                 routing="uniform", iters=2, bandwidth_mib=64, isa="scalar", threads=1)
    assert r["ok"] and "error" not in r
    assert r["machine"]["isa"] == "scalar" and r["machine"]["threads"] == 1
    assert [rec["m"] for rec in r["records"]] == [1, 3]
    rec = r["records"][0]
    assert rec["isa"] == "scalar" and rec["recipe"] == "w4a16" and rec["kernel"] == "portable"  # the scalar level's kernel
    assert rec["timing"]["median_s"] > 0 and rec["timing"]["iterations"] == 2
    # The traffic model: M = 1 with top-2 of 4 experts streams the 2 experts' MXFP4 bytes once.
    expert_bytes = 3 * 64 * 64 // 2 + 3 * 64 * 64 // 32
    assert rec["weight_bytes_per_call"] == 2 * expert_bytes
    assert r["read_bandwidth_Bps"]["value"] > 0 and r["dot_peak_flops"]["value"] > 0


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.mark.skipif(k3.info()["isa"] == "scalar", reason="needs an AVX2 CPU")
def test_bench_moe_avx_vnni_option_picks_the_integer_form():
    small = dict(m=[1], recipe="w4a8", hidden=64, intermediate=64, experts=4, top_k=2, ep_size=1, ep_rank=0,
                 routing="uniform", iters=1, bandwidth_mib=64, isa="avx2", threads=1)
    off = k3.bench("moe", avx_vnni=False, **small)
    assert off["ok"] and off["records"][0]["kernel"] == "avx2 fma + int16 madd"
    on = k3.bench("moe", avx_vnni=True, **small)
    want = "avx2 fma + int16 vpdpwssd (avx-vnni)" if "avx_vnni" in _cpu_flags() else "avx2 fma + int16 madd"
    assert on["ok"] and on["records"][0]["kernel"] == want
    with pytest.raises(TypeError, match="option 'avx_vnni' has the wrong type"):
        k3.bench("moe", avx_vnni="maybe")


def test_bench_kda_runs_the_harness_in_process():
    r = k3.bench("kda", heads=2, head_dim=32, prefill_t=[16], decode_n=4, verify_n=[2], iters=2, pool_mib=1, bw_mib=16,
                 threads=1)
    assert r["ok"]
    kinds = [rec["kind"] for rec in r["records"]]
    assert kinds == ["prefill", "decode", "verify"]
    pre = r["records"][0]
    assert pre["recurrent_flop"] == 16 * 2 * 7 * 32 * 32  # T H 7 K V
    assert pre["chunked"]["median_s"] > 0 and pre["recurrent_over_chunked_median_ratio"] > 0


def test_bench_limits_in_process():
    r = k3.bench("limits", threads=1, buffer_mib=64)
    assert r["ok"] and r["machine"]["threads"] == 1
    for key in ("read_bandwidth_Bps", "dot_peak_flops", "fp32_fma_peak_flops"):
        assert r[key]["value"] > 0 and r[key]["min"] <= r[key]["median"] <= r[key]["value"]
    with pytest.raises(ValueError, match="--buffer-mib 1 must be in"):
        k3.bench("limits", buffer_mib=1)


def test_bench_linear_in_process_without_the_torch_baseline():
    r = k3.bench("linear", shapes=["96x64"], recipes="w8a8", m=[1, 3], rounds=1, iters=1, pool_mib=1, bw_mib=16,
                 threads=1, torch_python="off")
    assert r["ok"] and r["torch"] == {"not_run": "--torch-python off"}
    assert [(x["k"], x["n"], x["m"]) for x in r["records"]] == [(96, 64, 1), (96, 64, 3)]
    assert all(x["torch_bf16"] is None for x in r["records"])
    # The bytes model: MXFP8 weights N K (1 + 1/32), plus x and y in BF16.
    assert r["records"][0]["bytes"] == 64 * 96 * 33 // 32 + 1 * (96 + 64) * 2


def test_bench_options_are_checked_naming_them():
    with pytest.raises(ValueError, match="unknown option 'bogus'"):
        k3.bench("moe", bogus=1)
    with pytest.raises(TypeError, match="option 'hidden' has the wrong type"):
        k3.bench("moe", hidden="big")
    with pytest.raises(ValueError, match="--recipe"):
        k3.bench("moe", m=[1], recipe="w2a2")
    with pytest.raises(ValueError, match="--prefill-t 0 must be in"):
        k3.bench("kda", prefill_t=[0])
    with pytest.raises(ValueError, match="avx9"):
        k3.bench("kda", isa="avx9")
    with pytest.raises(ValueError, match="--shapes: '96y64' is not KxN"):
        k3.bench("linear", shapes="96y64")
    with pytest.raises(ValueError, match="target .nope. is not one of"):
        k3.bench("nope")
    with pytest.raises(ValueError, match="env is not used"):
        k3.bench("moe", env={"K3_ISA": "scalar"})
    with pytest.raises(RuntimeError, match="built without CUDA|cuda"):
        k3.bench("kda", backend="cuda", prefill_t=[16], decode_n=[1], verify_n=[0])


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
