"""Hostile inputs at the Python boundary (issue 25): every array a binding takes or writes is
checked for dtype, shape, contiguity and writability with a ValueError naming the caller's
argument; nothing is converted behind the caller's back (an output converted into a temporary
would be silently lost); BF16 and FP16 are told apart; integers are range-checked before anything
is allocated from them. Each case asserts the refusal and that the caller's buffers are untouched;
the valid twins assert the same bits as the plain numpy form."""

import os

import numpy as np
import pytest

import k3

try:
    import torch
except ImportError:  # scripts/test.sh installs torch and sets K3_REQUIRE_TORCH=1: then this fails
    if os.environ.get("K3_REQUIRE_TORCH") == "1":
        raise
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def kda_case(t=12, h=2, d=16, seed=5):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((t, h, d)).astype(np.float32) for _ in range(3))
    g = (-0.1 + 0.05 * rng.standard_normal((t, h, d))).astype(np.float32)
    beta = rng.standard_normal((t, h)).astype(np.float32)
    return q, k, v, g, beta


def moe_case(m=5, out_dtype="bf16"):
    from test_k3 import random_moe  # the suite's MoE case generator
    return random_moe(m=m, n=64, out_dtype=out_dtype)


# ---- outputs are never written through a temporary ------------------------------------------


@pytest.mark.parametrize("bad", ["float64", "strided", "readonly"])
def test_kda_prefill_refuses_a_final_state_it_could_not_write_in_place(bad):
    q, k, v, g, beta = kda_case()
    cu = np.array([0, 5, 12], np.int64)
    want, want_state = k3.kda.prefill(q, k, v, g, beta, cu_seqlens=cu, gate="log_decay", return_final_state=True)
    if bad == "float64":
        fs = np.full(want_state.shape, 7.0, np.float64)
    elif bad == "strided":
        fs = np.full(want_state.shape[:-1] + (2 * want_state.shape[-1],), 7.0, np.float32)[..., ::2]
    else:
        fs = np.full(want_state.shape, 7.0, np.float32)
        fs.flags.writeable = False
    with pytest.raises(ValueError, match="final_state"):
        k3.kda.prefill(q, k, v, g, beta, cu_seqlens=cu, gate="log_decay", final_state=fs)
    assert (fs == 7.0).all()  # untouched, and the caller was told
    ok = np.zeros_like(want_state)
    o, s = k3.kda.prefill(q, k, v, g, beta, cu_seqlens=cu, gate="log_decay", final_state=ok)
    assert s is ok
    np.testing.assert_array_equal(ok, want_state)
    np.testing.assert_array_equal(o, want)


@pytest.mark.parametrize("name", ["initial_state", "a_log"])
def test_kda_inputs_of_the_wrong_dtype_are_refused_not_converted(name):
    q, k, v, g, beta = kda_case()
    h, d = q.shape[1], q.shape[2]
    kw = dict(gate="log_decay")
    if name == "initial_state":
        kw["initial_state"] = np.zeros((1, h, d, d), np.float64)
    else:
        kw = dict(gate="softplus", a_log=np.zeros(h, np.float64))
    with pytest.raises(ValueError, match=f"{name} has dtype float64, expected float32"):
        k3.kda.prefill(q, k, v, g, beta, **kw)


@pytest.mark.parametrize("cu, why", [
    (np.array([0, 5, 12], np.int32), "cu_seqlens has dtype int32, expected int64"),
    ([0, 5.7, 12.2], "must hold integers"),
    (np.array([0.0, 5.0, 12.0]), "cu_seqlens has dtype float64"),
    ([], r"cu_seqlens has shape \(0,\), expected \[N \+ 1\]"),
    (np.array([12], np.int64), r"expected \[N \+ 1\] with N >= 1"),
    (np.array([[0, 12]], np.int64), r"cu_seqlens has shape \(1, 2\)"),
    ([0, True, 12], "must hold integers"),
])
def test_kda_cu_seqlens_is_checked_before_use(cu, why):
    q, k, v, g, beta = kda_case()
    with pytest.raises(ValueError, match=why):
        k3.kda.prefill(q, k, v, g, beta, cu_seqlens=cu, gate="log_decay")


def test_kda_cu_seqlens_as_a_list_of_ints_gives_the_int64_array_bits():
    q, k, v, g, beta = kda_case()
    a, sa = k3.kda.prefill(q, k, v, g, beta, cu_seqlens=[0, 5, 12], gate="log_decay", return_final_state=True)
    b, sb = k3.kda.prefill(q, k, v, g, beta, cu_seqlens=np.array([0, 5, 12], np.int64), gate="log_decay",
                           return_final_state=True)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(sa, sb)


