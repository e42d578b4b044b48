"""``python -m k3 hf generate|bench``: a transformers Kimi-Linear model on k3 against stock.

generate: builds a random model of a given config (saved and reloaded with ``from_pretrained``,
as a user would load a checkpoint) or loads a local checkpoint directory (``--checkpoint``),
generates with stock transformers, with stock on the MXFP4-round-tripped expert weights (what
k3 serves) and with the model patched by ``k3.hf.patch``, and prints tokens/s and how long the
greedy paths agree.

bench: stock BF16, stock FP32 (both loaded with ``from_pretrained``, run with ``generate`` and its
cache, as transformers' docs say) and k3 (the BF16 model patched), same threads, interleaved
rounds. Prefill tokens/s at T = 128 and 1024, decode ms/token at batch 1 and 8 (and batch 1
after a 2048-token prefix), for each decode figure the bytes one step reads and that time as a
fraction of the read bandwidth measured in the same run (``k3 bench limits``), prefill FLOPs as a
fraction of the FP32 FMA peak. Writes JSON and, with matplotlib, a plot.
"""

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time

__all__ = ["main", "bench_config", "step_bytes", "prefill_flops"]

# Kimi-Linear-48B-A3B's layer widths (hidden 2304, 32 KDA heads of 128, MLA with kv_lora 512,
# moe_intermediate 1024, one shared expert, top-8), with fewer experts, layers and a smaller
# vocabulary by default so that the stock FP32 copy fits next to the others in 24 GB.
PRESET = dict(hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024, num_attention_heads=32,
              num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
              v_head_dim=128, num_experts_per_token=8, n_shared_experts=1, routed_scaling_factor=2.446,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)


