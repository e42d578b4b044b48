"""python -m k3 generate --checkpoint DIR --prompt TEXT: the native runner (k3.Model) on text,
tokenized with the checkpoint's own tokenizer through transformers (AutoTokenizer). With
--prompt-ids instead of --prompt it is the k3 tool's ``k3 generate`` (ids in, ids out)."""

import argparse
import sys
import time


def main(argv):
    p = argparse.ArgumentParser(prog="python -m k3 generate",
                                description="Generate text with the native runner (k3.Model) on a Kimi-Linear checkpoint.")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (config.json, safetensors, tokenizer)")
    p.add_argument("--prompt", required=True, help="prompt text (tokenized with the checkpoint's tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trunk", choices=("mxfp8", "bf16"), default="mxfp8")
    p.add_argument("--experts", choices=("w4a16", "w4a8"), default="w4a16")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    a = p.parse_args(argv)

    import os
    if not os.path.isdir(a.checkpoint):
        p.error(f"--checkpoint {a.checkpoint!r} is not a directory")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        p.error("--prompt needs transformers for the checkpoint's tokenizer (pip install transformers), "
                "or pass token ids with --prompt-ids")
    try:
        tok = AutoTokenizer.from_pretrained(a.checkpoint, trust_remote_code=True)
    except Exception as e:  # noqa: BLE001 - any loader failure is reported with its cause
        p.error(f"cannot load the tokenizer of {a.checkpoint}: {type(e).__name__}: {e}")
    if a.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": a.prompt}], add_generation_prompt=True)
    else:
        ids = tok(a.prompt)["input_ids"]
    if not ids:
        p.error("--prompt tokenizes to no tokens")

    from .model import Model
    try:
        m = Model.from_pretrained(a.checkpoint, trunk=a.trunk, experts=a.experts, threads=a.threads,
                                  max_context=a.max_context, progress=True)
        t0 = time.perf_counter()
        out = m.generate(ids, a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed)
        dt = time.perf_counter() - t0
    except (ValueError, RuntimeError) as e:
        print(f"python -m k3 generate: {e}", file=sys.stderr)
        return 2
    print(tok.decode(list(out), skip_special_tokens=True))
    print(f"python -m k3 generate: {len(ids)} prompt tokens, {len(out)} new tokens in {dt:.2f} s", file=sys.stderr)
    return 0
