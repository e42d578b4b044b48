"""The CUDA entry points of the Python package (k3.kda.CudaKda, k3.moe.CudaMoe, the CUDA kernels of
the torch ops). These bindings have NEVER RUN ON A GPU (the C++ backend behind them ran on an
H200, 2026-12-04): on a machine without one, these tests
check what can be checked without a device (the build-without-CUDA error, planning for a
hand-described device, argument checks); the GPU tests skip, saying why."""

import numpy as np
import pytest

import k3
from k3 import _k3

CUDA_BUILT = _k3.cuda_compiled()
needs_no_cuda_build = pytest.mark.skipif(CUDA_BUILT, reason="this package was built with CUDA")
needs_cuda_build = pytest.mark.skipif(not CUDA_BUILT, reason="this package was built without CUDA "
                                      "(CMAKE_ARGS=\"-DK3_CUDA=ON\" pip install . builds it with)")


def _gpu():
    if not CUDA_BUILT:
        return "this package was built without CUDA"
    try:
        import torch
    except ImportError:
        return "torch is not installed (the GPU tests use torch CUDA tensors)"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


needs_gpu = pytest.mark.skipif(_gpu() is not None, reason=f"GPU test: {_gpu()}")

# A hand-described sm_90 device: planning is host code, so a plan needs no GPU.
H100 = {"name": "H100 (hand-described)", "cc_major": 9, "cc_minor": 0, "sm_count": 132,
        "smem_per_block_optin": 232448, "compiled_archs": [90]}


class FakeCudaArray:
    """Shape, dtype and a CUDA DLPack device, no memory: exercises the Python-side checks, which
    run before anything reaches the extension."""

    def __init__(self, shape, dtype, device=0):
        self.shape, self.dtype, self._device = tuple(shape), np.dtype(dtype), device

    def __dlpack_device__(self):
        return (2, self._device)

    def is_contiguous(self):
        return True


def test_info_reports_the_cuda_part_of_the_build():
    c = k3.info()["cuda"]
    assert c["compiled"] is CUDA_BUILT
    if not CUDA_BUILT:
        assert c["archs"] == "" and c["devices"] == []
        assert "without CUDA" in c["reason"]
    elif not c["devices"]:
        assert c["reason"], c  # why there is no device


@needs_no_cuda_build
def test_a_build_without_cuda_says_how_to_build_with_it():
    p = k3.moe.problem(hidden=64, intermediate=96, num_experts=8, top_k=2)
    w = [np.zeros(s, np.uint8) for s in [(8, 192, 32), (8, 192, 2), (8, 64, 48), (8, 64, 3)]]
    for make in (lambda: k3.kda.CudaKda(2, 16, 16), lambda: k3.moe.CudaMoe(p, *w),
                 lambda: _k3.cuda_device_caps(0), _k3.cuda_require):
        with pytest.raises(RuntimeError, match=r"built without CUDA.*-DK3_CUDA=ON"):
            make()
    # the bound names exist in every build (stubs, isinstance checks)
    assert _k3.CudaKdaPlan and _k3.CudaMoe and _k3.cuda_route


@needs_cuda_build
def test_without_a_device_the_cuda_entry_points_say_so():
    if k3.info()["cuda"]["devices"]:
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match="CUDA device"):
        k3.kda.CudaKda(2, 16, 16)
    with pytest.raises(RuntimeError, match="CUDA device"):
        _k3.cuda_device_caps(0)


def test_the_torch_kda_plan_cache_uses_the_library_replan_policy():
    # k3.torch keeps one CUDA KDA plan per configuration and re-plans by this rule (host-only code).
    assert _k3.cuda_kda_replan_max_seqs(0, 5) == 1024
    assert _k3.cuda_kda_replan_max_seqs(1024, 900) == 0
    assert _k3.cuda_kda_replan_max_seqs(1024, 2000) == 2000
    with pytest.raises(ValueError, match="sequences = 70000 must be in"):
        _k3.cuda_kda_replan_max_seqs(0, 70000)


