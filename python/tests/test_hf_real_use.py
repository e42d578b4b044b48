"""k3.hf and k3.torch the ways serving scripts really call them (the hardening issue's "real use
that fails" and "silent wrong results" items): torch.inference_mode() as well as no_grad, BF16 and
FP16 models under assisted generation and prompt lookup with many drafts, prompts longer than
max_tokens, inputs that require grad, overlapping buffers, int64 indices past int32, weight
reloads after the patch and a patch that fails part-way. Each test runs the real transformers
(scripts/test.sh installs it) and compares with what the same model computes another way."""

import copy
import os
import warnings

import pytest

if os.environ.get("K3_REQUIRE_TORCH") == "1":
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch", reason="torch is not installed (scripts/test.sh installs it)")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import k3  # noqa: E402
import k3.hf  # noqa: E402
import k3.torch  # noqa: E402
from test_hf import RECORDS_PAST, build, tiny_config  # noqa: E402

PROMPT = torch.tensor([[1, 5, 9, 12, 5, 9, 12, 5]])


def generate(model, prompt=PROMPT, n=6, **kw):
    return model.generate(prompt, max_new_tokens=n, do_sample=False, **kw)


@pytest.mark.parametrize("dense", [True, "bf16"])
def test_inference_mode_gives_the_no_grad_bits(dense):
    """Item 1: with dense projections a forward under torch.inference_mode() raised "Inference
    tensors do not track version counter" (the fused projections keyed their shared output on
    the input's version counter). Now a plain forward, batch 2, and generate under inference mode
    give exactly the no_grad results."""
    model = build(tiny_config(), seed=4, dtype=torch.bfloat16)
    k3.hf.patch(model, dense=dense)
    assert any(isinstance(m, k3.hf._FusedSlice) for m in model.modules())
    prompt = torch.tensor([[3, 4, 5, 6, 7], [9, 8, 7, 6, 5]])
    with torch.no_grad():
        want = model(prompt).logits
        want_tokens = generate(model, prompt[:1])
    with torch.inference_mode():
        got = model(prompt).logits
        got_tokens = generate(model, prompt[:1])
        again = model(prompt).logits  # a second call with new inference tensors: nothing stale kept
    assert torch.equal(got, want) and torch.equal(again, want)
    assert torch.equal(got_tokens, want_tokens)


def test_fused_projections_see_an_inference_tensor_changed_in_place():
    """Without a version counter the shared output is keyed on a copy of the input's values: an
    input changed in place between two projections gets a fresh output, not the stale one."""
    model = build(tiny_config(), seed=4, dtype=torch.bfloat16)
    k3.hf.patch(model, dense=True, moe=False, kda=False, mla=False)
    attn = model.model.layers[0].self_attn
    q, k = attn.q_proj, attn.k_proj
    assert isinstance(q, k3.hf._FusedSlice) and q._fused is k._fused
    with torch.inference_mode():
        x = torch.randn(3, 64).to(torch.bfloat16)
        q(x)
        x.mul_(2)
        got = k(x)
        fresh = k(x.clone())
    assert torch.equal(got, fresh)


def assisted(model, prompt, **kw):
    return model.generate(prompt, max_new_tokens=12, do_sample=False, **kw)


# A 16-bit model's verify step (T tokens in one forward) and its plain decode (one token per
# forward) round differently (torch's BF16 / FP16 GEMMs and attention at M = T against M = 1):
# where greedy's top-2 margin is that small the two may pick different tokens. Measured on the
# tiny model: 3.2 % of max |logit| at the one divergence seen (BF16), none in FP16.
NEAR_TIE_16 = {torch.bfloat16: 0.06, torch.float16: 0.02}


def assert_greedy_up_to_a_near_tie(model, got, plain, rel, what):
    """got == plain, or equal up to a position where plain's choice was a near tie: there the
    teacher-forced logits' top-2 margin is below rel * max |logit|, and got's token is one of the
    two."""
    if torch.equal(got, plain):
        return
    assert got.shape == plain.shape, what
    i = int((got != plain)[0].nonzero()[0])
    with torch.no_grad():
        lg = model(plain[:, :i]).logits[0, -1].float()
    top = lg.topk(2)
    margin = float(top.values[0] - top.values[1])
    assert margin <= rel * float(lg.abs().max()), (what, i, margin, got.tolist(), plain.tolist())
    assert int(got[0, i]) in top.indices.tolist(), (what, i)


