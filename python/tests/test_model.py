"""The native runner (k3.Model, k3/model.hpp) against stock transformers KimiLinearForCausalLM on
the same quantized weights: a random BF16 checkpoint whose experts hold MXFP4 values (and, for the
MXFP8 trunk, whose projections hold MXFP8 values), saved with save_pretrained and loaded by both.
Teacher-forced logits at every position within a stated bound, greedy tokens equal wherever the
stock top-2 margin exceeds it, prompts of length 1 and > 1, batch > 1, decode after prefill, the
same bits at any thread count, and the refusals (absurd configs, missing / truncated shards,
wrong tensors, a prompt longer than the state pool)."""

import json
import os
import shutil

import numpy as np
import pytest

if os.environ.get("K3_REQUIRE_TORCH") == "1":
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch", reason="torch is not installed (scripts/test.sh installs it)")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import k3  # noqa: E402
import k3.hf  # noqa: E402
from test_hf import mxfp8_round  # noqa: E402

from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402
from transformers.models.kimi_linear import modeling_kimi_linear as mkl  # noqa: E402

# Two references. A model without routing (every MLP dense) is smooth: there k3's logits lie within
# REL_BOUND of stock BF16's, relative to the row's largest |logit| (both compute in BF16 between ops
# but round in different places: k3's conv + SiLU round once, stock twice; MLA absorbed in FP32
# against stock's BF16 expansion and sdpa; FP32 accumulation orders). With routed experts, a
# BF16-sized difference flips near-tied expert choices, and stock BF16 itself then lies up to 28 %
# from stock FP32 on the same weights; there k3 must be no further from the FP32 model than stock's
# own BF16 run is (RMS over all logits, within NOISE_FACTOR).
REL_BOUND = 0.05
NOISE_FACTOR = 2.0


def config(**over):
    """4 layers: KDA, KDA, MLA, KDA (the published 1-based lists), a dense layer 0, 64 experts top-8
    with one shared expert, sigmoid routing with correction bias, scaling 2.446."""
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None,
              kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_experts=64,
              num_experts_per_token=8, num_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.446,
              moe_renormalize=True, rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, initializer_range=0.2,
              linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "head_dim": 32, "num_heads": 2,
                                  "short_conv_kernel_size": 4})
    kw.update(over)
    return KimiLinearConfig(**kw)


def write_checkpoint(path, cfg, trunk="bf16", seed=0):
    """A random model whose weights are exact in what the runner holds (MXFP4 experts; with
    trunk="mxfp8" MXFP8 projections), saved in BF16; returns the stock model reloaded from it."""
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, mkl.KimiLinearTopkRouter):
                mod.e_score_correction_bias.normal_(0, 0.1)
        k3.hf.mxfp4_roundtrip_(model)
        if trunk == "mxfp8":
            for name, mod in model.named_modules():
                if isinstance(mod, torch.nn.Linear) and mod.in_features % 32 == 0:
                    mod.weight.copy_(mxfp8_round(mod.weight.to(torch.bfloat16).float()))
    model.to(torch.bfloat16).save_pretrained(path)
    return KimiLinearForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


DENSE = dict(mlp_layer_types=["dense"] * 4)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """MoE layers (the full model), BF16 trunk."""
    d = tmp_path_factory.mktemp("kimi_linear_bf16")
    return str(d), write_checkpoint(str(d), config())


@pytest.fixture(scope="module")
def ckpt_mxfp8(tmp_path_factory):
    d = tmp_path_factory.mktemp("kimi_linear_mxfp8")
    return str(d), write_checkpoint(str(d), config(), trunk="mxfp8", seed=1)


@pytest.fixture(scope="module")
def dense_ckpts(tmp_path_factory):
    """No routing: every layer's MLP dense (KDA, KDA, MLA, KDA), one checkpoint per trunk."""
    out = {}
    for trunk in ("bf16", "mxfp8"):
        d = tmp_path_factory.mktemp(f"kimi_linear_dense_{trunk}")
        out[trunk] = (str(d), write_checkpoint(str(d), config(**DENSE), trunk=trunk, seed=2))
    return out


def stock_logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def within_bound(got, want, what):
    scale = np.abs(want).max(axis=-1, keepdims=True)
    err = np.abs(got - want) / scale
    assert err.max() <= REL_BOUND, f"{what}: max |k3 - stock| / max|logit| = {err.max():.4f} > {REL_BOUND}"
    return err.max()


def margins_agree(got, want, what):
    """Greedy choices equal wherever the stock top-2 margin exceeds the bound (per position)."""
    srt = np.sort(want, axis=-1)
    margin = (srt[:, -1] - srt[:, -2]) / np.abs(want).max(axis=-1)
    sure = margin > 2 * REL_BOUND
    assert sure.sum() >= 1, f"{what}: no position with a clear stock choice"
    np.testing.assert_array_equal(got.argmax(-1)[sure], want.argmax(-1)[sure], err_msg=what)