@needs_cuda_build
def test_a_plan_for_a_described_device_sizes_the_workspace():
    kda = k3.kda.CudaKda(2, 16, 16, gate="log_decay", max_seqs=8, caps=H100)
    assert kda.workspace_bytes > 0 and isinstance(kda.plan, str) and kda.plan
    with pytest.raises(ValueError, match="caps has key 'smem'"):
        k3.kda.CudaKda(2, 16, 16, caps={"smem": 1})
    with pytest.raises(ValueError, match="algorithm"):
        k3.kda.CudaKda(2, 16, 16, algorithm="sideways", caps=H100)


@needs_cuda_build
def test_kda_argument_checks_name_the_argument_and_the_value():
    kda = k3.kda.CudaKda(2, 16, 16, gate="log_decay", max_seqs=8, caps=H100)
    n, h, d = 3, 2, 16
    ok = dict(q=FakeCudaArray((n, h, d), np.float32), k=FakeCudaArray((n, h, d), np.float32),
              v=FakeCudaArray((n, h, d), np.float32), g=FakeCudaArray((n, h, d), np.float32),
              beta=FakeCudaArray((n, h), np.float32), state_pool=FakeCudaArray((8, h, d, d), np.float32),
              state_indices=FakeCudaArray((n,), np.int32), o=FakeCudaArray((n, h, d), np.float32),
              workspace=FakeCudaArray((kda.workspace_bytes,), np.uint8))
    cases = [
        ("q", np.zeros((n, h, d), np.float32), "q must be a CUDA array, got one on the host"),
        ("q", [1.0], "q must be a CUDA array"),
        ("k", FakeCudaArray((n, h, d), np.float64), "k has dtype float64, expected float32"),
        ("g", FakeCudaArray((n, h, d + 1), np.float32), r"g has shape \(3, 2, 17\), expected \(3, 2, 16\)"),
        ("o", FakeCudaArray((n, h, d), np.float32, device=1), "o is on cuda:1, the plan is for cuda:0"),
        ("state_indices", FakeCudaArray((n,), np.int64), "state_indices has dtype int64, expected int32"),
        ("state_pool", FakeCudaArray((8, h, d, d), np.float64), "state_pool has dtype float64"),
        ("workspace", FakeCudaArray((16,), np.int32), "workspace has dtype int32, expected uint8"),
    ]
    for name, bad, msg in cases:
        with pytest.raises(ValueError, match=msg):
            kda.decode(**{**ok, name: bad})
    with pytest.raises(ValueError, match="stream = -1"):
        kda.decode(**ok, stream=-1)
    with pytest.raises(ValueError, match=r"state_indices must be \[N, T\]"):
        kda.verify(**ok, num_accepted=FakeCudaArray((n,), np.int32))


@needs_cuda_build
def test_moe_without_a_device_fails_cleanly_after_checking_the_weights():
    if k3.info()["cuda"]["devices"]:
        pytest.skip("a CUDA device is present")
    p = k3.moe.problem(hidden=64, intermediate=96, num_experts=8, top_k=2)
    w = [np.full(s, 127, np.uint8) for s in [(8, 192, 32), (8, 192, 2), (8, 64, 48), (8, 64, 3)]]
    with pytest.raises(ValueError, match="fc2_scale has shape"):
        k3.moe.CudaMoe(p, *w[:3], np.zeros((8, 64, 4), np.uint8), caps=H100)
    with pytest.raises(RuntimeError, match="cudaMalloc"):
        k3.moe.CudaMoe(p, *w, caps=H100)  # plans for the described device, then cannot upload
    with pytest.raises(RuntimeError, match="cudaMalloc"):
        k3.moe.CudaMoe(p, *w, caps=H100, path="prefill")  # a known path plans, then cannot upload
    with pytest.raises(ValueError, match="'fast' is not one of decode"):
        k3.moe.CudaMoe(p, *w, caps=H100, path="fast")


# ---- GPU tests (skipped without a device) ----------------------------------------------------