def bench_config(layers=4, experts=64, vocab=32000, top_k=8):
    """A KimiLinearConfig with Kimi-Linear-48B-A3B's widths: KDA and MLA layers 3:1 (the last of
    every four is MLA, at least one), every layer MoE."""
    from transformers import KimiLinearConfig
    types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    kw = dict(PRESET, vocab_size=vocab, num_hidden_layers=layers, num_experts=experts,
              num_experts_per_token=top_k, layer_types=types, mlp_layer_types=["sparse"] * layers,
              linear_attn_config={"head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4})
    return KimiLinearConfig(**kw)


def _random_checkpoint(cfg, path, seed=0):
    """Builds a random BF16 model of cfg and saves it with save_pretrained (safetensors)."""
    import torch
    from transformers import KimiLinearForCausalLM
    torch.manual_seed(seed)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in BF16 directly: no FP32 copy of the whole model
    try:
        with torch.no_grad():
            model = KimiLinearForCausalLM(cfg)
    finally:
        torch.set_default_dtype(saved)
    with torch.no_grad():
        model = model.to(torch.bfloat16)
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.normal_(0, 0.05)
    model.save_pretrained(path)
    del model
    return path


def _load(path, dtype):
    """from_pretrained, with any failure (a truncated or missing shard, a config transformers
    refuses) as one line naming the directory, not a traceback."""
    import torch
    from transformers import KimiLinearForCausalLM
    try:
        return KimiLinearForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    except Exception as e:  # noqa: BLE001 (whatever transformers or safetensors raise, said in one line)
        raise SystemExit(f"python -m k3 hf: cannot load the checkpoint {path}: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from None


# ---- traffic and FLOP models ----------------------------------------------------------------


def _linear_bytes(mod):
    import k3.torch as k3t
    import k3.hf
    if isinstance(mod, k3.hf._FusedSlice):  # its share of a fused k3 layer
        return mod.weight_bytes
    if isinstance(mod, k3t.Linear):  # dense: the prepacked MXFP8 or BF16 weight (+ FP32 bias)
        return k3t._linear_layer(mod.handle).packed_bytes
    return sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))


def step_bytes(model, batch, prefix, distinct_experts):
    """Bytes one decode step of `batch` sequences at prefix length `prefix` reads: every weight
    the step touches (dense layers, LM head, one embedding row per sequence, the routed experts it
    selects: `distinct_experts` per MoE block, in the form the model holds them) and the state
    (KDA recurrent and conv states, the MLA latent cache). Returns a dict by part."""
    from transformers.models.kimi_linear import modeling_kimi_linear as m
    import torch
    cfg = model.config
    parts = {"dense_weights": 0, "experts": 0, "lm_head": 0, "embedding": 0, "kda_state": 0, "mla_cache": 0}
    rec = getattr(model, "_k3_patch", None)
    k3_bytes_per_expert = None
    if rec is not None and rec.moe:
        k3_bytes_per_expert = rec.expert_bytes_k3 / (len(rec.moe) * cfg.num_local_experts)
    import k3.torch as k3t
    import k3.hf
    esize = model.get_input_embeddings().weight.element_size()
    for mod in model.modules():
        if isinstance(mod, (torch.nn.Linear, k3t.Linear, k3.hf._FusedSlice)) and mod is not model.lm_head:
            parts["dense_weights"] += _linear_bytes(mod)
        elif isinstance(mod, (m.KimiLinearRMSNorm, m.KimiLinearRMSNormGated, torch.nn.Conv1d)):
            parts["dense_weights"] += _linear_bytes(mod)
        elif isinstance(mod, m.KimiLinearTopkRouter):
            parts["dense_weights"] += mod.weight.numel() * 4 + mod.e_score_correction_bias.numel() * 4
        elif isinstance(mod, m.KimiLinearForgetGate):
            parts["dense_weights"] += mod.dt_bias.numel() * 4 + mod.A_log.numel() * 4
        elif isinstance(mod, m.KimiLinearExperts):
            if k3_bytes_per_expert is not None:
                per = k3_bytes_per_expert
            else:
                per = (mod.gate_up_proj[0].numel() + mod.down_proj[0].numel()) * mod.gate_up_proj.element_size()
            parts["experts"] += per * distinct_experts
        elif isinstance(mod, m.KimiLinearDeltaAttention):
            parts["kda_state"] += batch * (mod.num_heads * mod.head_dim * mod.head_dim * 4
                                           + mod.conv_dim * mod.conv_kernel_size * 4)
        elif isinstance(mod, m.KimiLinearAttention):
            parts["mla_cache"] += batch * prefix * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * esize
    parts["lm_head"] = _linear_bytes(model.lm_head)
    parts["embedding"] = batch * cfg.hidden_size * esize
    parts["total"] = sum(parts.values())
    return parts


def prefill_flops(cfg, t):
    """Model FLOPs of a T-token prefill (multiply-adds x 2): every linear layer a token passes
    (dense, router, shared and top-k routed experts, LM head on the last token only, as generate
    computes it), MLA's causal attention, and the KDA recurrence (about 8 K V per token and head:
    decay, S^T k, the rank-1 write, S^T q)."""
    h, i, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    hk, nh = cfg.linear_head_dim, cfg.linear_num_heads
    qkv = hk * nh
    kda_lin = 3 * h * qkv + h * hk + hk * qkv + h * nh + h * hk + hk * qkv + qkv * h  # q,k,v, f_a,f_b, b, g_a,g_b, o
    mla_lin = (h * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
               + h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
               + cfg.kv_lora_rank * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
               + cfg.num_attention_heads * cfg.v_head_dim * h)
    moe_lin = h * cfg.num_local_experts + (k + cfg.n_shared_experts) * 3 * h * i
    flops = 0
    for typ in cfg.layer_types:
        if typ == "full_attention":
            flops += 2 * t * mla_lin
            flops += 2 * (t * (t + 1) // 2) * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                                                         + cfg.v_head_dim)
        else:
            flops += 2 * t * kda_lin + 8 * t * nh * hk * hk
        flops += 2 * t * moe_lin
    return flops + 2 * h * cfg.vocab_size


# ---- timing --------------------------------------------------------------------------------


class _Stamps:
    """A logits processor that records when generate reaches each step's sampling."""

    def __init__(self):
        self.t = []

    def __call__(self, input_ids, scores):
        self.t.append(time.perf_counter())
        return scores


def _generate_times(model, ids, new_tokens, mask=None):
    """(prefill seconds, per-step decode seconds) of model.generate (greedy, its cache), exactly
    new_tokens tokens: the end-of-sequence token is turned off for the call (``eos_token_id=None``;
    the model's generation config is left as it is). ``min_new_tokens`` would make them too, but
    its logits processor scans the whole vocabulary for the EOS ids at every step (0.5-1 ms a step
    at a 32000 vocabulary, on every path), which plain ``generate`` does not spend."""
    import torch
    from transformers import LogitsProcessorList
    st = _Stamps()
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=None, do_sample=False,
                       logits_processor=LogitsProcessorList([st]))
    if len(st.t) != new_tokens:
        raise RuntimeError(f"k3 hf: generate made {len(st.t)} tokens, expected {new_tokens}")
    return st.t[0] - t0, [b - a for a, b in zip(st.t, st.t[1:])]


def _distinct_experts(model, ids):
    """Mean number of distinct routed experts per MoE block in one decode step of `ids` (the
    batch's last tokens), from the routers' choices."""
    import torch
    from transformers.models.kimi_linear import modeling_kimi_linear as m
    counts = []

    def hook(mod, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        logits = torch.nn.functional.linear(x.float(), mod.gate.weight.float())
        s = logits.sigmoid() + mod.gate.e_score_correction_bias
        counts.append(len(set(s.topk(mod.gate.top_k, dim=-1).indices.flatten().tolist())))

    hooks = [mod.register_forward_pre_hook(hook) for mod in model.modules() if isinstance(mod, m.KimiLinearMoE)]
    try:
        with torch.no_grad():
            model(ids[:, -1:])
    finally:
        for h in hooks:
            h.remove()
    return statistics.mean(counts)


def _machine():
    import torch
    import k3
    info = k3.info()
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return dict(cpu=cpu, isa=info.get("isa"), logical_cpus=os.cpu_count(), torch_threads=torch.get_num_threads(),
                torch=torch.__version__, python=platform.python_version())


def _limits(threads):
    import k3
    r = k3.bench("limits", threads=threads)
    return dict(read_bandwidth_Bps=r["read_bandwidth_Bps"]["value"], fp32_fma_peak_flops=r["fp32_fma_peak_flops"]["value"],
                dot_peak_flops=r.get("dot_peak_flops", {}).get("value"), what=r["read_bandwidth_Bps"]["what"])


def _probe(threads):
    """The read bandwidth right now (bytes/s): the harness's probe, 512 MiB, best of its trials."""
    from . import _k3
    return _k3.read_bandwidth(threads, 512)["value"]


def _common_args(ap):
    ap.add_argument("--checkpoint", help="a local Kimi-Linear checkpoint directory (config.json + safetensors); "
                    "default: a random model of the preset config")
    ap.add_argument("--layers", type=_count(1, 512), default=4, help="random model: decoder layers (KDA:MLA 3:1), default 4")
    ap.add_argument("--experts", type=_count(1, 4096), default=64, help="random model: routed experts, default 64")
    ap.add_argument("--top-k", type=_count(1, 32), default=8, help="random model: experts per token, default 8")
    ap.add_argument("--vocab", type=_count(3, 1 << 22), default=32000, help="random model: vocabulary, default 32000")
    ap.add_argument("--threads", type=_count(0, 256), default=0, help="torch and k3 threads (default: torch's default)")
    ap.add_argument("--recipe", choices=["w4a16", "w4a8"], default="w4a16")
    ap.add_argument("--isa", default="", help="k3's SIMD level (default: the best the CPU has; torch is not affected)")
    ap.add_argument("--dense", nargs="?", const="mxfp8", default=False, choices=["mxfp8", "bf16"],
                    help="also serve the dense projections and the LM head on k3: MXFP8 weights (--dense or "
                    "--dense mxfp8) or the model's BF16 weights (--dense bf16); bfloat16 models")
    ap.add_argument("--workdir", default=None, help="where the random model is saved (default: a temp dir)")


def _check_servable(model):
    import k3.hf
    try:
        k3.hf._check_config(model.config, True, True)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"python -m k3 hf: k3 cannot serve this model: {e}") from None


def _check_config(path):
    """config.json must be a JSON object of a Kimi-Linear model (model_type 'kimi_linear'), read
    before any model is built or run."""
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        raise SystemExit(f"python -m k3 hf: --checkpoint {path} has no config.json")
    try:
        with open(cfg) as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SystemExit(f"python -m k3 hf: --checkpoint {cfg} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise SystemExit(f"python -m k3 hf: --checkpoint {cfg} holds a JSON {type(doc).__name__}, expected an object")
    if doc.get("model_type") != "kimi_linear":
        raise SystemExit(f"python -m k3 hf: --checkpoint {cfg} has model_type {doc.get('model_type')!r}, expected "
                         "'kimi_linear'")


def _model_dir(a, tmp):
    if a.checkpoint:
        _check_config(a.checkpoint)
        return a.checkpoint
    path = a.workdir or os.path.join(tmp, "kimi-linear-random")
    if not os.path.isfile(os.path.join(path, "config.json")):
        cfg = bench_config(a.layers, a.experts, a.vocab, a.top_k)
        print(f"building a random Kimi-Linear model ({a.layers} layers, {a.experts} experts, top-{a.top_k}, "
              f"vocab {a.vocab}) in {path} ...", flush=True)
        _random_checkpoint(cfg, path)
    return path


def _cmd_generate(a):
    import torch
    import k3.hf
    if a.threads:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = _model_dir(a, tmp)
        model = _load(path, a.dtype)
        _check_servable(model)  # before the stock runs: what k3.hf.patch would refuse, refused now
        tok = None
        if a.prompt is not None:
            from transformers import AutoTokenizer
            try:
                tok = AutoTokenizer.from_pretrained(path, trust_remote_code=a.trust_remote_code)
            except (OSError, ValueError) as e:
                raise SystemExit(f"python -m k3 hf generate: --prompt needs a tokenizer in {path} ({e})")
            ids = tok(a.prompt, return_tensors="pt").input_ids
        else:
            ids = torch.randint(3, model.config.vocab_size, (1, a.prompt_tokens),
                                generator=torch.Generator().manual_seed(1))
        results = {}
        for name in ("stock", "stock-mxfp4", "k3"):
            if name == "stock-mxfp4":  # stock transformers on the weights k3 will serve
                k3.hf.mxfp4_roundtrip_(model)
                if a.dense == "mxfp8":  # ... and the MXFP8 dense projections (BF16: the weights as they are)
                    k3.hf.mxfp8_roundtrip_dense_(model)
            if name == "k3":
                print(k3.hf.patch(model, recipe=a.recipe, isa=a.isa, dense=a.dense).summary())
            prefill, steps = _generate_times(model, ids, a.new_tokens)
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=a.new_tokens, eos_token_id=None, do_sample=False)
            results[name] = out[0, ids.shape[1]:].tolist()
            if name == "stock-mxfp4":
                seq = out  # teacher forcing: both score the same sequence
            if name in ("stock-mxfp4", "k3"):
                with torch.no_grad():
                    results[name + "-logits"] = model(seq).logits[0].float()
            dec = statistics.median(steps)
            print(f"{name:>11} ({a.dtype}): prefill {ids.shape[1]} tokens {prefill * 1e3:.0f} ms "
                  f"({ids.shape[1] / prefill:.0f} tokens/s); decode {dec * 1e3:.1f} ms/token ({1 / dec:.1f} tokens/s)")
        def agree(x, y):
            n = 0
            while n < len(x) and x[n] == y[n]:
                n += 1
            return n
        ref, got = results["stock-mxfp4-logits"], results["k3-logits"]
        per_pos = (got - ref).abs().amax(-1) / ref.abs().amax(-1)
        same_top = (got.argmax(-1) == ref.argmax(-1)).sum().item()
        close = (per_pos <= 2e-2).sum().item()
        held = (f"MXFP4 experts and {a.dense.upper()} dense weights" if a.dense else "MXFP4 expert weights")
        print(f"teacher-forced on stock-mxfp4's {ref.shape[0]} positions (stock on k3's {held}): logit error "
              f"(relative to each position's "
              f"max) median {per_pos.median().item():.1e}, {close} positions within 2e-2 (the others follow a router "
              f"near-tie that BF16 rounding tips either way), the same top token at {same_top}")
        print(f"greedy tokens: k3 agrees with stock on the same MXFP4 expert weights for the first "
              f"{agree(results['stock-mxfp4'], results['k3'])} of {a.new_tokens}, with stock on the unquantized "
              f"weights for the first {agree(results['stock'], results['k3'])} (random weights: near-tied logits and "
              "router choices make greedy paths part early; a trained checkpoint has clear margins)")
        if tok is not None:
            for name in ("stock", "stock-mxfp4", "k3"):
                print(f"{name}: {tok.decode(results[name], skip_special_tokens=True)!r}")
        else:
            print("k3 tokens:", results["k3"])
    return 0


def _cmd_bench(a):
    import torch
    import k3.hf
    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    record = dict(machine=_machine(), threads=threads, recipe=a.recipe, rounds=a.rounds, k3_isa=a.isa or "best",
                  k3_dtype=a.k3_dtype, env={k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                                       "OMP_WAIT_POLICY") if k in os.environ})
    print(f"machine: {record['machine']['cpu']}, isa {record['machine']['isa']}, {threads} threads", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = _model_dir(a, tmp)
        # One stock model in memory at a time (the FP32 copy of a 12 GB BF16 model would not fit next
        # to the others): each round loads each stock form with from_pretrained, measures it and frees
        # it. The patched model is small and stays loaded.
        k3m = _load(path, a.k3_dtype)
        patch = k3.hf.patch(k3m, recipe=a.recipe, isa=a.isa, dense=a.dense)
        print(patch.summary(), flush=True)
        cfg = k3m.config
        record["config"] = {k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "num_local_experts",
                                                         "num_experts_per_tok", "moe_intermediate_size",
                                                         "vocab_size", "linear_num_heads", "linear_head_dim",
                                                         "layer_types")}
        record["expert_bytes"] = dict(stock_bf16=patch.expert_bytes_stock, k3=patch.expert_bytes_k3)
        record["dense_on_k3"] = bool(a.dense)
        record["dense_weights"] = a.dense or None
        if a.dense:
            record["dense_bytes"] = dict(stock_bf16=patch.dense_bytes_stock, k3=patch.dense_bytes_k3)
        gen = torch.Generator().manual_seed(7)
        prompts = {t: torch.randint(3, cfg.vocab_size, (1, t), generator=gen) for t in a.prefill}
        dec_prompts = {b: torch.randint(3, cfg.vocab_size, (b, 16), generator=gen) for b in a.batch}
        long_prompt = torch.randint(3, cfg.vocab_size, (1, a.long_prefix), generator=gen) if a.long_prefix else None
        names = [n for n in ("stock-fp32", "stock-bf16", "k3") if n not in a.skip]
        raw = {n: {"prefill": {t: [] for t in a.prefill}, "decode": {b: [] for b in a.batch}, "decode_long": [],
                   "paired": {b: [] for b in a.batch}} for n in names}
        distinct = {b: _distinct_experts(k3m, ids) for b, ids in dec_prompts.items()}
        bytes_of = {}
        record["limits"] = []
        for r in range(a.rounds):
            record["limits"].append(_limits(threads))
            lim = record["limits"][-1]
            print(f"round {r + 1}/{a.rounds}: read bandwidth {lim['read_bandwidth_Bps'] / 1e9:.1f} GB/s, FP32 FMA "
                  f"peak {lim['fp32_fma_peak_flops'] / 1e9:.0f} GFLOP/s", flush=True)
            for n in names:
                model = k3m if n == "k3" else _load(path, "float32" if n == "stock-fp32" else "bfloat16")
                for t, ids in prompts.items():
                    pre, _ = _generate_times(model, ids, 1)
                    raw[n]["prefill"][t].append(pre)
                    print(f"  {n:>10} prefill T={t}: {t / pre:.1f} tokens/s", flush=True)
                for b, ids in dec_prompts.items():
                    # The read bandwidth right before and after: on a shared host it moves between
                    # minutes, so each decode measurement is also rated against its own probes.
                    before = _probe(threads)
                    _, steps = _generate_times(model, ids, a.new_tokens)
                    after = _probe(threads)
                    raw[n]["decode"][b].extend(steps)
                    raw[n]["paired"][b].append(dict(step_s=statistics.median(steps), probe_before_Bps=before,
                                                    probe_after_Bps=after))
                    print(f"  {n:>10} decode batch {b}: {statistics.median(steps) * 1e3:.1f} ms/token", flush=True)
                    bytes_of[(n, b, 16)] = step_bytes(model, b, 16 + a.new_tokens // 2, distinct[b])
                if long_prompt is not None and r == 0:
                    _, steps = _generate_times(model, long_prompt, a.new_tokens)
                    raw[n]["decode_long"].extend(steps)
                    print(f"  {n:>10} decode batch 1 after {a.long_prefix} tokens: "
                          f"{statistics.median(steps) * 1e3:.1f} ms/token", flush=True)
                    bytes_of[(n, 1, a.long_prefix)] = step_bytes(model, 1, a.long_prefix + a.new_tokens // 2,
                                                                 distinct.get(1, cfg.num_experts_per_tok))
                if model is not k3m:
                    del model
                    gc.collect()
        bw = statistics.median(x["read_bandwidth_Bps"] for x in record["limits"])
        peak = statistics.median(x["fp32_fma_peak_flops"] for x in record["limits"])
        record["read_bandwidth_Bps"], record["fp32_fma_peak_flops"] = bw, peak
        rows = []
        for n in names:
            for t in a.prefill:
                sec = statistics.median(raw[n]["prefill"][t])
                fl = prefill_flops(cfg, t)
                rows.append(dict(variant=n, kind="prefill", tokens=t, median_s=sec, tokens_per_s=t / sec, flops=fl,
                                 fraction_of_fp32_fma_peak=fl / sec / peak, samples=raw[n]["prefill"][t]))
            for b in a.batch:
                sec = statistics.median(raw[n]["decode"][b])
                by = bytes_of[(n, b, 16)]
                # Paired: each round's median step against the higher of the probes taken right
                # before and after it (the limit is an upper bound: the higher probe is the stricter).
                paired = [dict(p, ratio_to_bandwidth_time=p["step_s"] * max(p["probe_before_Bps"], p["probe_after_Bps"])
                               / by["total"]) for p in raw[n]["paired"][b]]
                rows.append(dict(variant=n, kind="decode", batch=b, prefix=16, median_s=sec, ms_per_token=sec * 1e3,
                                 bytes=by, bandwidth_time_s=by["total"] / bw,
                                 fraction_of_read_bandwidth=by["total"] / bw / sec, distinct_experts=distinct[b],
                                 paired=paired,
                                 paired_ratio_median=statistics.median(x["ratio_to_bandwidth_time"] for x in paired),
                                 samples=raw[n]["decode"][b]))
            if raw[n]["decode_long"]:
                sec = statistics.median(raw[n]["decode_long"])
                by = bytes_of[(n, 1, a.long_prefix)]
                rows.append(dict(variant=n, kind="decode", batch=1, prefix=a.long_prefix, median_s=sec,
                                 ms_per_token=sec * 1e3, bytes=by, bandwidth_time_s=by["total"] / bw,
                                 fraction_of_read_bandwidth=by["total"] / bw / sec, samples=raw[n]["decode_long"]))
        record["rows"] = rows
        _speedups(record)
    _print_table(record)
    if a.output:
        _write_json_atomic(a.output, record)
        print(f"JSON: {a.output}")
        if a.plot:
            try:
                print(f"plot: {plot(record, a.plot)}")
            except RuntimeError as e:
                print(f"plot: skipped ({e})")
    return 0


def _key(r):
    return (r["kind"], r.get("tokens"), r.get("batch"), r.get("prefix"))


def _speedups(record):
    """k3 against the faster of stock BF16 and stock FP32, and against stock FP32."""
    by = {}
    for r in record["rows"]:
        by.setdefault(_key(r), {})[r["variant"]] = r
    for variants in by.values():
        k = variants.get("k3")
        if k is None:
            continue
        stock = [v for n, v in variants.items() if n != "k3"]
        if stock:
            best = min(stock, key=lambda v: v["median_s"])
            k["speedup_vs_best_stock"] = best["median_s"] / k["median_s"]
            k["best_stock"] = best["variant"]
        if "stock-fp32" in variants:
            k["speedup_vs_stock_fp32"] = variants["stock-fp32"]["median_s"] / k["median_s"]


def _print_table(record):
    print()
    print(f"{'variant':>10} {'what':<28} {'time':>12} {'rate':>16} {'bytes/step':>11} {'of BW / peak':>12} "
          f"{'k3 speed-up':>12}")
    for r in record["rows"]:
        if r["kind"] == "prefill":
            what = f"prefill T={r['tokens']}"
            t = f"{r['median_s'] * 1e3:.0f} ms"
            rate = f"{r['tokens_per_s']:.1f} tok/s"
            by = ""
            frac = f"{100 * r['fraction_of_fp32_fma_peak']:.0f} % FMA"
        else:
            what = f"decode batch {r['batch']} prefix {r['prefix']}"
            t = f"{r['ms_per_token']:.1f} ms"
            rate = f"{r['batch'] / r['median_s']:.1f} tok/s"
            by = f"{r['bytes']['total'] / 1e6:.0f} MB"
            frac = f"{100 * r['fraction_of_read_bandwidth']:.0f} % BW"
        sp = ""
        if "speedup_vs_best_stock" in r:
            sp = f"{r['speedup_vs_best_stock']:.2f}x"
        print(f"{r['variant']:>10} {what:<28} {t:>12} {rate:>16} {by:>11} {frac:>12} {sp:>12}")
    print(f"read bandwidth {record['read_bandwidth_Bps'] / 1e9:.1f} GB/s, FP32 FMA peak "
          f"{record['fp32_fma_peak_flops'] / 1e9:.0f} GFLOP/s (k3 bench limits, medians over the rounds); "
          f"speed-up: against the faster stock form")
    paired = [r for r in record["rows"] if r.get("paired")]
    if paired:
        print("decode step / bandwidth time, each round against the higher of the probes right before and after it:")
    for r in paired:
        rounds = ", ".join(f"{x['ratio_to_bandwidth_time']:.2f}x ({x['step_s'] * 1e3:.1f} ms at "
                           f"{max(x['probe_before_Bps'], x['probe_after_Bps']) / 1e9:.1f} GB/s)" for x in r["paired"])
        print(f"{r['variant']:>10} decode batch {r['batch']}: median {r['paired_ratio_median']:.2f}x; rounds {rounds}")


def plot(record, output):
    """Prefill tokens/s and decode ms/token per variant, and decode as % of the read bandwidth."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("plotting needs matplotlib (pip install matplotlib)") from e
    if isinstance(record, str):
        with open(record) as f:
            record = json.load(f)
    variants = []
    for r in record["rows"]:
        if r["variant"] not in variants:
            variants.append(r["variant"])
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    groups = [("prefill", lambda r: f"T={r['tokens']}", lambda r: r["tokens_per_s"], "prefill tokens/s"),
              ("decode", lambda r: f"B={r['batch']} p={r['prefix']}", lambda r: r["ms_per_token"], "decode ms/token"),
              ("decode", lambda r: f"B={r['batch']} p={r['prefix']}", lambda r: 100 * r["fraction_of_read_bandwidth"],
               "decode: % of read bandwidth (bytes/step / BW / time)")]
    for ax, (kind, label, value, title) in zip(axes, groups):
        rows = [r for r in record["rows"] if r["kind"] == kind]
        cats = []
        for r in rows:
            if label(r) not in cats:
                cats.append(label(r))
        width = 0.8 / max(len(variants), 1)
        for i, v in enumerate(variants):
            vals = [next((value(r) for r in rows if r["variant"] == v and label(r) == c), 0) for c in cats]
            ax.bar([j + i * width for j in range(len(cats))], vals, width, label=v)
        ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(cats))], cats)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    m = record["machine"]
    fig.suptitle(f"Kimi-Linear on transformers: stock vs k3 ({record['recipe']}, {record.get('k3_dtype', 'bfloat16')} "
                 f"model, k3 isa {record.get('k3_isa', 'best')}) - {m['cpu']}, isa {m['isa']}, {record['threads']} threads")
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def _write_json_atomic(path, record):
    """The JSON through a temporary file in the same directory and a rename: a reader never sees
    a partial file, and a failed write leaves the old one."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".k3-", suffix=".json.tmp", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _check_output(ap, flag, path):
    """An output path is checked before any round runs: its directory exists and is writable,
    and the path is not a directory."""
    if path is None:
        return
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        ap.error(f"{flag} {path} is a directory")
    if not os.path.isdir(d):
        ap.error(f"{flag} {path}: the directory {d} does not exist")
    if not os.access(d, os.W_OK):
        ap.error(f"{flag} {path}: the directory {d} is not writable")


def _count(lo, hi=None):
    """An argparse type: an integer in [lo, hi] (a clear error naming the flag otherwise)."""
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} must be in [{lo}, {hi if hi is not None else 'inf'}]")
        return v
    return parse


