"""Speculative verify without snapshots from Python: k3.kda.verify_replay / commit, the torch ops
k3::kda_verify_replay / kda_commit (opcheck, torch.compile), fla's fused_recurrent_kda with k3's
replay_window, and the refusals. Every result is compared bit for bit with decode run token by
token."""
import os

import numpy as np
import pytest

import k3
import k3.kda

H, K, V = 3, 32, 16


def case(lens, seed, bf16=False, slots=None):
    rng = np.random.default_rng(seed)
    rows = int(sum(lens))
    act = (lambda shape: (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)) if bf16 else (
        lambda shape: rng.standard_normal(shape).astype(np.float32))
    q, k, v = act((rows, H, K)), act((rows, H, K)), act((rows, H, V))
    g = rng.standard_normal((rows, H, K)).astype(np.float32)
    beta = rng.standard_normal((rows, H)).astype(np.float32)
    a_log = rng.uniform(-1, 1, H).astype(np.float32)
    dt_bias = rng.standard_normal((H, K)).astype(np.float32)
    pool = (0.1 * rng.standard_normal((slots or len(lens) + 2, H, K, V))).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return dict(q=q, k=k, v=v, g=g, beta=beta, a_log=a_log, dt_bias=dt_bias), pool, cu


def decode_by_token(t, pool, cu, idx, acc, **kw):
    """decode one token at a time: every draft token's o, and the pool after each sequence's
    accepted prefix."""
    run, want = pool.copy(), pool.copy()
    o = np.zeros((int(cu[-1]), H, V), np.float32)
    for step in range(int(np.max(np.diff(cu))) + 1):
        for n, s in enumerate(idx):
            if s >= 0 and acc[n] == step:
                want[s] = run[s]
        rows = [cu[n] + step for n in range(len(idx)) if cu[n] + step < cu[n + 1]]
        sl = np.array([idx[n] for n in range(len(idx)) if cu[n] + step < cu[n + 1]], np.int32)
        if not rows:
            continue
        sub = {name: np.ascontiguousarray(t[name][rows]) for name in ("q", "k", "v", "g", "beta")}
        o[rows] = k3.kda.decode(**sub, state_pool=run, state_indices=sl, a_log=t["a_log"], dt_bias=t["dt_bias"],
                                backend="cpu", **kw)
    for n, s in enumerate(idx):
        if s < 0:
            o[cu[n]:cu[n + 1]] = 0
    return o, want


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("layout", ["k_first", "v_first"])
def test_verify_replay_and_commit_equal_decode_bit_for_bit(bf16, layout):
    lens = [4, 1, 3, 2]
    t, pool0, cu = case(lens, seed=7 + bf16, bf16=bf16, slots=6)
    if layout == "v_first":
        pool0 = np.ascontiguousarray(pool0.transpose(0, 1, 3, 2))
    idx = np.array([5, 0, -1, 2], np.int32)
    acc = np.array([3, 1, 0, 0], np.int32)
    kw = dict(gate="safe", layout=layout)
    want_o, want_pool = decode_by_token(t, pool0, cu, idx, acc, **kw)
    tw = 4
    window = np.zeros((6, k3.kda.replay_window_floats(H, K, V, tw)), np.float32)
    pool = pool0.copy()
    o = k3.kda.verify_replay(**t, state_pool=pool, state_indices=idx, window_pool=window, window_tokens=tw,
                             cu_seqlens=cu, backend="cpu", **kw)
    np.testing.assert_array_equal(pool, pool0)  # verify_replay reads the pool only
    assert o.tobytes() == want_o.tobytes()
    k3.kda.commit(pool, window, idx, acc, tw, H, K, V, layout=layout, backend="cpu")
    assert pool.tobytes() == want_pool.tobytes()
    assert window.shape[1] == tw * H * (2 * K + V + 2) + 1