@pytest.mark.skipif(not RECORDS_PAST, reason="transformers < 5.25 refuses assisted generation on Kimi-Linear")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_assisted_generation_and_prompt_lookup_on_16_bit_models(dtype):
    """Item 2: on a BF16 or FP16 model the first verify step raised an out-dtype mismatch (k3's
    verify was handed a float32 output for 16-bit inputs). The tokens of prompt lookup and of an
    assistant model must be those of plain greedy decoding on the same patched model, under
    no_grad and inference mode, and the verify steps must have run on k3."""
    model = build(tiny_config(), dtype=dtype)
    rec = k3.hf.patch(model, recipe="w4a16", keep_original=True, dense=dtype == torch.bfloat16)
    draft = build(tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                              mlp_layer_types=["sparse", "sparse"]), seed=3, dtype=dtype)
    k3.hf.patch(draft, recipe="w4a16")
    for prompt in (PROMPT, torch.tensor([[1] + list(range(3, 40))])):
        plain = assisted(model, prompt)
        for ctx in (torch.no_grad, torch.inference_mode):
            with ctx():
                for kw in (dict(prompt_lookup_num_tokens=3), dict(assistant_model=draft)):
                    got = assisted(model, prompt, **kw)
                    assert_greedy_up_to_a_near_tie(model, got, plain, NEAR_TIE_16[dtype], (dtype, ctx.__name__, kw))
    assert all(lr.calls["verify"] > 0 and lr.calls["commit"] > 0 for _, lr in rec.kda)


@pytest.mark.skipif(not RECORDS_PAST, reason="transformers < 5.25 refuses assisted generation on Kimi-Linear")
def test_prompt_lookup_with_more_than_64_drafts_per_step():
    """Item 4: more than 64 draft tokens in one step (prompt_lookup_num_tokens=80) raised in the
    middle of generate: k3 kept only the last 64 tokens of a forward for the rollback. It now
    keeps what transformers asks the cache to record, in replay windows of 64. The prompt repeats
    a long run, so the lookup drafts 80 tokens, nearly all rejected by the random model."""
    model = build(tiny_config())
    rec = k3.hf.patch(model, recipe="w4a16", keep_original=True)
    run = [1] + list(range(3, 110))
    prompt = torch.tensor([run + run[:3]])
    plain = assisted(model, prompt)
    stock = assisted(build(tiny_config()), prompt, prompt_lookup_num_tokens=80)
    got = assisted(model, prompt, prompt_lookup_num_tokens=80)
    assert torch.equal(got, plain), (got.tolist(), plain.tolist())
    assert stock.shape[1] > prompt.shape[1]  # stock transformers runs the same call
    assert all(lr.calls["verify"] >= 2 for _, lr in rec.kda)  # 80 drafts + 1 took two windows


def test_a_verify_forward_longer_than_one_window_rolls_back_any_of_its_tokens():
    """The layer contract behind item 4: a forward of 81 tokens under a cache recording 80 keeps
    them in two replay windows; cropping any number of them leaves the state of the accepted
    prefix, as a plain prefill of that prefix does (same bits as k3's token-by-token decode up to
    the chunked kernel's FP32 order: compared within 1e-5)."""
    if not RECORDS_PAST:
        pytest.skip("transformers < 5.25 has no rollback for linear attention")
    from test_hf import cache_kw
    model = build(tiny_config())
    k3.hf.patch(model, recipe="w4a16", keep_original=True)
    prefix = torch.tensor([[1, 5, 9]])
    drafts = torch.randint(3, 250, (1, 81), generator=torch.Generator().manual_seed(7))
    for rejected in (0, 1, 17, 64, 65, 80):
        with torch.no_grad():
            cache = transformers.DynamicCache(config=model.config)
            model.model(input_ids=prefix, use_cache=True, **cache_kw(cache))
            cache.activate_past_recording(recurrent_states_to_keep=80)
            model.model(input_ids=drafts, use_cache=True, **cache_kw(cache))
            cache.crop(-rejected)
            got = cache.get_recurrent_state(0).clone()
            ref = transformers.DynamicCache(config=model.config)
            model.model(input_ids=torch.cat([prefix, drafts[:, :81 - rejected]], 1), use_cache=True,
                        **cache_kw(ref))
            want = ref.get_recurrent_state(0)
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 1e-5, (rejected, err)


