"""pytest suite of the k3 Python package: each op against an independent numpy definition or the
library's FP64 oracle backend, zero-copy outputs, error mapping, and (when torch is installed)
torch tensors through DLPack."""

import sys
import threading

import numpy as np
import pytest

import k3

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)


def np_mxfp4_quantize(x):
    """Independent MXFP4 (RCEIL) definition: code = ceil(log2(amax / 6)) + 127 on the FP32 quotient,
    elements = round-to-nearest-even E2M1 of x / 2^(code - 127), saturating at 6."""
    rows, cols = x.shape
    q = np.zeros((rows, cols // 2), np.uint8)
    s = np.zeros((rows, cols // 32), np.uint8)
    for r in range(rows):
        for b in range(cols // 32):
            blk = x[r, 32 * b:32 * b + 32].astype(np.float64)
            v = np.float32(np.float32(np.abs(x[r, 32 * b:32 * b + 32]).max()) / np.float32(6.0))
            m, e = np.frexp(np.float64(v))
            code = (e - 1 if m == 0.5 else e) + 127
            s[r, b] = code
            scaled = blk / 2.0 ** (code - 127)
            codes = []
            for val in scaled:
                a = min(abs(val), 6.0)
                d = np.abs(E2M1 - a)
                best = np.flatnonzero(d == d.min())
                idx = best[0] if len(best) == 1 else [i for i in best if i % 2 == 0][0]
                codes.append(idx | (8 if np.signbit(val) else 0))  # -0 keeps its sign, as NVIDIA's cvt
            for i in range(16):
                q[r, 16 * b + i] = codes[2 * i] | (codes[2 * i + 1] << 4)
    return q, s


def np_mxfp4_dequantize(q, s, cols):
    rows = q.shape[0]
    out = np.zeros((rows, cols), np.float64)
    for r in range(rows):
        for c in range(cols):
            byte = q[r, c // 2]
            code = byte & 0xF if c % 2 == 0 else byte >> 4
            mag = E2M1[code & 7] * (-1 if code & 8 else 1)
            out[r, c] = mag * 2.0 ** (int(s[r, c // 32]) - 127)
    return out


def test_info_lists_the_backends_with_reasons():
    i = k3.info()
    assert i["isa"] in ("scalar", "avx2", "avx512", "avx512bf16")
    assert [b["name"] for b in i["moe_backends"]] == ["cpu", "cuda", "reference"]
    for b in i["moe_backends"] + i["kda_backends"]:
        assert b["available"] or b["reason"], b


def test_mxfp4_quantize_matches_an_independent_definition_bit_for_bit():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 128)) * np.exp(rng.uniform(-8, 8, (6, 1)))).astype(np.float32)
    q, s = k3.mx.quantize(x, "mxfp4", "rceil")
    rq, rs = np_mxfp4_quantize(x)
    np.testing.assert_array_equal(s, rs)
    np.testing.assert_array_equal(q, rq)
    d = k3.mx.dequantize(q, s, 128, "mxfp4")
    np.testing.assert_array_equal(d.astype(np.float64), np_mxfp4_dequantize(q, s, 128))


def test_outputs_are_written_in_place_zero_copy():
    x = np.ones((2, 64), np.float32)
    q = np.full((2, 32), 0xAA, np.uint8)
    s = np.zeros((2, 2), np.uint8)
    q2, s2 = k3.mx.quantize(x, q=q, scales=s)
    assert q2 is q and s2 is s
    assert (s == 125).all()  # 1 / 6 -> 2^-2 (RCEIL), code 125
    view = np.zeros((4, 32), np.uint8)[::2]  # not contiguous: refused, never silently copied
    with pytest.raises((ValueError, TypeError)):
        k3.mx.quantize(x, q=view, scales=s)


def test_errors_raise_with_the_librarys_message():
    with pytest.raises(ValueError, match="cols = 33"):
        k3.mx.quantize(np.ones((1, 33), np.float32), q=np.zeros((1, 16), np.uint8), scales=np.zeros((1, 1), np.uint8))
    with pytest.raises(ValueError, match="element = 'mxfp5'"):
        k3.mx.quantize(np.ones((1, 32), np.float32), element="mxfp5")
    with pytest.raises(ValueError, match="top_k"):
        k3.route(np.zeros((1, 8), np.float32), top_k=9)


def test_route_matches_numpy_sigmoid_top_k():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((5, 64)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(64)).astype(np.float32)
    ids, w = k3.route(logits, bias, top_k=8)
    sig = 1 / (1 + np.exp(-logits.astype(np.float64)))
    for t in range(5):
        want = np.argsort(-(sig[t] + bias), kind="stable")[:8]
        np.testing.assert_array_equal(ids[t], want)
        np.testing.assert_allclose(w[t], sig[t][want] / sig[t][want].sum(), rtol=1e-6)


def random_moe(m=6, k=64, n=96, e=8, top_k=2, seed=3, out_dtype="fp32"):
    rng = np.random.default_rng(seed)
    p = k3.moe.problem(hidden=k, intermediate=n, num_experts=e, top_k=top_k, out_dtype=out_dtype)
    w = dict(fc1_q=rng.integers(0, 256, (e, 2 * n, k // 2), dtype=np.uint8),
             fc1_scale=rng.integers(120, 124, (e, 2 * n, k // 32), dtype=np.uint8),
             fc2_q=rng.integers(0, 256, (e, k, n // 2), dtype=np.uint8),
             fc2_scale=rng.integers(120, 124, (e, k, n // 32), dtype=np.uint8))
    x = (rng.standard_normal((m, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # BF16 bits
    ids = np.stack([rng.permutation(e)[:top_k] for _ in range(m)]).astype(np.int32)
    wts = rng.uniform(0.1, 1, (m, top_k)).astype(np.float32)
    return p, w, x, ids, wts


def test_moe_cpu_matches_the_fp64_oracle_and_the_planned_form_is_identical():
    p, w, x, ids, wts = random_moe()
    ref = k3.moe.run(p, **w, x=x, topk_ids=ids, topk_weights=wts, backend="reference")
    got = k3.moe.run(p, **w, x=x, topk_ids=ids, topk_weights=wts, backend="cpu")
    assert np.sqrt(((got - ref) ** 2).sum() / (ref ** 2).sum()) < 1e-5
    layer = k3.moe.CpuMoe(p, **w, max_tokens=16, threads=2)
    assert "cpu moe" in layer.plan
    out = np.full((6, 64), np.nan, np.float32)
    assert layer.run(x, ids, wts, out=out) is out
    np.testing.assert_array_equal(out, got)


def test_prepared_moe_goes_through_the_registry_for_any_backend():
    p, w, x, ids, wts = random_moe()
    for name in ("cpu", "reference"):
        want = k3.moe.run(p, **w, x=x, topk_ids=ids, topk_weights=wts, backend=name)
        layer = k3.moe.PreparedMoe(p, **w, max_tokens=8, backend=name)
        assert layer.backend == name and layer.max_tokens == 8
        assert layer.kernel == ("fp64 oracle" if name == "reference" else k3.moe.CpuMoe(p, **w).kernel)
        np.testing.assert_array_equal(layer.run(x, ids, wts), want)
        np.testing.assert_array_equal(layer.run(x[:2], ids[:2], wts[:2]), want[:2])  # rows are independent
        with pytest.raises(ValueError, match="m = 9"):
            layer.run(np.concatenate([x, x[:3]]), np.concatenate([ids, ids[:3]]), np.concatenate([wts, wts[:3]]))
    with pytest.raises(ValueError, match="moe backend 'tpu' is not known"):
        k3.moe.PreparedMoe(p, **w, backend="tpu")
    assert k3.moe.PreparedMoe(p, **w).backend == "cpu"  # the registry's default


def test_read_bandwidth_probe_is_the_harness_probe_and_checks_its_arguments():
    r = k3._k3.read_bandwidth(1, 64)
    assert r["value"] > 1e8 and r["min"] <= r["median"] <= r["max"] == r["value"]
    assert "read bandwidth" in r["what"]
    with pytest.raises(ValueError, match="mib = 8 must be in"):
        k3._k3.read_bandwidth(1, 8)
    with pytest.raises(ValueError, match="threads = -1 must be in"):
        k3._k3.read_bandwidth(-1, 64)


def test_moe_errors_name_the_backend_and_shape():
    p, w, x, ids, wts = random_moe()
    with pytest.raises(ValueError, match="known: cpu, cuda, reference"):
        k3.moe.run(p, **w, x=x, topk_ids=ids, topk_weights=wts, backend="tpu")
    with pytest.raises(ValueError, match="fc1_q has shape"):
        k3.moe.run(p, w["fc1_q"][:1], w["fc1_scale"], w["fc2_q"], w["fc2_scale"], x, ids, wts)
    cuda = [b for b in k3.info()["moe_backends"] if b["name"] == "cuda"][0]
    if not cuda["available"]:
        with pytest.raises(RuntimeError):
            k3.moe.run(p, **w, x=x, topk_ids=ids, topk_weights=wts, backend="cuda")


def test_moe_runs_concurrently_from_threads_with_the_same_bits():
    p, w, x, ids, wts = random_moe(m=32)
    layer = k3.moe.CpuMoe(p, **w, max_tokens=32, threads=1)
    want = k3.moe.run(p, **w, x=x, topk_ids=ids, topk_weights=wts, backend="cpu", threads=1)
    outs = [np.zeros((32, 64), np.float32) for _ in range(4)]
    ts = [threading.Thread(target=layer.run, args=(x, ids, wts, o)) for o in outs]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for o in outs:
        np.testing.assert_array_equal(o, want)


def test_kda_prefill_cpu_matches_the_reference_for_fp32_and_bf16():
    rng = np.random.default_rng(4)
    t, h, d = 21, 2, 16
    q, k, v = (rng.standard_normal((t, h, d)).astype(np.float32) for _ in range(3))
    g = (-0.1 + 0.05 * rng.standard_normal((t, h, d))).astype(np.float32)
    beta = rng.standard_normal((t, h)).astype(np.float32)
    cu = np.array([0, 4, 21], np.int64)
    ref, _ = k3.kda.prefill(q, k, v, g, beta, cu_seqlens=cu, gate="log_decay", backend="reference")
    o, st = k3.kda.prefill(q, k, v, g, beta, cu_seqlens=cu, gate="log_decay", return_final_state=True)
    assert st.shape == (2, h, d, d)
    assert np.sqrt(((o - ref) ** 2).sum() / (ref ** 2).sum()) < 1e-5
    bf = [(a.view(np.uint32) >> 16).astype(np.uint16) for a in (q, k, v)]
    ob, _ = k3.kda.prefill(*bf, g, beta, cu_seqlens=cu, gate="log_decay")
    assert np.sqrt(((ob - ref) ** 2).sum() / (ref ** 2).sum()) < 2e-2
    with pytest.raises(RuntimeError, match="no CUDA backend|built without CUDA|CUDA device"):
        k3.kda.prefill(q, k, v, g, beta, cu_seqlens=cu, gate="log_decay", backend="cuda")


def test_torch_tensors_pass_through_dlpack():
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 64, dtype=torch.float32)
    q = torch.zeros(2, 32, dtype=torch.uint8)
    s = torch.zeros(2, 2, dtype=torch.uint8)
    k3.mx.quantize(x, q=q, scales=s)
    rq, rs = k3.mx.quantize(x.numpy())
    assert (q.numpy() == rq).all() and (s.numpy() == rs).all()


def synth_checkpoint(tmp_path):
    """A small Kimi-K3-format checkpoint written by the packaged `k3` tool."""
    import subprocess
    import sys
    d = tmp_path / "ckpt"
    subprocess.run([sys.executable, "-m", "k3", "checkpoint", "synth", "-o", str(d), "--hidden", "64",
                    "--expert-hidden", "64", "--intermediate", "32", "--num-experts", "16", "--top-k", "4",
                    "--seed", "3"], check=True, capture_output=True)
    return d


def test_load_checkpoint_layer_reads_one_ranks_experts_without_copies(tmp_path):
    d = synth_checkpoint(tmp_path)
    full = k3.load_checkpoint_layer(d, 1)
    half = k3.load_checkpoint_layer(d, 1, ep_size=2, ep_rank=1)
    assert "EP2 rank 1: 8 experts, K 64, N 32, top-4, situ" in repr(half)
    assert half.fc1_q.shape == (8, 64, 32) and half.fc2_scale.shape == (8, 64, 1)
    np.testing.assert_array_equal(half.fc1_q, full.fc1_q[8:])
    np.testing.assert_array_equal(half.fc2_scale, full.fc2_scale[8:])
    assert half.router_bias.shape == (16,) and half.router_bias.dtype == np.float32
    assert not half.fc1_q.flags.owndata  # a view of the loaded buffer
    p = half.problem(recipe="w4a16", out_dtype="fp32")
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((5, 16)).astype(np.float32)
    ids, wts = k3.route(logits, half.router_bias, **half.routing())
    x = (rng.standard_normal((5, 64)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    ref = k3.moe.run(p, **half.weights, x=x, topk_ids=ids, topk_weights=wts, backend="reference")
    got = k3.moe.run(p, **half.weights, x=x, topk_ids=ids, topk_weights=wts, backend="cpu")
    assert np.sqrt(((got - ref) ** 2).sum() / max((ref ** 2).sum(), 1e-30)) < 1e-5
    with pytest.raises((ValueError, RuntimeError), match="layer"):
        k3.load_checkpoint_layer(d, 7)
    # Uneven partitions: 16 experts on 3 ranks are 6 + 5 + 5, contiguous, and tile the layer.
    parts = [k3.load_checkpoint_layer(d, 1, ep_size=3, ep_rank=r) for r in range(3)]
    assert [k3.moe.expert_range(16, 3, r) for r in range(3)] == [(0, 6), (6, 5), (11, 5)]
    assert [q.fc1_q.shape[0] for q in parts] == [6, 5, 5]
    np.testing.assert_array_equal(np.concatenate([q.fc1_q for q in parts]), full.fc1_q)
    np.testing.assert_array_equal(np.concatenate([q.fc2_scale for q in parts]), full.fc2_scale)
    p2 = parts[2].problem()
    assert (p2.first_expert, p2.local_experts) == (11, 5)
    with pytest.raises(ValueError, match=r"ep_size = 17 must be in \[1, num_experts = 16\]"):
        k3.load_checkpoint_layer(d, 1, ep_size=17, ep_rank=0)
    with pytest.raises(ValueError, match=r"ep_size = 17 must be in \[1, 16\]"):
        k3.moe.expert_range(16, 17, 0)


def test_checkpoint_the_library_cannot_route_or_run_says_why(tmp_path):
    import json
    d = synth_checkpoint(tmp_path)
    cfg_path = d / "config.json"
    cfg = json.loads(cfg_path.read_text())
    text = cfg.get("text_config", cfg)
    text["moe_router_activation_func"] = "softmax"
    text["hidden_act"] = "gelu"
    cfg_path.write_text(json.dumps(cfg))
    layer = k3.load_checkpoint_layer(d, 1)
    with pytest.raises(ValueError, match="scoring_func = 'softmax' cannot be routed by k3"):
        layer.routing()
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not a fused-MoE activation"):
        layer.problem()


def test_type_stub_is_the_generated_one():
    """python/k3/_k3.pyi is nanobind.stubgen's output for the built extension: every public name
    is in it, and its set of signature lines (def / class / decorator lines, as stubgen writes
    them now) equals a fresh run's."""
    import os
    import subprocess
    import sys
    import tempfile
    stub = open(os.path.join(os.path.dirname(k3.__file__), "_k3.pyi")).read()
    public = [n for n in dir(k3._k3) if not n.startswith("_")]
    missing = [n for n in public if f"def {n}(" not in stub and f"class {n}" not in stub]
    regen = "regenerate it: python -m nanobind.stubgen -m k3._k3 -o python/k3/_k3.pyi (keep the header)"
    assert not missing, f"python/k3/_k3.pyi lacks {missing}: {regen}"
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "_k3.pyi")
        subprocess.run([sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "k3._k3", "-o", out], check=True)
        fresh = open(out).read()

    def signatures(text):
        return sorted(line.strip() for line in text.splitlines()
                      if line.strip().startswith(("def ", "class ", "@")))
    assert signatures(stub) == signatures(fresh), f"python/k3/_k3.pyi differs from stubgen's output: {regen}"
    assert os.path.exists(os.path.join(os.path.dirname(k3.__file__), "py.typed"))


def kda_step_case(n, t, h=2, d=16, seed=6):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((n * t, h, d)).astype(np.float32) for _ in range(3))
    g = (-0.1 + 0.05 * rng.standard_normal((n * t, h, d))).astype(np.float32)
    beta = rng.standard_normal((n * t, h)).astype(np.float32)
    states = (0.1 * rng.standard_normal((n, h, d, d))).astype(np.float32)
    return q, k, v, g, beta, states


def test_kda_decode_equals_one_token_prefill_and_updates_the_pool_in_place():
    n, h, d = 3, 2, 16
    q, k, v, g, beta, states = kda_step_case(n, 1)
    cu = np.arange(n + 1, dtype=np.int64)
    want_o, want_state = k3.kda.prefill(q, k, v, g, beta, cu_seqlens=cu, initial_state=states, gate="log_decay",
                                        return_final_state=True)
    pool = np.zeros((6, h, d, d), np.float32)
    slots = np.array([4, 0, 2], np.int32)
    pool[slots] = states
    untouched = pool[[1, 3, 5]].copy()
    o = k3.kda.decode(q, k, v, g, beta, pool, slots, gate="log_decay")
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pool[slots], want_state, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(pool[[1, 3, 5]], untouched)
    with pytest.raises(ValueError, match="state_indices has dtype int64, expected int32"):
        k3.kda.decode(q, k, v, g, beta, pool, np.array([4, 0, 2], np.int64), gate="log_decay")
    with pytest.raises(RuntimeError, match="no decode entry"):
        k3.kda.decode(q, k, v, g, beta, pool, slots, gate="log_decay", backend="reference")


def test_kda_verify_writes_every_prefix_state():
    n, t, h, d = 2, 4, 2, 16
    q, k, v, g, beta, states = kda_step_case(n, t)
    pool = np.zeros((n * t + 2, h, d, d), np.float32)
    idx = np.arange(n * t, dtype=np.int32).reshape(n, t)
    accepted = np.array([1, 1], np.int32)  # read slot idx[n, 0]
    pool[idx[:, 0]] = states
    o = k3.kda.verify(q, k, v, g, beta, pool, idx, accepted, gate="log_decay")
    cu = np.arange(0, n * t + 1, t, dtype=np.int64)
    want_o, want_last = k3.kda.prefill(q, k, v, g, beta, cu_seqlens=cu, initial_state=states, gate="log_decay",
                                       return_final_state=True)
    np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(pool[idx[:, t - 1]], want_last, rtol=1e-4, atol=1e-5)


def _linear_case(n=37, k=96, m=5, bias=True, seed=3):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
    codes, scales = k3.linear.quantize_weight(w)
    x = (rng.standard_normal((m, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # BF16 bits
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    return w, codes, scales, x, b


@pytest.mark.parametrize("recipe", ["w8a16", "w8a8"])
@pytest.mark.parametrize("out_dtype", ["bf16", "fp16", "fp32"])
def test_linear_cpu_gives_the_contracts_bits_and_agrees_with_fp64(recipe, out_dtype):
    w, codes, scales, x, b = _linear_case()
    ref = k3.linear.run(codes, scales, x, bias=b, recipe=recipe, out_dtype=out_dtype, backend="reference")
    for isa in [""] + (["avx2", "scalar"] if k3.info()["isa"] != "scalar" else []):
        got = k3.linear.run(codes, scales, x, bias=b, recipe=recipe, out_dtype=out_dtype, backend="cpu", isa=isa)
        np.testing.assert_array_equal(got, ref)
    layer = k3.linear.CpuLinear(codes, scales, bias=b, recipe=recipe, out_dtype=out_dtype, max_tokens=8)
    out = np.zeros_like(ref)
    assert layer.run(x, out=out) is out
    np.testing.assert_array_equal(out, ref)
    assert "K 96 -> N 37" in layer.plan
    # An independent FP64 computation (numpy) of W8A16 with the dequantized MXFP8 weights.
    if recipe == "w8a16" and out_dtype == "fp32":
        wq = k3.mx.dequantize(codes, scales, 96, "mxfp8").astype(np.float64)
        xf = (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        y = xf @ wq.T + b
        assert np.abs(got - y).max() <= 1e-5 * np.abs(y).max()


def test_linear_bf16_weights_give_the_contract_and_an_fp64_product():
    """Recipe w16a16: the BF16 weights themselves (no quantization). Every level gives the
    contract's bits; against numpy's FP64 product the FP32 output is within FP32 accumulation."""
    rng = np.random.default_rng(5)
    n, k, m = 37, 96, 5
    wb = (rng.standard_normal((n, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    x = (rng.standard_normal((m, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    b = rng.standard_normal(n).astype(np.float32)
    ref = k3.linear.run(wb, None, x, bias=b, recipe="w16a16", out_dtype="fp32", backend="reference")
    for isa in [""] + (["avx2", "scalar"] if k3.info()["isa"] != "scalar" else []):
        got = k3.linear.run(wb, None, x, bias=b, recipe="w16a16", out_dtype="fp32", backend="cpu", isa=isa)
        np.testing.assert_array_equal(got, ref)
    layer = k3.linear.CpuLinear(wb, None, bias=b, recipe="w16a16", out_dtype="fp32", max_tokens=64)
    assert "w16a16" in layer.plan and "bf16 weights" in layer.plan
    assert layer.packed_bytes == ((n + 15) // 16) * 16 * k * 2 + ((n + 15) // 16) * 16 * (k // 32) + n * 4
    np.testing.assert_array_equal(layer.run(x), ref)
    wf = (wb.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    xf = (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    y = xf @ wf.T + b
    bound = (k + 2) * 2.0 ** -24 * (np.abs(xf) @ np.abs(wf).T + np.abs(b))
    assert (np.abs(ref - y) <= bound).all()
    # the panel route (M > 8) too
    xm = (rng.standard_normal((40, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(layer.run(xm), k3.linear.run(wb, None, xm, bias=b, recipe="w16a16",
                                                               out_dtype="fp32", backend="reference"))
    # refusals by name
    with pytest.raises(ValueError, match="scales must be None with recipe = 'w16a16'"):
        k3.linear.run(wb, np.zeros((n, 3), np.uint8), x, recipe="w16a16")
    bad = wb.copy()
    bad[3, 17] = 0x7FC1
    with pytest.raises(ValueError, match="BF16 weight of row 3, column 17 is NaN"):
        k3.linear.run(bad, None, x, recipe="w16a16")
    with pytest.raises(ValueError, match="codes has K = 40 columns"):
        k3.linear.run(np.zeros((3, 40), np.uint16), None, x, recipe="w16a16")
    with pytest.raises(ValueError, match="codes is float16"):
        k3.linear.run(np.zeros((3, 32), np.float16), None, x, recipe="w16a16")


def test_bench_linear_runs_torch_side_by_side_when_given_a_python_with_torch():
    """`k3 bench linear --torch-python PY`: torch's BF16 F.linear on the same shapes, M and
    threads, its median next to k3's and the speed-up in the JSON (the real torch of this venv)."""
    pytest.importorskip("torch")
    # The baseline runs in this interpreter by default (torch_python=sys.executable).
    r = k3.bench("linear", shapes="96x64", m=[1, 9], recipes="w8a16,w16a16", rounds=2, iters=2, pool_mib=1, bw_mib=16,
                 threads=2)
    assert r["ok"]
    assert "version" in r["torch"], r["torch"]
    assert r["torch"]["python"] == sys.executable
    assert len(r["records"]) == 4
    for rec in r["records"]:
        t = rec["torch_bf16"]
        assert t["time"]["median_s"] > 0 and t["time"]["iterations"] == 4  # two per round
        assert t["k3_speedup"] == pytest.approx(t["time"]["median_s"] / rec["time"]["median_s"])


def test_linear_refuses_bad_arguments_by_name():
    w, codes, scales, x, b = _linear_case()
    with pytest.raises(ValueError, match="recipe = 'w4a8'"):
        k3.linear.run(codes, scales, x, recipe="w4a8")
    with pytest.raises(ValueError, match="K = 40 columns"):
        k3.linear.run(np.zeros((3, 40), np.uint8), np.zeros((3, 1), np.uint8), x)
    with pytest.raises(ValueError, match="scales"):
        k3.linear.run(codes, scales[:, :2], x)
    with pytest.raises(ValueError, match="bias"):
        k3.linear.run(codes, scales, x, bias=np.zeros(5, np.float32))
    with pytest.raises(ValueError, match=r"x has shape \(5, 64\)"):
        k3.linear.run(codes, scales, np.zeros((5, 64), np.uint16))
    bad = codes.copy()
    bad[4, 70] = 0x7F
    with pytest.raises(ValueError, match="row 4, column 70 .block 2. is 0x7F"):
        k3.linear.run(bad, scales, x)
    layer = k3.linear.CpuLinear(codes, scales, max_tokens=4)
    with pytest.raises(ValueError, match="m = 5 exceeds the plan's max_tokens = 4"):
        layer.run(x)
    assert [b_["name"] for b_ in k3.info()["linear_backends"]] == ["cpu", "reference"]


def np_conv(x, w, state, cu, silu=True):
    """Independent definition of the KDA short convolution in float64: per sequence, the inputs
    before its first token are the state's (newest last); returns y and the new state."""
    t, d = x.shape
    s = state.shape[2]
    y = np.zeros((t, d))
    new = state.astype(np.float64).copy()
    for n in range(len(cu) - 1):
        hist = np.concatenate([state[n].T.astype(np.float64), x[cu[n]:cu[n + 1]].astype(np.float64)])  # [S + L, D]
        for j in range(cu[n + 1] - cu[n]):
            z = (hist[j + s - w.shape[1] + 1:j + s + 1] * w.T.astype(np.float64)).sum(0)
            y[cu[n] + j] = z / (1 + np.exp(-z)) if silu else z
        new[n] = hist[-s:].T
    return y, new


@pytest.mark.parametrize("s", [3, 4])
def test_kda_causal_conv1d_matches_a_float64_definition_and_keeps_the_last_inputs(s):
    rng = np.random.default_rng(9)
    d, w_ = 40, 4
    cu = [0, 1, 2, 7]
    x = rng.standard_normal((7, d)).astype(np.float32)
    w = (0.5 * rng.standard_normal((d, w_))).astype(np.float32)
    st = rng.standard_normal((3, d, s)).astype(np.float32)
    want_y, want_st = np_conv(x, w, st, cu)
    got_st = st.copy()
    y = k3.kda.causal_conv1d(x, w, conv_state=got_st, cu_seqlens=cu)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got_st, want_st.astype(np.float32))
    # BF16 storage: the FP32 op on the widened values, rounded once (RNE)
    def bf(a):
        u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    xb, wb, sb = bf(x), bf(w), bf(st)
    widen = lambda b: (b.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
    yf = k3.kda.causal_conv1d(widen(xb), widen(wb), conv_state=widen(sb).copy(), cu_seqlens=cu)
    yb = k3.kda.causal_conv1d(xb, wb, conv_state=sb, cu_seqlens=cu)
    np.testing.assert_array_equal(yb, bf(yf))
    np.testing.assert_array_equal(widen(sb), np_conv(widen(xb), widen(wb), widen(bf(st)), cu)[1].astype(np.float32))


def test_kda_causal_conv1d_refuses_mixed_storage_and_bad_state_by_name():
    x = np.zeros((2, 8), np.float32)
    w = np.zeros((8, 4), np.float32)
    with pytest.raises(ValueError, match="weight has dtype uint16, expected float32"):
        k3.kda.causal_conv1d(x, w.astype(np.uint16))
    with pytest.raises(ValueError, match=r"state_len = 2 must be 0 \(W - 1\) or in \[W - 1 = 3, 64\]"):
        k3.kda.causal_conv1d(x, w, conv_state=np.zeros((1, 8, 2), np.float32))
    with pytest.raises(ValueError, match=r"conv_state has shape \(2, 8, 4\), expected \[N, D, S\] = \[1, 8, S\]"):
        k3.kda.causal_conv1d(x, w, conv_state=np.zeros((2, 8, 4), np.float32))
