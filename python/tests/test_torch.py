"""k3.torch: the custom ops (torch.library.opcheck), torch.compile(fullgraph=True), FusedMoE
against the numpy path bit for bit, in-place outputs and errors. scripts/test.sh installs torch
and sets K3_REQUIRE_TORCH=1, so there a missing torch fails; elsewhere these tests skip."""

import os

import numpy as np
import pytest

if os.environ.get("K3_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch", reason="torch is not installed (scripts/test.sh installs it)")

import k3  # noqa: E402
import k3.torch as k3t  # noqa: E402


def kimi_like(m=7, k=64, n=96, e=16, top_k=4, out_dtype="bf16", seed=5):
    rng = np.random.default_rng(seed)
    p = k3.moe.problem(hidden=k, intermediate=n, num_experts=e, top_k=top_k, out_dtype=out_dtype)
    w = dict(fc1_q=rng.integers(0, 256, (e, 2 * n, k // 2), dtype=np.uint8),
             fc1_scale=rng.integers(120, 124, (e, 2 * n, k // 32), dtype=np.uint8),
             fc2_q=rng.integers(0, 256, (e, k, n // 2), dtype=np.uint8),
             fc2_scale=rng.integers(120, 124, (e, k, n // 32), dtype=np.uint8))
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(torch.bfloat16)
    logits = torch.from_numpy(rng.standard_normal((m, e)).astype(np.float32))
    bias = torch.from_numpy((0.05 * rng.standard_normal(e)).astype(np.float32))
    return p, w, x, logits, bias


def numpy_path(p, w, x, logits, bias):
    ids, wts = k3.route(logits.numpy(), bias.numpy(), top_k=p.top_k)
    return k3.moe.run(p, **w, x=x.view(torch.uint16).numpy(), topk_ids=ids, topk_weights=wts, backend="cpu")


@pytest.mark.parametrize("out_dtype", ["bf16", "fp16", "fp32"])
def test_fused_moe_module_equals_the_numpy_path_bit_for_bit(out_dtype):
    p, w, x, logits, bias = kimi_like(out_dtype=out_dtype)
    layer = k3t.FusedMoE(p, **w, router_bias=bias, max_tokens=16)
    got = layer(x, logits)
    assert got.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[out_dtype]
    want = numpy_path(p, w, x, logits, bias)
    got_bits = got.numpy() if out_dtype == "fp32" else got.view(torch.uint16).numpy()
    np.testing.assert_array_equal(got_bits, want)


def test_outputs_are_written_in_place():
    p, w, x, logits, bias = kimi_like()
    layer = k3t.FusedMoE(p, **w, router_bias=bias, max_tokens=16)
    out = torch.full((7, 64), float("nan"), dtype=torch.bfloat16)
    ptr = out.data_ptr()
    res = layer(x, logits, out=out)
    assert res is out and out.data_ptr() == ptr and not torch.isnan(out.float()).any()
    ids = torch.zeros((7, 4), dtype=torch.int32)
    wts = torch.zeros((7, 4), dtype=torch.float32)
    torch.ops.k3.route(logits, bias, 4, 1, 1, True, 1.0, ids, wts)
    rid, rw = k3.route(logits.numpy(), bias.numpy(), top_k=4)
    np.testing.assert_array_equal(ids.numpy(), rid)
    np.testing.assert_array_equal(wts.numpy(), rw)


def test_opcheck_on_every_op():
    p, w, x, logits, bias = kimi_like()
    handle = k3t.prepare_moe(p, **w, max_tokens=16)
    try:
        ids = torch.zeros((7, 4), dtype=torch.int32)
        wts = torch.zeros((7, 4), dtype=torch.float32)
        torch.library.opcheck(torch.ops.k3.route.default, (logits, bias, 4, 1, 1, True, 1.0, ids, wts))
        torch.ops.k3.route(logits, bias, 4, 1, 1, True, 1.0, ids, wts)
        out = torch.zeros((7, 64), dtype=torch.bfloat16)
        torch.library.opcheck(torch.ops.k3.moe_run.default, (handle, x, ids, wts, out))
    finally:
        k3t.release_moe(handle)


def test_torch_compile_fullgraph_gives_the_eager_bits():
    p, w, x, logits, bias = kimi_like()
    layer = k3t.FusedMoE(p, **w, router_bias=bias, max_tokens=16)
    eager = layer(x, logits)
    compiled = torch.compile(layer, fullgraph=True)
    got = compiled(x, logits)
    assert torch.equal(got.view(torch.uint16), eager.view(torch.uint16))


def test_errors_carry_the_library_message():
    p, w, x, logits, bias = kimi_like()
    with pytest.raises(ValueError, match="is not a prepared k3 MoE layer"):
        torch.ops.k3.moe_run(12345, x, torch.zeros((7, 4), dtype=torch.int32), torch.zeros((7, 4)),
                             torch.zeros((7, 64), dtype=torch.bfloat16))
    layer = k3t.FusedMoE(p, **w, router_bias=bias, max_tokens=16)
    with pytest.raises(ValueError, match="hidden_states has dtype torch.float32, expected torch.bfloat16"):
        layer(x.float(), logits)
    with pytest.raises(ValueError, match="m = 40 must be in"):
        layer(torch.zeros((40, 64), dtype=torch.bfloat16), torch.zeros((40, 16)))


def test_fused_moe_from_a_checkpoint_layer(tmp_path):
    from test_k3 import synth_checkpoint
    d = synth_checkpoint(tmp_path)
    layer = k3.load_checkpoint_layer(d, 1, ep_size=2, ep_rank=0)
    moe = k3t.FusedMoE(layer.problem(), **layer.weights, router_bias=layer.router_bias, **layer.routing())
    x = torch.randn(3, 64).to(torch.bfloat16)
    logits = torch.randn(3, 16)
    out = moe(x, logits)
    ids, wts = k3.route(logits.numpy(), layer.router_bias, **layer.routing())
    want = k3.moe.run(layer.problem(), **layer.weights, x=x.view(torch.uint16).numpy(), topk_ids=ids,
                      topk_weights=wts, backend="cpu")
    np.testing.assert_array_equal(out.view(torch.uint16).numpy(), want)


# ---- the CUDA kernels of the ops (never run on a GPU from Python; the C++ backend ran on an H200) --

def test_fused_moe_on_cuda_in_a_build_without_cuda_says_how_to_build_with_it():
    if k3._k3.cuda_compiled():
        pytest.skip("this package was built with CUDA")
    p, w, _, _, bias = kimi_like()
    with pytest.raises(RuntimeError, match=r"built without CUDA.*-DK3_CUDA=ON"):
        k3t.FusedMoE(p, **w, router_bias=bias, device="cuda")


def _no_gpu():
    if not k3._k3.cuda_compiled():
        return "this package was built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


@pytest.mark.skipif(_no_gpu() is not None, reason=f"GPU test: {_no_gpu()}")
@pytest.mark.parametrize("out_dtype", ["bf16", "fp32"])
def test_fused_moe_on_cuda_matches_the_cpu_and_replays_in_a_cuda_graph(out_dtype):
    p, w, x, logits, bias = kimi_like(out_dtype=out_dtype)
    want = k3t.FusedMoE(p, **w, router_bias=bias)(x, logits)
    dev = torch.device("cuda", 0)
    moe = k3t.FusedMoE(p, **w, router_bias=bias, max_tokens=16, device=dev)
    dx, dl = x.to(dev), logits.to(dev)
    out = torch.empty_like(want, device=dev)
    ptr = out.data_ptr()
    moe(dx, dl, out=out)
    torch.cuda.synchronize()
    assert out.data_ptr() == ptr
    got = out.cpu().float().numpy()
    ref = want.float().numpy()
    # routing is bit-identical on both backends; the experts agree within 2e-5 relative RMS
    assert np.sqrt(((got - ref) ** 2).sum() / max((ref ** 2).sum(), 1e-30)) < (2e-5 if out_dtype == "fp32" else 1e-2)
    eager = out.clone()
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        moe(dx, dl, out=out)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    with pytest.raises(ValueError, match="was prepared for cuda:0, but x is on the CPU"):
        torch.ops.k3.moe_run(moe.handle, x, torch.zeros((x.shape[0], p.top_k), dtype=torch.int32),
                             torch.zeros((x.shape[0], p.top_k)), torch.empty_like(want))


# ---- KDA custom ops --------------------------------------------------------------------------
KDA_CFG = ("log_decay", -5.0, True, True, 0.0, "k_first")


def kda_inputs(t=12, h=2, dk=32, dv=32, seed=3):
    rng = np.random.default_rng(seed)
    q, k, v = (torch.from_numpy(rng.standard_normal((t, h, d)).astype(np.float32)).to(torch.bfloat16)
               for d in (dk, dk, dv))
    g = torch.from_numpy(-np.abs(rng.standard_normal((t, h, dk))).astype(np.float32))
    beta = torch.from_numpy(rng.standard_normal((t, h)).astype(np.float32))
    return q, k, v, g, beta


def bits(t):
    return t.view(torch.uint16).numpy()


def test_kda_ops_equal_the_numpy_path_bit_for_bit():
    q, k, v, g, beta = kda_inputs()
    empty = torch.empty(0)
    cu = torch.tensor([0, 5, 12], dtype=torch.int64)
    o = torch.full((12, 2, 32), float("nan"))
    fs = torch.zeros((2, 2, 32, 32))
    ptr = o.data_ptr()
    torch.ops.k3.kda_prefill(q, k, v, g, beta, empty, empty, cu, empty, *KDA_CFG, o, fs)
    want_o, want_fs = k3.kda.prefill(bits(q), bits(k), bits(v), g.numpy(), beta.numpy(), cu_seqlens=cu.numpy(),
                                     gate="log_decay", backend="cpu", return_final_state=True)
    assert o.data_ptr() == ptr
    np.testing.assert_array_equal(o.numpy(), want_o)
    np.testing.assert_array_equal(fs.numpy(), want_fs)

    rng = np.random.default_rng(9)
    pool0 = rng.standard_normal((6, 2, 32, 32)).astype(np.float32)
    idx = torch.tensor([4, -1, 0, 2, 5, 1, -1, -1, -1, -1, -1, 3], dtype=torch.int32)
    pool = torch.from_numpy(pool0.copy())
    o = torch.zeros((12, 2, 32))
    torch.ops.k3.kda_decode(q, k, v, g, beta, empty, empty, pool, idx, *KDA_CFG, o)
    want_pool = pool0.copy()
    want_o = k3.kda.decode(bits(q), bits(k), bits(v), g.numpy(), beta.numpy(), want_pool, idx.numpy(),
                           gate="log_decay", backend="cpu")
    np.testing.assert_array_equal(o.numpy(), want_o)
    np.testing.assert_array_equal(pool.numpy(), want_pool)
    assert not np.array_equal(pool.numpy(), pool0)  # updated in place

    vidx = torch.tensor([[0, 1, 2], [3, 4, 5], [-1, -1, -1], [-1, -1, -1]], dtype=torch.int32)
    acc = torch.tensor([2, 1, 1, 1], dtype=torch.int32)
    pool = torch.from_numpy(pool0.copy())
    o = torch.zeros((12, 2, 32))
    torch.ops.k3.kda_verify(q, k, v, g, beta, empty, empty, pool, vidx, acc, *KDA_CFG, o)
    want_pool = pool0.copy()
    want_o = k3.kda.verify(bits(q), bits(k), bits(v), g.numpy(), beta.numpy(), want_pool, vidx.numpy(),
                           acc.numpy(), gate="log_decay", backend="cpu")
    np.testing.assert_array_equal(o.numpy(), want_o)
    np.testing.assert_array_equal(pool.numpy(), want_pool)


def test_kda_ops_pass_opcheck_and_compile_fullgraph():
    q, k, v, g, beta = kda_inputs()
    empty = torch.empty(0)
    cu = torch.tensor([0, 5, 12], dtype=torch.int64)
    torch.library.opcheck(torch.ops.k3.kda_prefill.default,
                          (q, k, v, g, beta, empty, empty, cu, empty, *KDA_CFG, torch.zeros((12, 2, 32)),
                           torch.zeros((2, 2, 32, 32))))
    pool0 = torch.from_numpy(np.random.default_rng(2).standard_normal((13, 2, 32, 32)).astype(np.float32))
    idx = torch.arange(12, dtype=torch.int32)
    torch.library.opcheck(torch.ops.k3.kda_decode.default,
                          (q, k, v, g, beta, empty, empty, pool0.clone(), idx, *KDA_CFG, torch.zeros((12, 2, 32))))
    torch.library.opcheck(torch.ops.k3.kda_verify.default,
                          (q, k, v, g, beta, empty, empty, pool0.clone(), idx.view(4, 3),
                           torch.tensor([3, 1, 2, 1], dtype=torch.int32), *KDA_CFG, torch.zeros((12, 2, 32))))

    def step(q, k, v, g, beta, pool, idx, o):
        torch.ops.k3.kda_decode(q, k, v, g, beta, empty, empty, pool, idx, *KDA_CFG, o)
        return o * 2.0

    eager_pool, eager_o = pool0.clone(), torch.zeros((12, 2, 32))
    want = step(q, k, v, g, beta, eager_pool, idx, eager_o)
    pool, o = pool0.clone(), torch.zeros((12, 2, 32))
    got = torch.compile(step, fullgraph=True)(q, k, v, g, beta, pool, idx, o)
    assert torch.equal(got, want) and torch.equal(pool, eager_pool)


def test_kda_op_errors_carry_the_library_message():
    q, k, v, g, beta = kda_inputs()
    empty = torch.empty(0)
    pool = torch.zeros((4, 2, 32, 32))
    idx = torch.tensor([0, 1, 1, 2, 3, -1, -1, -1, -1, -1, -1, -1], dtype=torch.int32)
    with pytest.raises(ValueError, match="state_indices: state slot 1 is written twice"):
        torch.ops.k3.kda_decode(q, k, v, g, beta, empty, empty, pool, idx, *KDA_CFG, torch.zeros((12, 2, 32)))
    with pytest.raises(ValueError, match="gate"):
        torch.ops.k3.kda_decode(q, k, v, g, beta, empty, empty, pool, torch.arange(12, dtype=torch.int32) % 4 * 0 - 1,
                                "sigmoid", -5.0, True, True, 0.0, "k_first", torch.zeros((12, 2, 32)))


def _mxfp8_weight(lin):
    codes, scales = k3.linear.quantize_weight(lin.weight.detach().float().numpy())
    return torch.from_numpy(k3.mx.dequantize(codes, scales, lin.in_features, "mxfp8"))


def test_linear_module_matches_fp64_to_one_bf16_rounding_and_passes_opcheck():
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 50).to(torch.bfloat16)
    mod = k3t.Linear.from_linear(lin, max_tokens=64)
    x = torch.randn(2, 3, 96, dtype=torch.bfloat16)
    y = mod(x)
    assert y.shape == (2, 3, 50) and y.dtype == torch.bfloat16
    ref = (x.double() @ _mxfp8_weight(lin).double().T + lin.bias.detach().double())
    # one BF16 rounding of a value that is exact to FP32 accumulation: within 2^-8 relative
    assert ((y.double() - ref).abs() <= ref.abs() * 2.0 ** -8 + 1e-6).all()
    # the numpy path: the same bits
    codes, scales = k3.linear.quantize_weight(lin.weight.detach().float().numpy())
    np_out = k3.linear.run(codes, scales, x.reshape(6, 96).view(torch.uint16).numpy(),
                           bias=lin.bias.detach().float().numpy(), backend="reference")
    np.testing.assert_array_equal(y.reshape(6, 50).view(torch.uint16).numpy(), np_out)
    out = torch.empty((6, 50), dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.k3.linear.default, (mod.handle, x.reshape(6, 96), out))
    f = torch.compile(lambda t: mod(t), fullgraph=True)
    assert torch.equal(f(x), y)
    # w8a8 and an FP32 output
    mod8 = k3t.Linear.from_linear(lin, recipe="w8a8", out_dtype="fp32")
    assert mod8(x).dtype == torch.float32


def test_linear_module_on_bf16_weights_is_the_fp64_product_to_one_rounding():
    """Linear.from_linear(recipe="w16a16") keeps the nn.Linear's BF16 weight as it is: the output
    is its FP64 product rounded once to BF16, but for a rare FP32-accumulation flip."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(128, 48).to(torch.bfloat16)
    mod = k3t.Linear.from_linear(lin, recipe="w16a16", max_tokens=64)
    assert "w16a16" in mod.plan and "recipe=w16a16" in repr(mod)
    x = torch.randn(3, 5, 128, dtype=torch.bfloat16)
    y = mod(x)
    ref = x.double() @ lin.weight.detach().double().T + lin.bias.detach().double()
    assert ((y.double() - ref).abs() <= ref.abs() * 2.0 ** -8 + 1e-6).all()
    flips = (y != ref.to(torch.bfloat16)).sum().item()
    assert flips <= 2, flips
    # the same bits as the numpy path on the weight's bits, and as a bfloat16 tensor handed in
    np_out = k3.linear.run(lin.weight.detach().view(torch.uint16).numpy(), None, x.reshape(15, 128).view(torch.uint16).numpy(),
                           bias=lin.bias.detach().float().numpy(), recipe="w16a16", backend="reference")
    np.testing.assert_array_equal(y.reshape(15, 48).view(torch.uint16).numpy(), np_out)
    direct = k3t.Linear(lin.weight.detach(), None, lin.bias.detach().float(), recipe="w16a16")
    assert torch.equal(direct(x), y)
    out = torch.empty((15, 48), dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.k3.linear.default, (mod.handle, x.reshape(15, 128), out))


def test_linear_op_refuses_what_it_cannot_compute():
    lin = torch.nn.Linear(64, 32).to(torch.bfloat16)
    mod = k3t.Linear.from_linear(lin, max_tokens=8)
    with pytest.raises(ValueError, match="x has dtype torch.float16, expected torch.bfloat16"):
        mod(torch.zeros(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"x has shape \(2, 63\)"):
        mod(torch.zeros(2, 63, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out has dtype torch.float16, expected torch.bfloat16"):
        torch.ops.k3.linear(mod.handle, torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="not a prepared k3 linear layer"):
        torch.ops.k3.linear(10 ** 9, torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not a prepared k3 MoE layer"):
        torch.ops.k3.moe_run(mod.handle, torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int32),
                             torch.zeros(1, 1), torch.zeros(1, 64, dtype=torch.bfloat16))
    # More rows than max_tokens are run in blocks of max_tokens (hardening issue, item 3): the
    # bits of a layer planned for all of them.
    big = k3t.Linear.from_linear(lin, max_tokens=64)
    x = torch.randn(9, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(mod(x), big(x))


def test_float16_is_never_read_as_bf16_and_out_must_be_the_layers_dtype():
    """Issue 25: float16 bits were read as BF16 (relative error 2-4) and an out= of the other
    16-bit type was filled with the wrong format's bits. Both are refused by name now."""
    p, w, x, logits, bias = kimi_like(out_dtype="bf16")
    layer = k3t.FusedMoE(p, **w, router_bias=bias, max_tokens=16)
    with pytest.raises(ValueError, match="hidden_states has dtype torch.float16, expected torch.bfloat16"):
        layer(x.to(torch.float16), logits)
    with pytest.raises(ValueError, match="out has dtype torch.float16, expected torch.bfloat16"):
        layer(x, logits, out=torch.empty((7, 64), dtype=torch.float16))
    with pytest.raises(ValueError, match="out has dtype torch.float32, expected torch.bfloat16"):
        layer(x, logits, out=torch.empty((7, 64), dtype=torch.float32))
    p16, w16, x16, logits16, bias16 = kimi_like(out_dtype="fp16")
    layer16 = k3t.FusedMoE(p16, **w16, router_bias=bias16, max_tokens=16)
    with pytest.raises(ValueError, match="out has dtype torch.bfloat16, expected torch.float16"):
        layer16(x16, logits16, out=torch.empty((7, 64), dtype=torch.bfloat16))
    assert layer16(x16, logits16).dtype == torch.float16  # the valid call still works
    q, k, v, g, beta = kda_inputs()
    empty = torch.empty(0)
    cu = torch.tensor([0, 5, 12], dtype=torch.int64)
    for name, args in (("q", (q.half(), k, v)), ("k", (q, k.half(), v)), ("v", (q, k, v.half()))):
        with pytest.raises(ValueError, match=f"{name} has dtype torch.float16, expected torch.float32 or "
                                             "torch.bfloat16 .float16 bits are not BF16"):
            torch.ops.k3.kda_prefill(*args, g, beta, empty, empty, cu, empty, *KDA_CFG, torch.zeros((12, 2, 32)),
                                     torch.zeros((2, 2, 32, 32)))


def test_causal_conv1d_op_writes_in_place_with_the_numpy_bits_and_compiles():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 48, generator=g).to(torch.bfloat16)
    w = torch.randn(48, 4, generator=g).to(torch.bfloat16)
    st = torch.randn(2, 48, 4, generator=g).to(torch.bfloat16)
    cu = torch.tensor([0, 1, 5], dtype=torch.int64)
    want_st = st.view(torch.uint16).numpy().copy()
    want = k3.kda.causal_conv1d(x.view(torch.uint16).numpy(), w.view(torch.uint16).numpy(), conv_state=want_st,
                                cu_seqlens=cu.numpy())
    empty = torch.empty(0)

    def f(x, w, st, y):
        torch.ops.k3.causal_conv1d(x, w, empty, cu, st, True, y)
        return y

    for fn in (f, torch.compile(f, fullgraph=True)):
        s, y = st.clone(), torch.empty(5, 48, dtype=torch.bfloat16)
        fn(x, w, s, y)
        assert (y.view(torch.uint16).numpy() == want).all()
        assert (s.view(torch.uint16).numpy() == want_st).all()
