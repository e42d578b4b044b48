#!/usr/bin/env python3
"""A hostile pass over k3's public entry points: every case is a bad (or edge) input with what a
demanding user expects -- a ValueError / TypeError / SystemExit whose message names the argument,
or a non-zero exit naming the flag, or the stock result. Prints the table of tests/hostile_cases.md.

    build-venv/bin/python scripts/hostile_pass.py --k3 build-cpu/k3 > tests/hostile_cases.md

A case that crashes the interpreter ends the pass (then it is the defect to fix first). The
pass is a record, not a gate: each defect it found is fixed with its own test in the suites
(named in the last column)."""

import argparse
import os
import subprocess
import sys

import numpy as np

ROWS = []


def case(surface, what, test=""):
    def deco(fn):
        ROWS.append((surface, what, fn, test))
        return fn
    return deco


def refuses(fn, *needles, exc=(ValueError, TypeError)):
    try:
        fn()
    except exc as e:
        msg = str(e)
        missing = [n for n in needles if n not in msg]
        return (not missing, msg.splitlines()[0][:110] if not missing else f"message lacks {missing}: {msg[:90]}")
    except BaseException as e:  # noqa: BLE001
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    return False, "accepted"


def cli(k3, args, *needles, env=None, code=None):
    r = subprocess.run([k3, *args], capture_output=True, text=True, env=dict(os.environ, **(env or {})), timeout=300)
    out = r.stdout + r.stderr
    bad = [n for n in needles if n not in out]
    ok = r.returncode != 0 and not bad and "INTERNAL" not in out and (code is None or r.returncode == code)
    first = next((ln for ln in out.splitlines() if any(n in ln for n in needles)), out.strip().splitlines()[-1:] or [""])
    return ok, (f"exit {r.returncode}: " + (first if isinstance(first, str) else first[0]))[:110]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k3", default="build-cpu/k3")
    a = ap.parse_args()
    k3bin = os.path.abspath(a.k3)

    import torch
    import k3
    import k3.fla
    import k3.hf
    import k3.torch as k3t
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python", "tests"))
    from test_hf import build, tiny_config

    rng = np.random.default_rng(0)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    codes, scales = k3.linear.quantize_weight(f32(32, 64))
    xb = (f32(2, 64).view(np.uint32) >> 16).astype(np.uint16)
    lin = torch.nn.Linear(64, 32).to(torch.bfloat16)
    mod = k3t.Linear.from_linear(lin, max_tokens=8)
    q = f32(4, 2, 16)
    g = np.full((4, 2, 16), -0.1, np.float32)
    beta = np.zeros((4, 2), np.float32)
    pool = np.zeros((3, 2, 16, 16), np.float32)

    # ---- k3.linear / k3.torch.Linear / torch.ops.k3.linear -----------------------------------
    for t in (10 ** 6, 2 ** 40, -1, True, 2.5, "2"):
        case("k3.linear.run", f"threads={t!r}", "test_hostile_args")(
            lambda t=t: refuses(lambda: k3.linear.run(codes, scales, xb, threads=t), "threads"))
    for mt in (0, 2 ** 40, True, None):
        case("k3.linear.CpuLinear", f"max_tokens={mt!r}", "test_hostile_args")(
            lambda mt=mt: refuses(lambda: k3.linear.CpuLinear(codes, scales, max_tokens=mt), "max_tokens"))
    case("k3.linear.run", "x of 63 columns")(lambda: refuses(lambda: k3.linear.run(codes, scales, xb[:, :63]), "x"))
    case("k3.linear.run", "out overlapping x")(
        lambda: refuses(lambda: k3.linear.run(codes, scales, np.zeros((4, 64), np.uint16)[:2],
                                              out=np.zeros((4, 64), np.uint16)[:2, :32]), "out"))
    case("k3.linear.run", "recipe='w4a4'")(lambda: refuses(lambda: k3.linear.run(codes, scales, xb, recipe="w4a4"),
                                                           "recipe"))
    case("k3.linear.run", "backend='gpu'")(lambda: refuses(lambda: k3.linear.run(codes, scales, xb, backend="gpu"),
                                                           "gpu"))
    case("k3.torch.Linear", "float32 x")(lambda: refuses(lambda: mod(torch.zeros(2, 64)), "x has dtype"))
    case("k3.torch.Linear", "float16 x")(lambda: refuses(lambda: mod(torch.zeros(2, 64, dtype=torch.float16)),
                                                         "x has dtype"))
    case("k3.torch.Linear", "0-d x")(lambda: refuses(lambda: mod(torch.tensor(1.0)), "x has shape"))
    case("k3.torch.Linear", "x a numpy array")(lambda: refuses(lambda: mod(np.zeros((2, 64))), "torch.Tensor"))
    case("k3.torch.Linear", "expanded x of 2^31 rows", "test_hostile_args")(
        lambda: refuses(lambda: mod(torch.zeros(1, 64, dtype=torch.bfloat16).expand(1 << 31, 64)), "rows"))
    case("k3.torch.Linear", "x requiring grad (no kept module)", "test_hf_real_use")(
        lambda: refuses(lambda: mod(torch.zeros(2, 64, dtype=torch.bfloat16, requires_grad=True)), "requires grad",
                        exc=RuntimeError))
    case("torch.ops.k3.linear", "out overlapping x", "test_hf_real_use")(
        lambda: refuses(lambda: torch.ops.k3.linear(mod.handle, *(lambda b: (b[:128].view(2, 64), b[64:128].view(2, 32)))(
            torch.zeros(256, dtype=torch.bfloat16))), "overlaps"))
    case("torch.ops.k3.linear", "a stale handle")(
        lambda: refuses(lambda: torch.ops.k3.linear(10 ** 9, torch.zeros(1, 64, dtype=torch.bfloat16),
                                                    torch.zeros(1, 32, dtype=torch.bfloat16)), "not a prepared"))
    case("torch.ops.k3.linear", "non-contiguous out")(
        lambda: refuses(lambda: torch.ops.k3.linear(mod.handle, torch.zeros(2, 64, dtype=torch.bfloat16),
                                                    torch.zeros(32, 2, dtype=torch.bfloat16).T), "out"))
    for t in (257, 2 ** 40, True):
        case("k3.torch.Linear.from_linear", f"threads={t!r}", "test_hostile_args")(
            lambda t=t: refuses(lambda: k3t.Linear.from_linear(lin, threads=t), "threads"))

    # ---- KDA ops --------------------------------------------------------------------------------
    for t in (257, 10 ** 6, 2 ** 40, True, np.bool_(True), 2.0):
        case("k3.kda.causal_conv1d", f"threads={t!r}", "test_hostile_args")(
            lambda t=t: refuses(lambda: k3.kda.causal_conv1d(f32(6, 8), f32(8, 4), threads=t), "threads"))
    case("k3.kda.causal_conv1d", "weight of the wrong width")(
        lambda: refuses(lambda: k3.kda.causal_conv1d(f32(6, 8), f32(7, 4)), "weight"))
    case("k3.kda.causal_conv1d", "cu_seqlens past T")(
        lambda: refuses(lambda: k3.kda.causal_conv1d(f32(6, 8), f32(8, 4), cu_seqlens=[0, 9]), "cu_seqlens"))
    for fn_name, call in [
        ("prefill", lambda t: k3.kda.prefill(q, q, q, g, beta, gate="log_decay", threads=t)),
        ("decode", lambda t: k3.kda.decode(q, q, q, g, beta, pool, np.arange(4, dtype=np.int32) % 3, gate="log_decay",
                                           threads=t)),
    ]:
        for t in (2 ** 40, True):
            case(f"k3.kda.{fn_name}", f"threads={t!r}", "test_hostile_args")(
                lambda call=call, t=t: refuses(lambda: call(t), "threads"))
    case("k3.kda.prefill", "gate='bogus'")(lambda: refuses(lambda: k3.kda.prefill(q, q, q, g, beta, gate="bogus"), "gate"))
    case("k3.kda.prefill", "beta of the wrong shape")(
        lambda: refuses(lambda: k3.kda.prefill(q, q, q, g, beta[:, :1], gate="log_decay"), "beta"))
    case("k3.kda.prefill", "cu_seqlens decreasing")(
        lambda: refuses(lambda: k3.kda.prefill(q, q, q, g, beta, gate="log_decay", cu_seqlens=np.array([0, 3, 2, 4])),
                        "cu_seqlens"))
    case("k3.kda.decode", "slot index past the pool")(
        lambda: refuses(lambda: k3.kda.decode(q, q, q, g, beta, pool, np.array([0, 1, 2, 3], np.int32),
                                              gate="log_decay"), "state_indices"))
    case("k3.kda.decode", "duplicate slot indices")(
        lambda: refuses(lambda: k3.kda.decode(q, q, q, g, beta, pool, np.array([0, 1, 1, 2], np.int32),
                                              gate="log_decay"), "state_indices"))
    case("k3.kda.decode", "state_pool read-only")(
        lambda: refuses(lambda: k3.kda.decode(q, q, q, g, beta, (lambda p: (p.setflags(write=False), p)[1])(pool.copy()),
                                              np.arange(4, dtype=np.int32) % 3 + 0 * 0, gate="log_decay"), "state_pool"))

    # ---- fla-compatible entry points ------------------------------------------------------------
    tq = torch.randn(1, 4, 2, 16)
    tg = torch.full((1, 4, 2, 16), -0.1)
    tb = torch.rand(1, 4, 2)
    st = torch.zeros(3, 2, 16, 16)
    case("k3.fla.fused_recurrent_kda", "int64 slot index 2^32 (wraps to 0 as int32)", "test_hf_real_use")(
        lambda: refuses(lambda: k3.fla.fused_recurrent_kda(
            tq.reshape(1, 4, 2, 16)[:, :1].expand(4, 1, 2, 16).contiguous(), tq[:, :1].expand(4, 1, 2, 16).contiguous(),
            tq[:, :1].expand(4, 1, 2, 16).contiguous(), tg[:, :1].expand(4, 1, 2, 16).contiguous(),
            tb[:, :1].expand(4, 1, 2).contiguous(), initial_state=st,
            ssm_state_indices=torch.tensor([0, 1, 2, 1 << 32])), "ssm_state_indices"))
    case("k3.fla.fused_recurrent_kda", "float num_accepted_tokens", "test_hf_real_use")(
        lambda: refuses(lambda: k3.fla.fused_recurrent_kda(
            *(t.reshape(2, 2, *t.shape[2:]) for t in (tq, tq, tq, tg, tb)), initial_state=torch.zeros(4, 2, 16, 16),
            ssm_state_indices=torch.tensor([[0, 1], [2, 3]]), num_accepted_tokens=torch.tensor([1.5, 1.0])),
            "num_accepted_tokens"))
    case("k3.fla.chunk_kda", "an unknown keyword")(
        lambda: refuses(lambda: k3.fla.chunk_kda(tq, tq, tq, tg, tb, foo=1), "foo"))
    case("k3.fla.chunk_kda", "q requiring grad")(
        lambda: refuses(lambda: k3.fla.chunk_kda(tq.clone().requires_grad_(), tq, tq, tg, tb), "requires grad"))
    case("k3.fla.chunk_kda", "return_intermediate_states=True")(
        lambda: refuses(lambda: k3.fla.chunk_kda(tq, tq, tq, tg, tb, return_intermediate_states=True),
                        "return_intermediate_states"))
    case("k3.fla.chunk_kda", "threads=2**40")(
        lambda: refuses(lambda: k3.fla.chunk_kda(tq, tq, tq, tg, tb, threads=2 ** 40), "threads"))

    # ---- routing, MoE --------------------------------------------------------------------------
    logits = f32(3, 16)
    case("k3.route", "top_k > experts")(lambda: refuses(lambda: k3.route(logits, top_k=17), "top_k"))
    case("k3.route", "float64 logits")(lambda: refuses(lambda: k3.route(logits.astype(np.float64), top_k=4), "logits"))
    case("k3.route", "top_k=True")(lambda: refuses(lambda: k3.route(logits, top_k=True), "top_k"))
    case("k3.route", "bias of the wrong length")(lambda: refuses(lambda: k3.route(logits, f32(15), top_k=4), "bias"))
    p = k3.moe.problem(hidden=64, intermediate=64, num_experts=16, top_k=4)
    w = dict(fc1_q=rng.integers(0, 256, (16, 128, 32), dtype=np.uint8),
             fc1_scale=rng.integers(120, 124, (16, 128, 2), dtype=np.uint8),
             fc2_q=rng.integers(0, 256, (16, 64, 32), dtype=np.uint8),
             fc2_scale=rng.integers(120, 124, (16, 64, 2), dtype=np.uint8))
    for t in (2 ** 40, True):
        case("k3.moe.CpuMoe", f"threads={t!r}", "test_hostile_args")(
            lambda t=t: refuses(lambda: k3.moe.CpuMoe(p, **w, threads=t), "threads"))
    case("k3.moe.CpuMoe", "max_tokens=2**40")(lambda: refuses(lambda: k3.moe.CpuMoe(p, **w, max_tokens=2 ** 40),
                                                              "max_tokens"))
    case("k3.moe.problem", "hidden=100 (not a multiple of 32)")(lambda: refuses(lambda: k3.moe.problem(hidden=100), "100"))
    case("k3.moe.problem", "ep_rank >= ep_size")(lambda: refuses(lambda: k3.moe.problem(ep_size=2, ep_rank=2), "ep_rank"))
    layer = k3t.FusedMoE(p, **w, max_tokens=8)
    xt = torch.randn(3, 64).to(torch.bfloat16)
    lt = torch.from_numpy(logits)
    case("k3.torch.FusedMoE", "BF16 router logits (computed as their FP32 values)", "test_hostile_args")(
        lambda: (torch.equal(layer(xt, lt.to(torch.bfloat16)), layer(xt, lt.to(torch.bfloat16).float())), "same bits"))
    case("k3.torch.FusedMoE", "float64 router logits", "test_hostile_args")(
        lambda: refuses(lambda: layer(xt, lt.double()), "router_logits"))
    case("k3.torch.FusedMoE", "float32 hidden_states")(lambda: refuses(lambda: layer(xt.float(), lt), "hidden_states"))
    case("k3.torch.FusedMoE", "logits with 15 experts")(lambda: refuses(lambda: layer(xt, lt[:, :15]), "router_logits"))

    # ---- k3.hf.patch ---------------------------------------------------------------------------
    def model():
        return build(tiny_config(), seed=1, dtype=torch.bfloat16)
    for kw, needle in [(dict(threads=300), "threads"), (dict(threads=True), "threads"), (dict(threads=-1), "threads"),
                       (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=True), "max_tokens"),
                       (dict(recipe="w4a4"), "recipe"), (dict(isa="avx9000"), "isa"), (dict(isa=3), "isa"),
                       (dict(norms="yes"), "norms")]:
        case("k3.hf.patch", ", ".join(f"{k}={v!r}" for k, v in kw.items()), "test_hf / test_hf_real_use")(
            lambda kw=kw, needle=needle: refuses(lambda: k3.hf.patch(model(), **kw), needle))
    case("k3.hf.patch", "a model in training mode")(lambda: refuses(lambda: k3.hf.patch(model().train()), "training"))
    case("k3.hf.patch", "not a model")(lambda: refuses(lambda: k3.hf.patch(torch.nn.Linear(2, 2)), "Kimi-Linear"))

    def twice():
        m = model()
        k3.hf.patch(m)
        k3.hf.patch(m)
    case("k3.hf.patch", "patched twice")(lambda: refuses(twice, "already patched"))

    def reload():
        m = model()
        sd = {k: v.clone() for k, v in m.state_dict().items()}
        k3.hf.patch(m)
        m.load_state_dict(sd)
    case("k3.hf (patched model)", "load_state_dict after the patch", "test_hf_real_use")(
        lambda: refuses(reload, "load_state_dict", exc=(RuntimeError, ValueError)))

    def inference_mode():
        m = model()
        k3.hf.patch(m, dense=True)
        with torch.inference_mode():
            a = m(torch.tensor([[3, 4, 5]])).logits
        with torch.no_grad():
            b = m(torch.tensor([[3, 4, 5]])).logits
        return torch.equal(a, b), "inference_mode bits == no_grad bits"
    case("k3.hf (patched model)", "dense=True forward under inference_mode", "test_hf_real_use")(inference_mode)

    def assisted_bf16():
        m = model()
        k3.hf.patch(m)
        with torch.no_grad():
            out = m.generate(torch.tensor([[1, 5, 9, 12, 5, 9, 12, 5]]), max_new_tokens=6, do_sample=False,
                             prompt_lookup_num_tokens=80)
        return out.shape[1] == 14, f"generated {out.shape[1] - 8} tokens"
    case("k3.hf (patched model)", "BF16 prompt lookup with 80 drafts", "test_hf_real_use")(assisted_bf16)

    # ---- the k3 tool ---------------------------------------------------------------------------
    cli_cases = [
        (["validate", "--op", "linear", "--suite", "smoke", "--backend", "gpu"], ["is not known"], {}),
        (["validate", "--op", "linear", "--suite", "smoke", "--backend", "cuda"], ["FAIL"], {}),
        (["validate", "--op", "linear", "--suite", "smoke", "--require", "cuda"], ["require cuda"], {}),
        (["bench", "linear", "--shapes", "1048576x1048576", "--pool-mib", "1"], ["use smaller --shapes"], {}),
        (["bench", "linear", "--shapes", "96x40", "--pool-mib", "65536", "--bw-mib", "65536"], ["--pool-mib 65536"], {}),
        (["bench", "linear", "--threads", "-1"], ["--threads"], {}),
        (["bench", "moe", "--threads", "257"], ["--threads"], {}),
        (["bench", "kda", "--threads", "100000"], ["--threads"], {}),
        (["validate", "--op", "formats"], ["K3_NUM_THREADS = '1e3'"], {"K3_NUM_THREADS": "1e3"}),
        (["validate", "--op", "formats"], ["K3_NUM_THREADS = 'abc'"], {"K3_NUM_THREADS": "abc"}),
        (["validate", "--op", "formats"], ["K3_NUM_THREADS = '99999999999'"], {"K3_NUM_THREADS": "99999999999"}),
        (["validate", "--op", "formats"], ["K3_NUM_THREADS = '-1'"], {"K3_NUM_THREADS": "-1"}),
        (["validate", "--op", "formats"], ["K3_ISA=garbage"], {"K3_ISA": "garbage"}),
        (["bench", "kda", "--heads", "1024", "--head-dim", "512", "--prefill-t", "1048576", "--decode-n", "1"],
         ["needs"], {}),
        (["kda", "run", "--input", "/nonexistent.st", "--output", "/tmp/x.st"], ["/nonexistent.st"], {}),
        (["bench", "linear", "--shapes", "100x40", "--pool-mib", "1"], ["multiple of 32"], {}),
    ]
    for args, needles, env in cli_cases:
        envs = " ".join(f"{k}={v}" for k, v in env.items())
        case("k3 " + " ".join(args[:2]), (envs + " " if envs else "") + " ".join(args[2:]), "test_hostile_cli")(
            lambda args=args, needles=needles, env=env: cli(k3bin, args, *needles, env=env))

    hf = [sys.executable, "-m", "k3", "hf"]
    hf_cases = [
        (["bench", "--threads", "-1"], "must be in [0, 256]"), (["bench", "--threads", "1e3"], "is not an integer"),
        (["bench", "--batch", "1,x"], "is not an integer"), (["bench", "-o", "/no/such/dir/x.json"], "does not exist"),
        (["generate", "--dense", "--dtype", "float32"], "--dense needs a bfloat16 model"),
        (["generate", "--isa", "avx9000"], "--isa avx9000"), (["bench", "--skip", "stock-fp64"], "--skip"),
        (["bench", "--experts", "8", "--top-k", "9"], "--top-k 9"),
        (["generate", "--checkpoint", "/nonexistent"], "no config.json"),
    ]
    for args, needle in hf_cases:
        case("python -m k3 hf", " ".join(args), "test_hostile_args")(
            lambda args=args, needle=needle: cli(hf[0], hf[1:] + args, needle))

    print("# Hostile cases: the pass of issue 56 (hardening, part 3)\n")
    print("Generated by `build-venv/bin/python scripts/hostile_pass.py --k3 build-cpu/k3 > tests/hostile_cases.md`"
          " (CPU build, no GPU). `ok`: refused with a message naming the argument (or the flag), or the stock"
          " result; `DEFECT`: anything else. The suite test that covers a case is named where one does.\n")
    print("| # | entry point | case | result | what k3 said | test |")
    print("|---|---|---|---|---|---|")
    good = 0
    for i, (surface, what, fn, test) in enumerate(ROWS, 1):
        try:
            ok, msg = fn()
        except BaseException as e:  # noqa: BLE001
            ok, msg = False, f"{type(e).__name__}: {e}"[:110]
        good += bool(ok)
        msg = str(msg).replace("|", "\\|").replace("\n", " ")
        print(f"| {i} | `{surface}` | {what.replace('|', '/')} | {'ok' if ok else 'DEFECT'} | {msg} | {test} |",
              flush=True)
    print(f"\n**{good} of {len(ROWS)} cases behave; {len(ROWS) - good} defects.**")
    return 0 if good == len(ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