PROMPT = [1, 17, 33, 5, 200, 9, 77, 12, 140, 3, 250, 64]


@pytest.mark.parametrize("trunk", ["bf16", "mxfp8"])
def test_teacher_forced_logits_match_transformers_without_routing(dense_ckpts, trunk):
    path, stock = dense_ckpts[trunk]
    m = k3.Model.from_pretrained(path, trunk=trunk)
    want = stock_logits(stock, PROMPT)
    got = m.forward(PROMPT, m.new_state(), all_logits=True)
    assert got.shape == want.shape == (len(PROMPT), 256)
    within_bound(got, want, f"trunk {trunk}, teacher-forced")
    margins_agree(got, want, f"trunk {trunk}, teacher-forced")
    assert np.abs(want).max() > 1.0  # logits large enough for the bound to mean something


@pytest.mark.parametrize("trunk", ["bf16", "mxfp8"])
def test_teacher_forced_logits_with_routed_experts_are_within_bf16_noise(ckpt, ckpt_mxfp8, tmp_path, trunk):
    path, stock = ckpt if trunk == "bf16" else ckpt_mxfp8
    stock32 = KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    m = k3.Model.from_pretrained(path, trunk=trunk)
    ref = stock_logits(stock32, PROMPT)
    noise = np.sqrt(((stock_logits(stock, PROMPT) - ref) ** 2).mean())
    got = m.forward(PROMPT, m.new_state(), all_logits=True)
    err = np.sqrt(((got - ref) ** 2).mean())
    assert err <= NOISE_FACTOR * noise, f"RMS |k3 - fp32| = {err:.4f}, stock BF16's own = {noise:.4f}"
    assert err <= 0.25 * np.sqrt((ref ** 2).mean())  # and far below the logits themselves


def test_prompt_of_one_token_and_decode_after_prefill(dense_ckpts):
    path, stock = dense_ckpts["bf16"]
    m = k3.Model.from_pretrained(path, trunk="bf16")
    s = m.new_state()
    first = m.forward(PROMPT[:1], s)
    within_bound(first[None], stock_logits(stock, PROMPT[:1]), "one-token prompt")
    # Prefill 5 tokens, then decode token by token: each step's logits against stock's teacher-forced row.
    s.reset()
    want = stock_logits(stock, PROMPT)
    rows = [m.forward(PROMPT[:5], s)]
    for t in range(5, len(PROMPT)):
        rows.append(m.forward([PROMPT[t]], s))
    got = np.stack(rows)
    within_bound(got, want[4:], "decode after prefill")
    margins_agree(got, want[4:], "decode after prefill")
    assert s.position == len(PROMPT)


def test_batch_of_sequences_is_each_sequence_alone(ckpt, dense_ckpts):
    path, stock = dense_ckpts["bf16"]
    m = k3.Model.from_pretrained(path, trunk="bf16", max_seqs=3)
    seqs = [PROMPT, [4, 8, 15, 16, 23, 42], [99]]
    states = [m.new_state() for _ in seqs]
    batch = m.forward(seqs, states, all_logits=True)
    for ids, got in zip(seqs, batch):
        within_bound(got, stock_logits(stock, ids), f"batch member of length {len(ids)}")
    # With routed experts: a batch of sequences gives each sequence's own bits.
    path = ckpt[0]
    m = k3.Model.from_pretrained(path, trunk="bf16", max_seqs=3)
    states = [m.new_state() for _ in seqs]
    batch = m.forward(seqs, states, all_logits=True)
    for ids, got in zip(seqs, batch):
        one = k3.Model.from_pretrained(path, trunk="bf16")
        np.testing.assert_array_equal(one.forward(ids, one.new_state(), all_logits=True), got)
    # Then one decode step for all three together equals three single decodes (the same bits).
    nxt = [[7], [11], [13]]
    together = m.forward(nxt, states)
    single = k3.Model.from_pretrained(path, trunk="bf16")
    for ids, row, t in zip(seqs, together, nxt):
        s = single.new_state()
        single.forward(ids, s)
        np.testing.assert_array_equal(single.forward(t, s), row)
        single.release_state(s)


def test_greedy_generation_equals_stock_where_the_choice_is_clear(dense_ckpts):
    path, stock = dense_ckpts["bf16"]
    m = k3.Model.from_pretrained(path, trunk="bf16")
    ids = m.generate(PROMPT, max_new_tokens=8, stop_ids=[])
    assert ids.dtype == np.int32 and ids.shape == (8,)
    # Re-run stock teacher-forced on k3's own continuation: at every step k3 took the stock choice
    # where stock's margin was clear.
    full = PROMPT + ids.tolist()
    want = stock_logits(stock, full)[len(PROMPT) - 1:-1]
    srt = np.sort(want, axis=-1)
    sure = (srt[:, -1] - srt[:, -2]) / np.abs(want).max(axis=-1) > 2 * REL_BOUND
    assert sure.sum() >= 1
    np.testing.assert_array_equal(ids[sure], want.argmax(-1)[sure])