def test_read_only_outputs_are_refused_by_name():
    q, k, v, g, beta = kda_case()
    o = np.zeros((12, 2, 16), np.float32)
    o.flags.writeable = False
    with pytest.raises(ValueError, match="o is read-only"):
        k3.kda.prefill(q, k, v, g, beta, gate="log_decay", o=o)
    logits = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    ids = np.zeros((3, 4), np.int32)
    ids.flags.writeable = False
    with pytest.raises(ValueError, match="ids is read-only"):
        k3.route(logits, top_k=4, ids=ids)
    p, w, x, tid, wts = moe_case(out_dtype="fp32")
    out = np.zeros((5, 64), np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        k3.moe.run(p, **w, x=x, topk_ids=tid, topk_weights=wts, out=out)
    pool = np.zeros((4, 2, 16, 16), np.float32)
    pool.flags.writeable = False
    with pytest.raises(ValueError, match="state_pool is read-only"):
        k3.kda.decode(q[:2], k[:2], v[:2], g[:2], beta[:2], pool, np.array([0, 1], np.int32), gate="log_decay")


def test_kda_decode_refuses_a_strided_state_pool():
    q, k, v, g, beta = kda_case()
    pool = np.zeros((4, 2, 16, 32), np.float32)[..., ::2]
    with pytest.raises(ValueError, match="state_pool must be C-contiguous"):
        k3.kda.decode(q[:2], k[:2], v[:2], g[:2], beta[:2], pool, np.array([0, 1], np.int32), gate="log_decay")


# ---- integers --------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, why", [
    (dict(top_k=-1), r"top_k = -1 must be in \[1, 16\]"),
    (dict(top_k=0), r"top_k = 0 must be in \[1, 16\]"),
    (dict(top_k=2 ** 40), r"top_k = 1099511627776 must be in \[1, 16\]"),
    (dict(top_k=17), r"top_k = 17 must be in \[1, 16\]"),
    (dict(top_k=2.5), "top_k = 2.5 must be an integer"),
    (dict(top_k=True), "top_k = True must be an integer"),
    (dict(n_group=0), r"n_group = 0 must be in \[1, 16\]"),
    (dict(n_group=2 ** 40), "n_group = 1099511627776"),
    (dict(n_group=4, topk_group=5), r"topk_group = 5 must be in \[1, 4\]"),
])
def test_route_checks_its_integers_before_allocating(kw, why):
    logits = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    with pytest.raises(ValueError, match=why):
        k3.route(logits, **kw)


def test_route_refuses_more_than_4096_experts_by_name():
    with pytest.raises(ValueError, match=r"num_experts \(logits' columns\) = 4097 must be in \[1, 4096\]"):
        k3.route(np.zeros((1, 4097), np.float32), top_k=4)


def test_non_arrays_are_refused_by_name():
    p, w, x, ids, wts = moe_case()
    with pytest.raises(ValueError, match="x must be an array"):
        k3.moe.run(p, **w, x=x.tolist(), topk_ids=ids, topk_weights=wts)
    with pytest.raises(ValueError, match="logits must be an array"):
        k3.route([[0.0, 1.0]], top_k=1)
    # Found by a random-argument fuzz (2026-12-04): these raised AttributeError / IndexError from
    # inside the wrapper instead of naming the argument.
    q, k, v, g, beta = kda_case()
    with pytest.raises(ValueError, match=r"q must be an array \(numpy, torch, ...\) \[T, H, K\], got list"):
        k3.kda.prefill(q.tolist(), k, v, g, beta, gate="log_decay")
    with pytest.raises(ValueError, match=r"v must be 3-D \[T, H, V\], got shape \(12, 32\)"):
        k3.kda.prefill(q, k, v.reshape(12, 32), g, beta, gate="log_decay")
    codes, scales = k3.mx.quantize(np.ones((2, 64), np.float32))
    with pytest.raises(ValueError, match=r"q must be 2-D \[rows, packed bytes\], got shape \(64,\)"):
        k3.mx.dequantize(codes.reshape(-1), scales, 64)
    with pytest.raises(ValueError, match=r"q must be an array"):
        k3.mx.dequantize(None, scales, 64)
    for cols in (0, 33, -32, 64.0, "64", True):
        with pytest.raises(ValueError, match=r"cols = .* must be a positive int, a multiple of 32"):
            k3.mx.dequantize(codes, scales, cols)
    with pytest.raises(ValueError, match=r"element = 'e4m3' must be 'mxfp4' or 'mxfp8'"):
        k3.mx.dequantize(codes, scales, 64, element="e4m3")
    assert np.array_equal(k3.mx.dequantize(codes, scales, 64), np.ones((2, 64), np.float32))
    pool = np.zeros((2, 2, 16, 16), np.float32)
    with pytest.raises(ValueError, match=r"v must be 3-D \[1, H, V\], got shape \(16,\)"):
        k3.kda.decode(q[:1], k[:1], v[0, 0], g[:1], beta[:1], pool, np.zeros(1, np.int32), gate="log_decay")