def test_commit_refusals_name_the_argument():
    t, pool, cu = case([2, 2], seed=3)
    idx = np.array([0, 1], np.int32)
    window = np.zeros((pool.shape[0], k3.kda.replay_window_floats(H, K, V, 2)), np.float32)
    k3.kda.verify_replay(**t, state_pool=pool, state_indices=idx, window_pool=window, window_tokens=2, backend="cpu")
    with pytest.raises(ValueError, match=r"num_accepted\[0\] = 3 must be in \[0, window_tokens = 2\]"):
        k3.kda.commit(pool, window, idx, np.array([3, 0], np.int32), 2, H, K, V)
    with pytest.raises(ValueError, match="state slot 1 is named twice"):
        k3.kda.commit(pool, window, np.array([1, 1], np.int32), np.array([1, 1], np.int32), 2, H, K, V)
    with pytest.raises(ValueError, match="num_accepted has dtype int64, expected int32"):
        k3.kda.commit(pool, window, idx, np.array([1, 1]), 2, H, K, V)
    k3.kda.commit(pool, window, idx, np.array([2, 0], np.int32), 2, H, K, V)
    with pytest.raises(ValueError, match="exceeds the 0 draft tokens verified into window slot 0"):
        k3.kda.commit(pool, window, idx, np.array([1, 0], np.int32), 2, H, K, V)
    with pytest.raises(ValueError, match="state_pool overlaps window_pool"):
        k3.kda.commit(pool, pool.reshape(pool.shape[0], -1), idx, np.array([0, 0], np.int32), 2, H, K, V)
    with pytest.raises(ValueError, match="window_tokens = 0 must be in"):
        k3.kda.replay_window_floats(H, K, V, 0)


try:
    import torch

    import k3.torch  # noqa: F401  (registers torch.ops.k3.*)
except ImportError:  # K3_REQUIRE_TORCH=1 (scripts/test.sh): the tests below fail instead of skipping
    torch = None
needs_torch = pytest.mark.skipif(torch is None and os.environ.get("K3_REQUIRE_TORCH") != "1",
                                 reason="torch is not installed")


def torch_case(lens, seed):
    t, pool, cu = case(lens, seed)
    tt = {name: torch.from_numpy(a) for name, a in t.items()}
    return tt, torch.from_numpy(pool), torch.from_numpy(cu)


KDA_CFG = ("safe", -5.0, True, True, 0.0, "k_first")


@needs_torch
def test_torch_ops_match_the_library_and_pass_opcheck_and_compile():
    t, pool0, cu = torch_case([3, 2], seed=11)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    acc = torch.tensor([2, 1], dtype=torch.int32)
    tw = 3
    f = k3.kda.replay_window_floats(H, K, V, tw)
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"], t["a_log"], t["dt_bias"], cu, tw)
    torch.library.opcheck(torch.ops.k3.kda_verify_replay.default,
                          args + (pool0.clone(), idx, torch.zeros(pool0.shape[0], f), *KDA_CFG, torch.zeros(5, H, V)))
    window = torch.zeros(pool0.shape[0], f)
    o = torch.zeros(5, H, V)
    torch.ops.k3.kda_verify_replay(*args, pool0, idx, window, *KDA_CFG, o)
    torch.library.opcheck(torch.ops.k3.kda_commit.default, (pool0.clone(), window.clone(), idx, acc, tw, H, K, V,
                                                            "k_first"))

    def step(pool, window, o):
        torch.ops.k3.kda_verify_replay(*args, pool, idx, window, *KDA_CFG, o)
        torch.ops.k3.kda_commit(pool, window, idx, acc, tw, H, K, V, "k_first")
        return o * 2.0

    eager = (pool0.clone(), torch.zeros(pool0.shape[0], f), torch.zeros(5, H, V))
    want = step(*eager)
    got_bufs = (pool0.clone(), torch.zeros(pool0.shape[0], f), torch.zeros(5, H, V))
    got = torch.compile(step, fullgraph=True)(*got_bufs)
    assert torch.equal(got, want) and torch.equal(got_bufs[0], eager[0])
    # the library's result, bit for bit
    tn = {name: a.numpy() for name, a in t.items()}
    want_o, want_pool = decode_by_token(tn, pool0.numpy(), cu.numpy(), idx.numpy(), acc.numpy(), gate="safe")
    assert eager[2].numpy().tobytes() == want_o.tobytes()
    assert eager[0].numpy().tobytes() == want_pool.tobytes()