def test_same_bits_at_any_thread_count(ckpt_mxfp8):
    path, _ = ckpt_mxfp8
    outs = []
    for threads in (1, 2, 3):
        m = k3.Model.from_pretrained(path, threads=threads)
        s = m.new_state()
        a = m.forward(PROMPT, s, all_logits=True)
        b = m.forward([5], s)
        m.release_state(s)
        outs.append((a, b, m.generate(PROMPT, 6, temperature=0.8, top_k=20, top_p=0.9, seed=7, stop_ids=[])))
    for a, b, g in outs[1:]:
        np.testing.assert_array_equal(a, outs[0][0])
        np.testing.assert_array_equal(b, outs[0][1])
        np.testing.assert_array_equal(g, outs[0][2])


def test_sampling_is_seeded(ckpt):
    path, _ = ckpt
    m = k3.Model.from_pretrained(path, trunk="bf16")
    a = m.generate(PROMPT, 12, temperature=1.5, seed=1, stop_ids=[])
    b = m.generate(PROMPT, 12, temperature=1.5, seed=1, stop_ids=[])
    c = m.generate(PROMPT, 12, temperature=1.5, seed=2, stop_ids=[])
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    # top_k = 1 is greedy whatever the temperature.
    np.testing.assert_array_equal(m.generate(PROMPT, 6, temperature=2.0, top_k=1, stop_ids=[]),
                                  m.generate(PROMPT, 6, stop_ids=[]))


def test_generation_stops_at_eos(ckpt):
    path, _ = ckpt
    m = k3.Model.from_pretrained(path, trunk="bf16")
    free = m.generate(PROMPT, 6, stop_ids=[])
    stopped = m.generate(PROMPT, 6, stop_ids=[int(free[2])])
    first = int(np.flatnonzero(free == free[2])[0])
    np.testing.assert_array_equal(stopped, free[:first + 1])


# ---- refusals ------------------------------------------------------------------------------