def _moe_case(out_dtype="fp32"):
    from test_k3 import random_moe
    p, w, x, ids, wts = random_moe()
    if out_dtype != "fp32":
        p = k3.moe.problem(hidden=64, intermediate=96, num_experts=8, top_k=2, out_dtype=out_dtype)
    return p, w, x, ids, wts


@needs_gpu
@pytest.mark.parametrize("out_dtype", ["fp32", "bf16"])
def test_cuda_moe_matches_the_cpu_backend_in_place_and_under_graph_replay(out_dtype):
    import torch
    p, w, x, ids, wts = _moe_case(out_dtype)
    want = k3.moe.run(p, **w, x=x, topk_ids=ids, topk_weights=wts, backend="cpu")
    layer = k3.moe.CudaMoe(p, **w, max_tokens=16, device=0)
    dev = torch.device("cuda", 0)
    tx, tids, twts = (torch.from_numpy(a).to(dev) for a in (x, ids, wts))
    odt = torch.float32 if out_dtype == "fp32" else torch.uint16
    out = torch.full((x.shape[0], 64), 0, dtype=odt, device=dev)
    ptr = out.data_ptr()
    m_dev = torch.tensor([x.shape[0]], dtype=torch.int32, device=dev)
    ws = layer.new_workspace()
    assert layer.run(tx, tids, twts, out, m_dev, ws, torch.cuda.current_stream()) is out
    torch.cuda.synchronize()
    assert out.data_ptr() == ptr
    got = out.cpu().numpy()
    if out_dtype == "fp32":
        # both backends are within 1e-5 (relative RMS) of the FP64 oracle: within 2e-5 of each other
        assert np.sqrt(((got - want) ** 2).sum() / (want ** 2).sum()) < 2e-5
    eager = got.copy()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        layer.run(tx, tids, twts, out, m_dev, ws, s)
    out.zero_()
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(out.cpu().numpy(), eager)


@needs_gpu
def test_cuda_kda_decode_matches_the_cpu_backend_and_replays_in_a_graph():
    import torch
    from test_k3 import kda_step_case
    n, h, d = 3, 2, 16
    q, k, v, g, beta, states = kda_step_case(n, 1)
    pool = np.zeros((6, h, d, d), np.float32)
    slots = np.array([4, 0, 2], np.int32)
    pool[slots] = states
    cpu_pool = pool.copy()
    want = k3.kda.decode(q, k, v, g, beta, cpu_pool, slots, gate="log_decay", backend="cpu")
    dev = torch.device("cuda", 0)
    t = {name: torch.from_numpy(a).to(dev) for name, a in dict(q=q, k=k, v=v, g=g, beta=beta).items()}
    tpool, tslots = torch.from_numpy(pool).to(dev), torch.from_numpy(slots).to(dev)
    o = torch.empty((n, h, d), dtype=torch.float32, device=dev)
    ptr = o.data_ptr()
    kda = k3.kda.CudaKda(h, d, d, gate="log_decay", max_seqs=8)
    ws = kda.new_workspace()
    kda.decode(**t, state_pool=tpool, state_indices=tslots, o=o, workspace=ws, stream=torch.cuda.current_stream())
    kda.status(ws)
    assert o.data_ptr() == ptr
    np.testing.assert_allclose(o.cpu().numpy(), want, rtol=1e-4, atol=1e-5)  # kda::kTolFp32
    np.testing.assert_allclose(tpool.cpu().numpy(), cpu_pool, rtol=1e-4, atol=1e-5)
    # graph capture of one decode step, replayed from the same starting pool: the eager bits
    tpool.copy_(torch.from_numpy(pool))
    kda.decode(**t, state_pool=tpool, state_indices=tslots, o=o, workspace=ws)
    torch.cuda.synchronize()
    eager_o, eager_pool = o.cpu().clone(), tpool.cpu().clone()
    s = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    tpool.copy_(torch.from_numpy(pool))
    torch.cuda.synchronize()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        kda.decode(**t, state_pool=tpool, state_indices=tslots, o=o, workspace=ws, stream=s)
    tpool.copy_(torch.from_numpy(pool))
    o.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o.cpu(), eager_o) and torch.equal(tpool.cpu(), eager_pool)