@needs_torch
def test_torch_linear_module_refuses_a_non_tensor_by_name():
    import k3.torch as k3torch

    lin = k3torch.Linear.from_linear(torch.nn.Linear(64, 16).to(torch.bfloat16), recipe="w16a16")
    with pytest.raises(ValueError, match=r"x must be a torch.Tensor \[..., 64\], got ndarray"):
        lin(np.zeros((1, 64), np.uint16))
    with pytest.raises(ValueError, match=r"x has shape \(\), expected \[..., 64\]"):
        lin(torch.tensor(1.0, dtype=torch.bfloat16))


# ---- BF16 and FP16 told apart; torch tensors at the numpy-level API ---------------------------


@needs_torch
def test_numpy_level_api_takes_bf16_torch_tensors_with_the_bits_of_uint16():
    p, w, x, ids, wts = moe_case()
    want = k3.moe.run(p, **w, x=x, topk_ids=ids, topk_weights=wts)
    xt = torch.from_numpy(x.astype(np.int32)).to(torch.int16).view(torch.bfloat16)  # the same bits
    assert (xt.view(torch.int16).numpy().view(np.uint16) == x).all()
    got = k3.moe.run(p, **w, x=xt, topk_ids=torch.from_numpy(ids), topk_weights=torch.from_numpy(wts))
    np.testing.assert_array_equal(np.asarray(got), want)
    out = torch.zeros((5, 64), dtype=torch.bfloat16)
    r = k3.moe.CpuMoe(p, **w, max_tokens=8).run(xt, ids, wts, out=out)
    assert r is out
    assert (out.view(torch.int16).numpy().view(np.uint16) == want).all()
    q, k, v, g, beta = kda_case()
    bits = [(a.view(np.uint32) >> 16).astype(np.uint16) for a in (q, k, v)]
    ref, _ = k3.kda.prefill(*bits, g, beta, gate="log_decay")
    tb = [torch.from_numpy(b.astype(np.int32)).to(torch.int16).view(torch.bfloat16) for b in bits]
    got, _ = k3.kda.prefill(*tb, torch.from_numpy(g), torch.from_numpy(beta), gate="log_decay")
    np.testing.assert_array_equal(got, ref)
    logits = np.random.default_rng(2).standard_normal((3, 16)).astype(np.float32)
    a = k3.route(logits, top_k=4)
    b = k3.route(torch.from_numpy(logits), top_k=4)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


@needs_torch
def test_float16_is_refused_where_bf16_is_read():
    p, w, x, ids, wts = moe_case()
    xh = torch.zeros((5, 64), dtype=torch.float16)
    with pytest.raises(ValueError, match="x is float16, but k3 reads BF16"):
        k3.moe.run(p, **w, x=xh, topk_ids=ids, topk_weights=wts)
    with pytest.raises(ValueError, match="x is float16, but k3 reads BF16"):
        k3.moe.CpuMoe(p, **w, max_tokens=8).run(xh, ids, wts)
    q, k, v, g, beta = kda_case()
    qh = torch.from_numpy(q).to(torch.float16)
    with pytest.raises(ValueError, match="q is float16"):
        k3.kda.prefill(qh, qh, qh, g, beta, gate="log_decay")
    codes, scales = k3.linear.quantize_weight(np.ones((32, 64), np.float32))
    with pytest.raises(ValueError, match="x is float16"):
        k3.linear.run(codes, scales, np.zeros((2, 64), np.float16))


@needs_torch
@pytest.mark.parametrize("layer, given", [("bf16", torch.float16 if torch else None),
                                          ("fp16", torch.bfloat16 if torch else None)])