def test_dense_prompts_longer_than_max_tokens_are_split():
    """Item 3: with dense=True an input longer than max_tokens raised (the docs say it is split):
    at the default every prompt over 4096 tokens failed. Every output row is its own dot
    products, so the split gives the bits of one call."""
    model = build(tiny_config(), seed=4, dtype=torch.bfloat16)
    small = copy.deepcopy(model)
    k3.hf.patch(model, dense=True)
    k3.hf.patch(small, dense=True, max_tokens=4)
    prompt = torch.randint(3, 250, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(small(prompt).logits, model(prompt).logits)
    lin = torch.nn.Linear(64, 96).to(torch.bfloat16)
    a = k3.torch.Linear.from_linear(lin, max_tokens=3)
    b = k3.torch.Linear.from_linear(lin, max_tokens=4096)
    x = torch.randn(2, 5, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
        out = torch.empty(10, 96, dtype=torch.bfloat16)
        torch.ops.k3.linear(a.handle, x.view(10, 64), out)
        assert torch.equal(out, b(x).view(10, 96))


def test_linear_refuses_inputs_that_require_grad_instead_of_detaching():
    """Item 5: k3.torch.Linear silently detached inputs that require grad (outputs without grad,
    no error). It now refuses them by name; a patched model that kept its stock projections
    (keep_original=True) runs those, with a warning, so grad flows as in stock."""
    lin = torch.nn.Linear(64, 32).to(torch.bfloat16)
    k = k3.torch.Linear.from_linear(lin)
    x = torch.randn(2, 64).to(torch.bfloat16).requires_grad_()
    with pytest.raises(RuntimeError, match="x requires grad, but k3 has no backward"):
        k(x)
    with torch.no_grad():
        assert k(x).shape == (2, 32)
    model = build(tiny_config(), seed=4, dtype=torch.bfloat16)
    k3.hf.patch(model, dense=True, moe=False, kda=False, mla=False, keep_original=True)
    emb = model.model.embed_tokens(torch.tensor([[3, 4, 5]])).detach().requires_grad_()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        y = model.model.layers[0].self_attn.q_proj(emb)
        z = model.lm_head(emb)
    assert y.requires_grad and z.requires_grad
    assert any("requires grad" in str(w.message) for w in seen)
    z.float().sum().backward()
    assert emb.grad is not None
    dropped = build(tiny_config(), seed=4, dtype=torch.bfloat16)
    k3.hf.patch(dropped, dense=True, moe=False, kda=False, mla=False)
    with pytest.raises(RuntimeError, match="requires grad"):
        dropped.lm_head(emb)


def test_linear_refuses_an_output_overlapping_its_input():
    """Item 6: k3.torch.Linear / torch.ops.k3.linear did not check that out and x are disjoint
    (k3.linear.run does): overlapping buffers gave wrong rows beyond the first tile."""
    lin = torch.nn.Linear(64, 64).to(torch.bfloat16)
    k = k3.torch.Linear.from_linear(lin)
    buf = torch.randn(8, 64).to(torch.bfloat16)
    with torch.no_grad():
        with pytest.raises(ValueError, match="out overlaps x"):
            k(buf, out=buf)
        with pytest.raises(ValueError, match="out overlaps x"):
            torch.ops.k3.linear(k.handle, buf[:4], buf.view(-1)[64:64 * 5].view(4, 64))
        out = torch.empty(8, 64, dtype=torch.bfloat16)
        k(buf, out=out)  # disjoint: fine
        assert torch.equal(out, k(buf))


def pool_args(slots=4, h=2, d=32, n=2):
    g = torch.Generator().manual_seed(0)
    q, kk, v = (torch.randn(n, 1, h, d, generator=g) for _ in range(3))
    gate = -torch.rand(n, 1, h, d, generator=g)
    beta = torch.rand(n, 1, h, generator=g)
    pool = torch.zeros(slots, h, d, d)
    return q, kk, v, gate, beta, pool


def test_fla_decode_checks_int64_indices_and_counts_before_narrowing():
    """Item 7: the fla-compatible decode converted int64 slot indices and accepted counts to
    int32 before checking them: a huge index wrapped to another sequence's slot and overwrote its
    state, and a float count was truncated. Now both are refused by name, and no state changes."""
    q, kk, v, g, beta, pool = pool_args()
    before = pool.clone()
    with torch.no_grad():
        for bad in ([2 ** 32, 1], [1, -(2 ** 32) + 1]):
            with pytest.raises(ValueError, match="ssm_state_indices holds .* outside the int32 range"):
                k3.torch.fused_recurrent_kda(q, kk, v, g, beta, initial_state=pool,
                                             ssm_state_indices=torch.tensor(bad, dtype=torch.int64))
        assert torch.equal(pool, before)
        with pytest.raises(ValueError, match="ssm_state_indices must be"):
            k3.torch.fused_recurrent_kda(q, kk, v, g, beta, initial_state=pool,
                                         ssm_state_indices=torch.tensor([0.0, 1.0]))
        q2, k2, v2, g2, b2 = (t.expand(2, 3, *t.shape[2:]).contiguous() for t in (q, kk, v, g, beta))
        idx = torch.tensor([[0, 1, 2], [3, 0, 1]], dtype=torch.int64)
        with pytest.raises(ValueError, match="num_accepted_tokens must be an int32 or int64 tensor"):
            k3.torch.fused_recurrent_kda(q2, k2, v2, g2, b2, initial_state=pool, ssm_state_indices=idx,
                                         num_accepted_tokens=torch.tensor([1.7, 2.2]))
        with pytest.raises(ValueError, match="num_accepted_tokens holds 4294967297"):
            k3.torch.fused_recurrent_kda(q2, k2, v2, g2, b2, initial_state=pool, ssm_state_indices=idx,
                                         num_accepted_tokens=torch.tensor([2 ** 32 + 1, 1]))
        assert torch.equal(pool, before)
        o, _ = k3.torch.fused_recurrent_kda(q, kk, v, g, beta, initial_state=pool,
                                            ssm_state_indices=torch.tensor([3, 0], dtype=torch.int64))
        assert o.shape == v.shape and not torch.equal(pool, before)


def test_load_state_dict_on_a_patched_model_is_refused():
    """Item 8: load_state_dict on a patched model reported every key matched while the MoE kept
    its old experts and router (the logits were the old weights'). It is now refused, before any
    weight changes, and works again after unpatch."""
    model = build(tiny_config())
    new = build(tiny_config(), seed=9)
    k3.hf.patch(model, keep_original=True)
    with torch.no_grad():
        before = model(PROMPT).logits
    for target, sd in ((model, new.state_dict()), (model.model.layers[0].mlp, new.model.layers[0].mlp.state_dict())):
        with pytest.raises(RuntimeError, match="k3.hf: load_state_dict on a patched model"):
            target.load_state_dict(sd)
        with pytest.raises(RuntimeError, match="k3.hf: load_state_dict on a patched model"):
            target.load_state_dict(sd, strict=False)
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, before)
    k3.hf.unpatch(model)
    model.load_state_dict(new.state_dict())
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, new(PROMPT).logits)