def edited_copy(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg.update(changes)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return str(dst)


@pytest.mark.parametrize("changes,message", [
    ({"hidden_size": 10 ** 9}, r'"hidden_size" = 1000000000 must be an integer in \[32, 65536\]'),
    ({"vocab_size": -3}, r'"vocab_size" = -3 must be an integer in \[1, '),
    ({"num_experts_per_token": 99}, r'"num_experts_per_token" = 99 must be an integer in \[1, 32\]'),
    ({"num_hidden_layers": "four"}, r'"num_hidden_layers" = "four" must be an integer'),
    ({"hidden_size": 48}, r'"hidden_size" = 48 must be a multiple of 32'),
    ({"model_type": "llama"}, r'"model_type" = "llama" is not a model the runner knows'),
    ({"model_type": "kimi_k3"}, r"Kimi-K3 checkpoint .* does not run Kimi-K3 yet"),
    ({"layer_types": ["linear_attention"]}, r'"layer_types" = .* must be a list of 4 strings'),
])
def test_absurd_configs_are_refused_by_field(ckpt, tmp_path, changes, message):
    path = edited_copy(ckpt[0], tmp_path / "c", **changes)
    with pytest.raises((ValueError, RuntimeError), match=message):
        k3.Model.from_pretrained(path)


def test_config_that_is_not_json(ckpt, tmp_path):
    shutil.copytree(ckpt[0], tmp_path / "c")
    (tmp_path / "c" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        k3.Model.from_pretrained(str(tmp_path / "c"))


def test_truncated_and_missing_shards(ckpt, tmp_path):
    shutil.copytree(ckpt[0], tmp_path / "t")
    f = tmp_path / "t" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:len(data) // 2])
    with pytest.raises((ValueError, RuntimeError), match="model.safetensors"):
        k3.Model.from_pretrained(str(tmp_path / "t"))
    shutil.copytree(ckpt[0], tmp_path / "m")
    os.remove(tmp_path / "m" / "model.safetensors")
    with pytest.raises((ValueError, RuntimeError)):
        k3.Model.from_pretrained(str(tmp_path / "m"))


def test_a_tensor_of_the_wrong_shape_or_missing_is_named(ckpt, tmp_path):
    from safetensors.torch import load_file, save_file
    tensors = load_file(os.path.join(ckpt[0], "model.safetensors"))
    name = "model.layers.1.self_attn.q_proj.weight"
    shutil.copytree(ckpt[0], tmp_path / "s")
    bad = dict(tensors)
    bad[name] = bad[name][:, :32].contiguous()
    save_file(bad, str(tmp_path / "s" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor model.layers.1.self_attn.q_proj.weight in .*: expected \[64, 64\] "
                                         r"BF16 or F32, found \[64, 32\] BF16"):
        k3.Model.from_pretrained(str(tmp_path / "s"))
    del bad[name]
    save_file(bad, str(tmp_path / "s" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor model.layers.1.self_attn.q_proj.weight .* is missing"):
        k3.Model.from_pretrained(str(tmp_path / "s"))


def test_prompt_longer_than_the_pool_and_bad_ids(ckpt):
    m = k3.Model.from_pretrained(ckpt[0], trunk="bf16", max_context=8, max_batch_tokens=4)
    with pytest.raises((ValueError, IndexError), match=r"needs 15 tokens of state; the pool holds max_context = 8"):
        m.generate(PROMPT, 4)
    s = m.new_state()
    m.forward(PROMPT[:4], s)
    m.forward(PROMPT[4:8], s)
    with pytest.raises((ValueError, IndexError), match=r"holds 8 tokens; 1 more exceed max_context = 8"):
        m.forward([1], s)
    assert s.position == 8  # the refused call changed nothing
    with pytest.raises(ValueError, match=r"5 tokens in one call; it takes 1 to max_batch_tokens = 4"):
        m.forward(PROMPT[:5], s)
    with pytest.raises(ValueError, match=r"ids\[1\] = 256 is outside the vocabulary \[0, 256\)"):
        m.forward([1, 256], s)
    with pytest.raises(ValueError, match="all max_seqs = 1 slots are in use"):
        m.new_state()
    m.release_state(s)
    with pytest.raises(ValueError, match=r"top_p = 0.000000 must be in \(0, 1\]"):
        m.generate([1], 2, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match=r"threads = 300 must be in \[0, 256\]"):
        k3.Model.from_pretrained(ckpt[0], threads=300)
    with pytest.raises(ValueError, match="trunk = 'fp4' must be one of"):
        k3.Model.from_pretrained(ckpt[0], trunk="fp4")


# ---- the command lines: k3 generate (ids) and python -m k3 generate (text) --------------------


def k3_cli(*args):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "k3", *args], capture_output=True, text=True, timeout=600)


def test_k3_generate_prints_the_runners_greedy_ids(ckpt):
    path = ckpt[0]
    want = k3.Model.from_pretrained(path, trunk="bf16").generate(PROMPT, 6, stop_ids=[])
    r = k3_cli("generate", "--checkpoint", path, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "6",
               "--trunk", "bf16", "--ignore-eos", "--quiet")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ",".join(map(str, want))
    assert "tokens/s" in r.stderr
    # A batch of B copies decodes them together: B equal lines, each the single sequence's ids.
    r = k3_cli("generate", "--checkpoint", path, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "6",
               "--trunk", "bf16", "--batch", "3", "--quiet")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [",".join(map(str, want))] * 3


@pytest.mark.parametrize("args,message", [
    (["--prompt-ids", "1,x,3"], '--prompt-ids: "x" is not a token id'),
    (["--prompt-ids", "1,999"], r"tokens\[1\] = 999 is outside the vocabulary \[0, 256\)"),
    (["--prompt-ids", "1", "--trunk", "fp4"], 'trunk format "fp4" is not one of: mxfp8, bf16'),
    (["--prompt-ids", "1", "--top-p", "2"], "top_p = 2.000000 must be in"),
    (["--prompt-ids", "1,2,3", "--max-context", "4", "--max-new-tokens", "4"], "needs 6 tokens of state"),
])
def test_k3_generate_refuses_bad_flags_by_name(ckpt, args, message):
    r = k3_cli("generate", "--checkpoint", ckpt[0], "--quiet", *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert message in r.stderr or __import__("re").search(message, r.stderr), r.stderr
    assert r.stdout == ""


def test_python_m_k3_generate_tokenizes_with_the_checkpoints_tokenizer(ckpt, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    d = tmp_path / "with_tokenizer"
    shutil.copytree(ckpt[0], d)
    vocab = {f"w{i}": i for i in range(256)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="w0").save_pretrained(str(d))
    prompt = " ".join(f"w{i}" for i in PROMPT)
    want = k3.Model.from_pretrained(str(d), trunk="bf16").generate(PROMPT, 5)
    r = k3_cli("generate", "--checkpoint", str(d), "--prompt", prompt, "--max-new-tokens", "5", "--trunk", "bf16")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [f"w{i}" for i in want]
    assert "k3: packing layer 4 of 4" in r.stderr  # the progress line while weights pack
    r = k3_cli("generate", "--checkpoint", ckpt[0], "--prompt", "w1 w2")
    assert r.returncode == 2 and "cannot load the tokenizer" in r.stderr