def test_an_output_of_the_other_16_bit_format_is_refused(layer, given):
    p, w, x, ids, wts = moe_case(out_dtype=layer)
    out = torch.full((5, 64), 3.0, dtype=given)
    with pytest.raises(ValueError, match=f"out is .*this op writes {layer.upper()}"):
        k3.moe.run(p, **w, x=x, topk_ids=ids, topk_weights=wts, out=out)
    with pytest.raises(ValueError, match=f"out is .*this op writes {layer.upper()}"):
        k3.moe.CpuMoe(p, **w, max_tokens=8).run(x, ids, wts, out=out)
    assert (out == 3.0).all()
    codes, scales = k3.linear.quantize_weight(np.ones((32, 64), np.float32))
    lo = torch.full((2, 32), 3.0, dtype=given)
    with pytest.raises(ValueError, match=f"out is .*this op writes {layer.upper()}"):
        k3.linear.run(codes, scales, np.zeros((2, 64), np.uint16), out_dtype=layer, out=lo)
    assert (lo == 3.0).all()
    # the matching format is written in place, with the uint16 form's bits
    want = k3.moe.run(p, **w, x=x, topk_ids=ids, topk_weights=wts)
    right = torch.zeros((5, 64), dtype=torch.bfloat16 if layer == "bf16" else torch.float16)
    k3.moe.run(p, **w, x=x, topk_ids=ids, topk_weights=wts, out=right)
    assert (right.view(torch.int16).numpy().view(np.uint16) == want).all()


@needs_torch
def test_torch_kda_prefill_op_refuses_a_final_state_it_could_not_write():
    import k3.torch  # noqa: F401  (registers torch.ops.k3)
    q, k, v, g, beta = (torch.from_numpy(a) for a in kda_case())
    o = torch.zeros((12, 2, 16))
    empty = torch.empty(0)
    for fs in (torch.full((1, 2, 16, 16), 7.0, dtype=torch.float64), torch.full((1, 2, 16, 32), 7.0)[..., ::2]):
        with pytest.raises(ValueError, match="final_state"):
            torch.ops.k3.kda_prefill(q, k, v, g, beta, empty, empty, empty, empty, "log_decay", -5.0, True, True,
                                     0.0, "k_first", o, fs)
        assert (fs == 7.0).all()


@needs_torch
def test_fused_moe_names_the_callers_arguments():
    import k3.torch
    p, w, x, ids, wts = moe_case()
    layer = k3.torch.FusedMoE(p, **w, max_tokens=8)
    h = torch.zeros((1, 5, 64), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"hidden_states has shape \(1, 5, 64\), expected \[M, 64\]"):
        layer(h, torch.zeros((5, 8)))
    with pytest.raises(ValueError, match=r"router_logits has shape \(5, 7\), expected \[M, E\] = \[5, 8\]"):
        layer(h[0], torch.zeros((5, 7)))
    with pytest.raises(ValueError, match=r"router_logits has shape \(4, 8\)"):
        layer(h[0], torch.zeros((4, 8)))
    assert layer(h[0], torch.zeros((5, 8))).shape == (5, 64)


def test_the_bindings_themselves_never_convert_an_array():
    """Under the Python checks, the extension's own arguments are marked no-convert: a direct call
    with a wrong dtype or a strided array raises instead of working on a hidden copy."""
    logits = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    ids, wts = np.full((3, 4), -7, np.int32), np.zeros((3, 4), np.float32)
    k3._k3.route(logits, None, 3, 16, 4, 1, 1, True, 1.0, ids, wts)  # the valid call
    assert (ids >= 0).all()
    bad_ids = np.full((3, 4), -7, np.int64)
    with pytest.raises(TypeError):
        k3._k3.route(logits, None, 3, 16, 4, 1, 1, True, 1.0, bad_ids, wts)
    assert (bad_ids == -7).all()
    with pytest.raises(TypeError):
        k3._k3.route(logits.astype(np.float64), None, 3, 16, 4, 1, 1, True, 1.0, ids, wts)
    y = np.full((4, 8), 5.0)  # float64 output of the FP32 conv
    with pytest.raises(TypeError):
        k3._k3.kda_conv_f32(8, 4, True, np.zeros((4, 8), np.float32), np.zeros((8, 4), np.float32), None, None, None,
                            y, 0, 1)
    assert (y == 5.0).all()
    strided = np.zeros((4, 16), np.float32)[:, ::2]
    with pytest.raises(TypeError):
        k3._k3.kda_conv_f32(8, 4, True, strided, np.zeros((8, 4), np.float32), None, None, None,
                            np.zeros((4, 8), np.float32), 0, 1)