def test_a_patch_failing_at_any_stage_restores_the_model(monkeypatch):
    """Item 9: a patch that failed part-way (found with a torch.ao dynamic-quantized model) left
    KDA on k3 with is_patched False, and unpatch refused. Every stage now restores on failure:
    the model computes what it computed before and can be patched again."""
    stages = ["_patch_moe", "_norm_forward", "_gated_norm_forward", "_mla_forward", "_MlaLayer", "_wrap_kda_forward",
              "_patch_dense", "_install"]
    for stage in stages:
        model = build(tiny_config(), seed=4, dtype=torch.bfloat16)
        with torch.no_grad():
            want = model(PROMPT).logits
        real = getattr(k3.hf, stage)
        installs = k3.hf._patched_count  # models patched in this process hold k3's KDA functions

        def boom(*a, _real=real, **kw):
            raise RuntimeError("injected failure")
        monkeypatch.setattr(k3.hf, stage, boom)
        with pytest.raises(RuntimeError, match="injected failure"):
            k3.hf.patch(model, dense=True, keep_original=True)
        monkeypatch.undo()
        assert not k3.hf.is_patched(model), stage
        assert not any(isinstance(m, (k3.torch.Linear, k3.hf._FusedSlice)) for m in model.modules()), stage
        assert not any("forward" in vars(m) for m in model.modules()), stage
        assert k3.hf._patched_count == installs, stage
        with torch.no_grad():
            assert torch.equal(model(PROMPT).logits, want), stage
        k3.hf.patch(model, dense=True, keep_original=True)
        k3.hf.unpatch(model)
    # The case that found it: a torch.ao dynamic-quantized model (its Linear layers are not
    # nn.Linear, kv_b_proj has no weight tensor), which stock transformers runs. Its MLA layers
    # keep the stock forward; the KDA layers run on k3 and compute the stock model within the
    # FP32 summation order.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = torch.ao.quantization.quantize_dynamic(build(tiny_config()), {torch.nn.Linear}, dtype=torch.qint8)
    with torch.no_grad():
        want = qmodel(PROMPT).logits
    rec = k3.hf.patch(qmodel, moe=False, keep_original=True)
    assert rec.kda and not rec.mla and k3.hf.is_patched(qmodel)
    with torch.no_grad():
        got = qmodel(PROMPT).logits
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    assert generate(qmodel).shape == (1, PROMPT.shape[1] + 6)
    k3.hf.unpatch(qmodel)
    with torch.no_grad():
        assert torch.equal(qmodel(PROMPT).logits, want)
