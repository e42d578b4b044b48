"""Hardening, part 3: the argument classes shared by every Python entry point (thread counts,
row counts, dtypes checked before any allocation) and the `python -m k3 hf` command line under
bad flags and bad checkpoints. Each refusal names the argument, the limit and the value; each
test fails on the code before the fix (a segfault, nanobind's signature dump, a bool taken as 1,
an allocation error from torch, a traceback, or results lost after minutes of runs)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import k3
from k3._arrays import MAX_THREADS, MAX_TOKENS

if os.environ.get("K3_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch", reason="torch is not installed (scripts/test.sh installs it)")

import k3.torch  # noqa: E402

# ---- thread counts: one bound, k3::kMaxThreadCount, everywhere --------------------------------

BAD_THREADS = [MAX_THREADS + 1, 10 ** 6, 2 ** 40, -1, True, np.bool_(True), 2.0, "4"]


def conv_case():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    return x, w


@pytest.mark.parametrize("bad", BAD_THREADS, ids=repr)
def test_causal_conv1d_refuses_a_thread_count_past_the_limit(bad):
    """Item 11: a huge threads= segfaulted (it sized a per-thread buffer) and True ran as 1."""
    x, w = conv_case()
    want = k3.kda.causal_conv1d(x, w, threads=1)
    y = np.full_like(want, 7.0)
    with pytest.raises(ValueError, match=r"threads = .*(must be in \[0, 256\]|integer)"):
        k3.kda.causal_conv1d(x, w, y=y, threads=bad)
    assert (y == 7.0).all()
    np.testing.assert_array_equal(k3.kda.causal_conv1d(x, w, threads=MAX_THREADS), want)


@pytest.mark.parametrize("bad", [10 ** 6, 2 ** 40, True])
def test_every_binding_bounds_threads_and_max_tokens_by_name(bad):
    """Item 15: past the binding's C int, nanobind raised its signature dump; a bool was 1."""
    rng = np.random.default_rng(0)
    codes, scales = k3.linear.quantize_weight(rng.standard_normal((32, 64)).astype(np.float32))
    x = (rng.standard_normal((2, 64)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # BF16 bits
    with pytest.raises(ValueError, match="threads = "):
        k3.linear.run(codes, scales, x, threads=bad)
    with pytest.raises(ValueError, match="threads = "):
        k3.linear.CpuLinear(codes, scales, threads=bad)
    with pytest.raises(ValueError, match="max_tokens = "):
        k3.linear.CpuLinear(codes, scales, max_tokens=bad if bad is True else bad * MAX_TOKENS)
    with pytest.raises(ValueError, match="threads = "):
        k3.torch.Linear.from_linear(torch.nn.Linear(64, 32).to(torch.bfloat16), threads=bad)
    q = rng.standard_normal((4, 2, 16)).astype(np.float32)
    g = np.full((4, 2, 16), -0.1, np.float32)
    beta = np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match="threads = "):
        k3.kda.prefill(q, q, q, g, beta, gate="log_decay", threads=bad)


def test_error_messages_name_the_limit_and_the_value():
    x, w = conv_case()
    with pytest.raises(ValueError) as e:
        k3.kda.causal_conv1d(x, w, threads=300)
    assert str(e.value) == "threads = 300 must be in [0, 256]"
    with pytest.raises(ValueError) as e:
        k3.kda.causal_conv1d(x, w, threads=True)
    assert "threads = True" in str(e.value) and "bool" in str(e.value)


# ---- k3.torch.Linear: checked before anything is allocated ----------------------------------


def test_linear_refuses_a_huge_expanded_input_before_allocating():
    """Item 16: an expanded x of a few bytes standing for 2^31 rows made torch allocate the
    output (or the contiguous copy) first, and the error came from torch's allocator."""
    mod = k3.torch.Linear.from_linear(torch.nn.Linear(64, 32).to(torch.bfloat16), max_tokens=8)
    x = torch.zeros(1, 64, dtype=torch.bfloat16).expand(1 << 31, 64)
    with torch.no_grad(), pytest.raises(ValueError, match=rf"x has {1 << 31} rows .*MAX_TOKENS = {MAX_TOKENS}"):
        mod(x)
    # the dtype too is checked first (a float32 x of 2^31 rows would be refused only after the output)
    xf = torch.zeros(1, 64).expand(1 << 31, 64)
    with torch.no_grad(), pytest.raises(ValueError, match="x has dtype torch.float32, expected torch.bfloat16"):
        mod(xf)


# ---- FusedMoE: BF16 / FP16 router logits (still open from part 2) ---------------------------


def kimi_like(m=5, k=64, n=64, e=16, top_k=4, seed=5):
    rng = np.random.default_rng(seed)
    p = k3.moe.problem(hidden=k, intermediate=n, num_experts=e, top_k=top_k)
    w = dict(fc1_q=rng.integers(0, 256, (e, 2 * n, k // 2), dtype=np.uint8),
             fc1_scale=rng.integers(120, 124, (e, 2 * n, k // 32), dtype=np.uint8),
             fc2_q=rng.integers(0, 256, (e, k, n // 2), dtype=np.uint8),
             fc2_scale=rng.integers(120, 124, (e, k, n // 32), dtype=np.uint8))
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(torch.bfloat16)
    logits = torch.from_numpy(rng.standard_normal((m, e)).astype(np.float32))
    return p, w, x, logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_moe_takes_16_bit_router_logits_as_their_exact_fp32_values(dtype):
    """Raised "Got unsupported ScalarType BFloat16"; a 16-bit logit is exactly an FP32 one."""
    p, w, x, logits = kimi_like()
    layer = k3.torch.FusedMoE(p, **w, max_tokens=8)
    low = logits.to(dtype)
    with torch.inference_mode():
        got = layer(x, low)
        want = layer(x, low.float())
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="router_logits"):
        layer(x, logits.double())
    # the caller's name, not the op's ("x"), for FP32 activations (found by the hostile pass)
    with pytest.raises(ValueError, match="hidden_states has dtype torch.float32, expected torch.bfloat16"):
        layer(x.float(), logits)


# ---- python -m k3 hf: bad flags and bad checkpoints end in one line, before any run -----------


def hf(*args, cwd=None, timeout=120):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "k3", "hf", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def one_line_refusal(r, *needles):
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in r.stderr, (n, r.stderr)


@pytest.mark.parametrize("args,needle", [
    (["bench", "--threads", "-1"], "argument --threads: -1 must be in [0, 256]"),
    (["bench", "--threads", "1e3"], "'1e3' is not an integer"),
    (["bench", "--threads", "300"], "300 must be in [0, 256]"),
    (["bench", "--rounds", "0"], "--rounds"),
    (["bench", "--batch", "1,x"], "'x' is not an integer"),
    (["bench", "--prefill", ","], "the list is empty"),
    (["bench", "--experts", "8", "--top-k", "9"], "--top-k 9 must be at most --experts 8"),
    (["generate", "--dense", "--dtype", "float32"], "--dense needs a bfloat16 model"),
    (["bench", "--dense", "--k3-dtype", "float32"], "--k3-dtype is float32"),
    (["generate", "--isa", "avx9000"], "--isa avx9000"),
    (["bench", "--skip", "stock-fp64"], "--skip stock-fp64"),
    (["bench", "-o", "/no/such/dir/x.json"], "the directory /no/such/dir does not exist"),
    (["bench", "-o", "/"], "is a directory"),
    (["bench", "--plot", "/no/such/dir/x.png"], "--plot"),
])
def test_hf_cli_refuses_bad_flags_before_any_run(args, needle, tmp_path):
    """Items 12 and 17: these ran minutes of stock rounds first (and a bad -o lost them all), or
    ended in a traceback. Now: argparse's usage line and exit 2, before any model is built."""
    r = hf(*args, "--workdir", str(tmp_path / "model"))
    one_line_refusal(r, needle)
    assert r.returncode == 2
    assert not (tmp_path / "model").exists()  # refused before the random model was built


def write_config(path, doc, raw=None):
    path.mkdir()
    (path / "config.json").write_text(raw if raw is not None else json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("kind,needle", [
    ("missing", "has no config.json"),
    ("not-json", "is not valid JSON"),
    ("list", "holds a JSON list, expected an object"),
    ("llama", "model_type 'llama', expected 'kimi_linear'"),
])
def test_hf_cli_refuses_a_bad_checkpoint_config_in_one_line(kind, needle, tmp_path):
    p = tmp_path / "ckpt"
    if kind == "missing":
        p.mkdir()
        path = str(p)
    elif kind == "not-json":
        path = write_config(p, None, raw="{ model_type: kimi_linear")
    elif kind == "list":
        path = write_config(p, [1, 2])
    else:
        path = write_config(p, {"model_type": "llama"})
    for cmd in ("generate", "bench"):
        one_line_refusal(hf(cmd, "--checkpoint", path), needle)


def test_hf_cli_refuses_a_mistyped_config_and_a_truncated_shard_in_one_line(tmp_path):
    """A config whose fields have the wrong types, and a checkpoint whose safetensors shard was
    cut short, ended in transformers' tracebacks."""
    from test_hf import build, tiny_config
    model = build(tiny_config(), seed=1)
    good = tmp_path / "good"
    model.save_pretrained(good)
    doc = json.loads((good / "config.json").read_text())
    bad = dict(doc, num_hidden_layers="three")
    mistyped = write_config(tmp_path / "mistyped", bad)
    r = hf("generate", "--checkpoint", mistyped, "--new-tokens", "1", "--prompt-tokens", "2", "--dtype", "float32")
    one_line_refusal(r, "python -m k3 hf")
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    for f in good.iterdir():
        data = f.read_bytes()
        (trunc / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    r = hf("generate", "--checkpoint", str(trunc), "--new-tokens", "1", "--prompt-tokens", "2", "--dtype", "float32")
    one_line_refusal(r, "python -m k3 hf", str(trunc))


def test_hf_cli_writes_its_json_atomically(tmp_path):
    """Item 12: the JSON was written in place; a failure part-way left a truncated file. Now a
    temporary file in the same directory and a rename: a failed write keeps the old file whole."""
    from k3 import hf_cli
    out = tmp_path / "r.json"
    hf_cli._write_json_atomic(str(out), {"a": 1})
    assert json.loads(out.read_text()) == {"a": 1}
    with pytest.raises(TypeError):
        hf_cli._write_json_atomic(str(out), {"a": 2, "b": object()})  # json.dump fails half-way
    assert json.loads(out.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary left behind