def _counts(lo, hi):
    """A comma-separated list of integers in [lo, hi]."""
    one = _count(lo, hi)

    def parse(text):
        items = [t for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("the list is empty")
        return [one(t.strip()) for t in items]
    return parse


def _check_args(ap, a):
    """Everything that can be checked without a model, before minutes of stock runs."""
    if a.top_k > a.experts:
        ap.error(f"--top-k {a.top_k} must be at most --experts {a.experts}")
    model_dtype = a.dtype if a.cmd == "generate" else a.k3_dtype
    if a.dense and model_dtype != "bfloat16":
        flag = "--dtype" if a.cmd == "generate" else "--k3-dtype"
        ap.error(f"--dense needs a bfloat16 model (k3's linear layer takes BF16 activations); {flag} is {model_dtype}")
    if a.isa:
        import k3.hf
        try:
            k3.hf.check_isa(a.isa)
        except ValueError as e:
            ap.error(f"--isa {a.isa}: {e}")
    if a.cmd == "bench":
        _check_output(ap, "--output", a.output)
        _check_output(ap, "--plot", a.plot)
        unknown = [s for s in a.skip if s not in ("stock-fp32", "stock-bf16")]
        if unknown:
            ap.error(f"--skip {','.join(unknown)}: known variants are stock-fp32, stock-bf16")
    if a.checkpoint:
        _check_config(a.checkpoint)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m k3 hf", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate with stock and with k3, print tokens/s")
    _common_args(g)
    g.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    g.add_argument("--prompt-tokens", type=_count(1, 1 << 20), default=32, help="random prompt length (without --prompt)")
    g.add_argument("--prompt", default=None, help="a text prompt (needs the checkpoint's tokenizer)")
    g.add_argument("--trust-remote-code", action="store_true", help="for the tokenizer of a hub checkpoint")
    g.add_argument("--new-tokens", type=_count(1, 1 << 20), default=32)
    b = sub.add_parser("bench", help="stock BF16 / stock FP32 / k3, interleaved; JSON and plot")
    _common_args(b)
    b.add_argument("--rounds", type=_count(1, 100), default=2)
    b.add_argument("--prefill", type=_counts(1, 1 << 20), default=[128, 1024])
    b.add_argument("--batch", type=_counts(1, 4096), default=[1, 8])
    b.add_argument("--new-tokens", type=_count(1, 1 << 20), default=16, help="decode steps per measurement")
    b.add_argument("--long-prefix", type=_count(0, 1 << 20), default=2048, help="decode after this prefix too (0: skip)")
    b.add_argument("--k3-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the dtype of the model k3 patches (float32 where torch has no BF16 hardware: AVX2)")
    b.add_argument("--skip", default="", help="comma-separated variants to skip (stock-fp32, stock-bf16)")
    b.add_argument("--output", "-o", default=None, help="JSON file")
    b.add_argument("--plot", default=None, help="PNG file (needs matplotlib)")
    a = ap.parse_args(argv)
    if a.cmd == "bench":
        a.skip = [s for s in a.skip.split(",") if s]
    _check_args(ap, a)
    try:
        return _cmd_generate(a) if a.cmd == "generate" else _cmd_bench(a)
    except (ValueError, TypeError) as e:  # k3's refusals (k3.hf.patch, the ops): one line, no traceback
        raise SystemExit(f"python -m k3 hf {a.cmd}: {e}") from None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