# ---- outputs that alias inputs ---------------------------------------------------------------


def test_outputs_that_overlap_inputs_are_refused():
    p, w, x, ids, wts = moe_case(out_dtype="fp32")
    big = np.zeros(5 * 64 + 10, np.float32)
    out = big[:5 * 64].reshape(5, 64)
    alias_w = big[5 * 64 - 10:5 * 64].reshape(5, 2)  # the routing weights share the output's last 10 floats
    alias_w[:] = wts
    with pytest.raises(ValueError, match="out overlaps topk_weights"):
        k3.moe.run(p, **w, x=x, topk_ids=ids, topk_weights=alias_w, out=out)
    with pytest.raises(ValueError, match="out overlaps topk_weights"):
        k3.moe.CpuMoe(p, **w, max_tokens=8).run(x, ids, alias_w, out=out)
    np.testing.assert_array_equal(alias_w, wts)  # nothing was written
    flat = np.random.default_rng(1).standard_normal(48).astype(np.float32)
    logits = flat.reshape(3, 16)
    with pytest.raises(ValueError, match="weights overlaps logits"):
        k3.route(logits, top_k=4, ids=np.zeros((3, 4), np.int32), weights=flat[20:32].reshape(3, 4))
    both = np.zeros(24, np.int32)
    with pytest.raises(ValueError, match="ids overlaps weights"):
        k3.route(logits, top_k=4, ids=both[:12].reshape(3, 4), weights=both.view(np.float32)[6:18].reshape(3, 4))
    q, k, v, g, beta = kda_case()
    with pytest.raises(ValueError, match="o is the same array as q"):
        k3.kda.prefill(q, k, v, g, beta, gate="log_decay", o=q)
    x2 = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="y is the same array as x"):
        k3.kda.causal_conv1d(x2, np.zeros((8, 4), np.float32), y=x2)
    codes, scales = k3.linear.quantize_weight(np.ones((64, 64), np.float32))
    xl = np.zeros((2, 64), np.uint16)
    with pytest.raises(ValueError, match="out is the same array as x"):
        k3.linear.run(codes, scales, xl, out=xl)


@pytest.mark.parametrize("kw, why", [
    (dict(num_experts=2 ** 31), r"num_experts = 2147483648 must be in \[1, 4096\]"),
    (dict(hidden=2 ** 40), r"hidden = 1099511627776 must be in \[1, 2147483647\]"),
    (dict(ep_size=2 ** 33), r"ep_size = 8589934592 must be in \[1, 8\]"),
    (dict(ep_size=2, ep_rank=2), r"ep_rank = 2 must be in \[0, 1\]"),
    (dict(top_k=0), r"top_k = 0 must be in \[1, 8\]"),
    (dict(intermediate=64.0), "intermediate = 64.0 must be an integer"),
])
def test_moe_problem_integers_are_range_checked_by_name(kw, why):
    base = dict(hidden=64, intermediate=64, num_experts=8, top_k=2)
    base.update(kw)
    with pytest.raises(ValueError, match=why):
        k3.moe.problem(**base)


def test_a_nul_byte_in_a_path_is_refused_whole():
    with pytest.raises(ValueError, match=r"path = 'abc\\x00def' contains a NUL byte \(at index 3\)"):
        k3.load_checkpoint_layer("abc\0def", 1)
    with pytest.raises(ValueError, match=r"ep_rank = 4 must be in \[0, 3\]"):
        k3.load_checkpoint_layer("/nonexistent", 1, ep_size=4, ep_rank=4)


@needs_torch
def test_torch_kda_prefill_op_checks_cu_seqlens_by_name():
    import k3.torch  # noqa: F401
    q, k, v, g, beta = (torch.from_numpy(a) for a in kda_case())
    o, fs = torch.zeros((12, 2, 16)), torch.zeros((2, 2, 16, 16))
    empty = torch.empty(0)
    for cu, why in ((torch.tensor([0.0, 5.7, 12.0]), "cu_seqlens has dtype float32, expected int64"),
                    (torch.tensor([0, 5, 12], dtype=torch.int32), "cu_seqlens has dtype int32, expected int64")):
        with pytest.raises(ValueError, match=why):
            torch.ops.k3.kda_prefill(q, k, v, g, beta, empty, empty, cu, empty, "log_decay", -5.0, True, True, 0.0,
                                     "k_first", o, fs)
        assert (fs == 0).all() and (o == 0).all()