@needs_torch
def test_torch_ops_refuse_cuda_tensors_by_name():
    """The ops run on the CPU backend only: their CUDA kernel is a refusal naming the op (checked
    through the dispatcher's registration here; this machine has no CUDA device)."""
    for op in ("kda_verify_replay", "kda_commit"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"k3::{op}", "CUDA")
        with pytest.raises(ValueError, match=f"k3::{op} runs on the CPU backend only"):
            k3.torch._cpu_only(op)()


@needs_torch
def test_fla_fused_recurrent_kda_with_replay_window_equals_decode():
    import k3.fla
    n, tw = 2, 3
    t, pool0, _ = torch_case([tw] * n, seed=21)
    pool0 = pool0[:4].contiguous()
    idx = torch.tensor([3, 1], dtype=torch.int32)
    window = torch.zeros(4, k3.kda.replay_window_floats(H, K, V, tw))
    qkvgb = [t[name].view(n, tw, *t[name].shape[1:]) for name in ("q", "k", "v", "g", "beta")]
    gate = dict(A_log=t["a_log"], dt_bias=t["dt_bias"].reshape(-1), use_gate_in_kernel=True, lower_bound=-5.0,
                use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    pool = pool0.clone()
    # round 1: drafts of 3 tokens each, nothing committed yet; round 2: commit 2 and 0 of them
    o1, ret = k3.fla.fused_recurrent_kda(*qkvgb, initial_state=pool, ssm_state_indices=idx, replay_window=window,
                                         **gate)
    assert ret is pool and torch.equal(pool, pool0)
    acc = torch.tensor([2, 0], dtype=torch.int32)
    o2, _ = k3.fla.fused_recurrent_kda(*qkvgb, initial_state=pool, ssm_state_indices=idx, replay_window=window,
                                       num_accepted_tokens=acc, **gate)
    # the same by fla-style decode, one token at a time
    ref = pool0.clone()
    for step in range(2):
        one = [x[:1, step:step + 1].contiguous() for x in qkvgb]
        k3.fla.fused_recurrent_kda(*one, initial_state=ref, ssm_state_indices=idx[:1], **gate)
    assert pool.numpy().tobytes() == ref.numpy().tobytes()
    # round 1's outputs are those of decode from the unchanged pool
    dec = pool0.clone()
    outs = []
    for step in range(tw):
        one = [x[:, step:step + 1].contiguous() for x in qkvgb]
        o, _ = k3.fla.fused_recurrent_kda(*one, initial_state=dec, ssm_state_indices=idx, **gate)
        outs.append(o)
    assert torch.equal(o1, torch.cat(outs, dim=1))
    assert not torch.equal(o2, o1)  # round 2 ran from the committed states
    with pytest.raises(ValueError, match=r"replay_window must be a contiguous float32 \[slots = 4"):
        k3.fla.fused_recurrent_kda(*qkvgb, initial_state=pool, ssm_state_indices=idx,
                                   replay_window=torch.zeros(4, 7), **gate)
    with pytest.raises(ValueError, match=r"with replay_window, ssm_state_indices must be \[N\]"):
        k3.fla.fused_recurrent_kda(*qkvgb, initial_state=pool, ssm_state_indices=idx.view(2, 1).repeat(1, 3),
                                   replay_window=window, **gate)
    with pytest.raises(ValueError, match=r"num_accepted_tokens has shape \(3,\), expected \(2,\)"):
        k3.fla.fused_recurrent_kda(*qkvgb, initial_state=pool, ssm_state_indices=idx, replay_window=window,
                                   num_accepted_tokens=torch.zeros(3, dtype=torch.int32), **gate)
