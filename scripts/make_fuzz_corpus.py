#!/usr/bin/env python3
"""Writes the fuzzing seed corpora: tests/data/safetensors_corpus/ (tiny valid_* and malformed bad_*
safetensors files), tests/data/model_config_corpus/ (config.json texts) and
tests/data/kda_input_corpus/ (`k3 kda run` input files, KdaInputCorpus.ReplaysEveryFile). The unit tests
SafetensorsCorpus.ReplaysEveryFile / ModelConfigCorpus.ReplaysEveryFile require every valid_* file
to parse and every bad_* file to give an error; scripts/fuzz.sh starts from these corpora.
Re-running it rewrites the generated files (fuzzer crashers added by hand are kept)."""
import json
import os
import struct

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data")
OUT = os.path.join(DATA, "safetensors_corpus")
CONFIG_OUT = os.path.join(DATA, "model_config_corpus")


def image(header, data=b"", header_len=None, pad=True):
    text = header if isinstance(header, bytes) else header.encode()
    if pad and header_len is None:
        text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    n = len(text) if header_len is None else header_len
    return struct.pack("<Q", n) + text + data


def tensors(**entries):
    return json.dumps(entries, separators=(",", ":"))


def t(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


FILES = {
    # ---- valid ----
    "valid_empty": image("{}"),
    "valid_two_tensors": image(tensors(a=t("U8", [2, 2], 0, 4), b=t("BF16", [3], 4, 10)), bytes(range(10))),
    "valid_metadata": image(tensors(__metadata__={"format": "pt"}, w=t("F32", [1], 0, 4)), b"\0\0\x80\x3f"),
    "valid_scalar_and_zero": image(tensors(s=t("F64", [], 0, 8), z=t("I32", [0, 7], 8, 8)), bytes(8)),
    "valid_all_dtypes": image(tensors(**{d.lower(): t(d, [1], i * 8, i * 8 + sz) for i, (d, sz) in enumerate(
        [("BOOL", 1), ("U8", 1), ("I8", 1), ("U16", 2), ("I16", 2), ("U32", 4), ("I32", 4), ("U64", 8),
         ("I64", 8), ("F16", 2), ("BF16", 2), ("F32", 4), ("F64", 8), ("F8_E4M3", 1), ("F8_E5M2", 1)])}),
        bytes(15 * 8)),
    "valid_gap_and_trailing": image(tensors(a=t("U8", [2], 4, 6)), bytes(12)),
    "valid_kimi_expert": image(tensors(**{
        "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed": t("U8", [2, 16], 0, 32),
        "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_scale": t("U8", [2, 1], 32, 34)}),
        bytes(34)),
    # ---- malformed ----
    "bad_truncated_length": b"\x10\0\0\0\0",
    "bad_empty": b"",
    "bad_truncated_data": image(tensors(w=t("U8", [16], 0, 16)), bytes(10)),
    "bad_header_past_end": image(tensors(w=t("U8", [1], 0, 1)), b"\0", header_len=4000, pad=False),
    "bad_absurd_header": image("{}", header_len=200_000_000, pad=False),
    "bad_huge_header_u64": image("{}", header_len=2**64 - 1, pad=False),
    "bad_invalid_json": image('{"w":{"dtype":"U8",', pad=False),
    "bad_invalid_utf8": image(b'{"\xff\xfe":{}}', pad=False),
    "bad_non_object": image("[1,2,3]"),
    "bad_unknown_dtype": image(tensors(w=t("F4", [2], 0, 1)), b"\0"),
    "bad_dtype_not_string": image('{"w":{"dtype":8,"shape":[1],"data_offsets":[0,1]}}', b"\0"),
    "bad_offsets_out_of_range": image(tensors(w=t("U8", [4], 8, 12)), bytes(8)),
    "bad_offsets_begin_after_end": image(tensors(w=t("U8", [0], 6, 4)), bytes(8)),
    "bad_offsets_negative": image(tensors(w=t("U8", [1], -1, 0)), bytes(8)),
    "bad_offsets_overlap": image(tensors(a=t("U8", [8], 0, 8), b=t("U8", [4], 6, 10)), bytes(16)),
    "bad_offsets_contained": image(tensors(a=t("U8", [12], 0, 12), b=t("U8", [2], 2, 4), c=t("U8", [2], 8, 10)),
                                   bytes(16)),
    "bad_shape_size_mismatch": image(tensors(w=t("BF16", [2, 3], 0, 8)), bytes(8)),
    "bad_shape_overflow": image(tensors(w=t("U8", [2**32, 2**32], 0, 8)), bytes(8)),
    "bad_negative_dim": image(tensors(w=t("U8", [-2, 2], 0, 4)), bytes(4)),
    "bad_float_dim": image(tensors(w=t("U8", [1.5], 0, 1)), bytes(4)),
    "bad_duplicate_names": image('{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
                                 '"w":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}', bytes(4)),
    "bad_missing_offsets": image('{"w":{"dtype":"U8","shape":[1]}}', bytes(1)),
    "bad_metadata_not_strings": image('{"__metadata__":{"k":1}}'),
    "bad_entry_not_object": image('{"w":[1,2]}'),
    "bad_deep_nesting": image("[" * 200 + "]" * 200),
    # strict JSON: no byte order mark, no repeated key in any object, only spaces after the value
    "bad_bom": image(b"\xef\xbb\xbf{}"),
    "bad_duplicate_key_in_entry": image('{"w":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\0"),
    "bad_trailing_nul": image(b"{}\0"),
    "bad_trailing_garbage": image("{} x"),
    "bad_trailing_newline": image("{}\n"),
}


KIMI_TEXT = {
    "model_type": "kimi_linear", "hidden_size": 7168, "num_hidden_layers": 93, "num_experts": 896,
    "num_experts_per_token": 16, "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584,
    "num_shared_experts": 2, "first_k_dense_replace": 1, "moe_router_activation_func": "sigmoid",
    "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True, "routed_scaling_factor": 1.0,
    "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "rms_norm_eps": 1e-5,
    "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                            "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float",
                                                                      "group_size": 32}}}}}
DEEPSEEK = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "first_k_dense_replace": 3, "n_group": 8,
    "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "hidden_act": "silu"}


def without(d, key):
    return {k: v for k, v in d.items() if k != key}


CONFIGS = {
    "valid_kimi_k3": {"model_type": "kimi_k3", "text_config": KIMI_TEXT},
    "valid_deepseek_v3": DEEPSEEK,
    "bad_missing_num_experts": {"model_type": "kimi_k3", "text_config": without(KIMI_TEXT, "num_experts")},
    "bad_string_top_k": dict(DEEPSEEK, num_experts_per_tok="8"),
    "bad_topk_over_experts": dict(DEEPSEEK, num_experts_per_tok=300),
    "bad_groups": dict(DEEPSEEK, n_group=7),
    "bad_text_config_not_object": {"model_type": "kimi_k3", "text_config": [1]},
    "bad_not_json": "{\"model_type\": ",
    "bad_deep": "[" * 100 + "]" * 100,
    "bad_bom": "\ufeff" + json.dumps(DEEPSEEK),
    "bad_duplicate_key": '{"model_type": "a", "model_type": "b"}',
    "bad_trailing_garbage": json.dumps(DEEPSEEK) + " x",
    "bad_situ_beta_overflow": {"model_type": "kimi_k3", "text_config": dict(KIMI_TEXT, activation_situ_beta=1e39)},
}


def write_configs():
    os.makedirs(CONFIG_OUT, exist_ok=True)
    for name, value in CONFIGS.items():
        text = value if isinstance(value, str) else json.dumps(value, indent=1)
        with open(os.path.join(CONFIG_OUT, name + ".json"), "w", encoding="utf-8") as f:
            f.write(text)


# ---- KDA input files (`k3 kda run --input`, fuzz target kda_input) -----------------------------
KDA_OUT = os.path.join(DATA, "kda_input_corpus")
KDA_FMT = {"F32": "<f", "F64": "<d", "I64": "<q", "I32": "<i", "U8": "<B"}


def f16(x):
    return struct.pack("<e", x)


def bf16(x):
    return struct.pack("<f", x)[2:]


def st_file(tensors, metadata=None):
    """tensors: name -> (dtype, shape, values); packed contiguously in the given order."""
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, (dtype, shape, values) in tensors.items():
        if dtype == "BF16":
            raw = b"".join(bf16(v) for v in values)
        elif dtype == "F16":
            raw = b"".join(f16(v) for v in values)
        else:
            raw = b"".join(struct.pack(KDA_FMT[dtype], v) for v in values)
        header[name] = t(dtype, shape, len(data), len(data) + len(raw))
        data += raw
    return image(json.dumps(header, separators=(",", ":")), data)


def ramp(n, scale=0.25, offset=0.0):
    return [offset + scale * ((i * 7) % 5 - 2) for i in range(n)]


def kda(T=2, H=1, K=2, V=3, act="F32", drop=(), extra=None, metadata=None, beta="beta", batch=False):
    """A small `k3 kda run` input: q, k, v [T, H, K|V], g [T, H, K] (log decays), beta [T, H]."""
    b = [1] if batch else []
    ts = {"q": (act, b + [T, H, K], ramp(T * H * K)), "k": (act, b + [T, H, K], ramp(T * H * K, 0.5, 0.1)),
          "v": (act, b + [T, H, V], ramp(T * H * V, 1.0)), "g": ("F32", b + [T, H, K], [-0.5] * (T * H * K)),
          beta: ("F32", b + [T, H], ramp(T * H))}
    for name in drop:
        ts.pop(name)
    ts.update(extra or {})
    return st_file(ts, metadata)


INF, NAN = float("inf"), float("nan")
KDA_FILES = {
    # ---- valid: load_input_file accepts them and the references run ----
    "valid_log_decay_f32": kda(),
    "valid_batch_dim_beta_logits": kda(batch=True, beta="beta_logits"),
    "valid_safe_bf16_varlen": kda(T=3, H=2, K=2, V=2, act="BF16", extra={
        "A_log": ("F32", [2], [0.1, -0.3]), "dt_bias": ("F32", [2, 2], [0.0, 0.5, -0.5, 1.0]),
        "cu_seqlens": ("I64", [4], [0, 1, 1, 3]), "initial_state": ("F32", [3, 2, 2, 2], ramp(24, 0.1))}),
    "valid_softplus_v_first_f16": kda(T=2, H=1, K=2, V=3, act="F16", metadata={"gate": "softplus", "layout": "v_first"},
                                      extra={"A_log": ("F64", [4], [0.5, 0.0, 0.0, 0.0]),
                                             "cu_seqlens": ("I32", [2], [0, 2]),
                                             "initial_state": ("F32", [1, 1, 3, 2], ramp(6, 0.1))}),
    "valid_no_tokens": kda(T=0, H=2, K=4, V=4),
    "valid_nonfinite_values": kda(T=3, H=1, K=2, V=2, extra={
        "g": ("F32", [3, 1, 2], [-0.5, INF, -INF, -0.5, NAN, -0.1]),
        "v": ("F32", [3, 1, 2], [1.0, INF, 0.5, -0.5, 0.25, 1.0]),
        "initial_state": ("F32", [1, 1, 2, 2], [0.0, NAN, 0.5, -INF])}),
    # ---- bad: load_input_file refuses them (tests/core/test_kda_input_corpus.cpp: the messages) ----
    "bad_missing_q": kda(drop=("q",)),
    "bad_q_rank": kda(extra={"q": ("F32", [2, 2], ramp(4))}),
    "bad_v_tokens": kda(extra={"v": ("F32", [3, 1, 3], ramp(9))}),
    "bad_k_shape": kda(extra={"k": ("F32", [2, 1, 3], ramp(6))}),
    "bad_q_dtype": kda(extra={"q": ("I32", [2, 1, 2], [1, 2, 3, 4])}),
    "bad_beta_both": kda(extra={"beta_logits": ("F32", [2, 1], [0.0, 0.0])}),
    "bad_beta_missing": kda(drop=("beta",)),
    "bad_beta_shape": kda(extra={"beta": ("F32", [1, 2], [0.0, 0.0])}),
    "bad_gate_unknown": kda(metadata={"gate": "sigmoid"}),
    "bad_layout_unknown": kda(metadata={"layout": "h_first"}),
    "bad_safe_without_a_log": kda(metadata={"gate": "safe"}),
    "bad_a_log_with_log_decay": kda(metadata={"gate": "log_decay"}, extra={"A_log": ("F32", [1], [0.0])}),
    "bad_a_log_short": kda(H=2, extra={"A_log": ("F32", [1], [0.0]), "q": ("F32", [2, 2, 2], ramp(8)),
                                       "k": ("F32", [2, 2, 2], ramp(8)), "v": ("F32", [2, 2, 3], ramp(12)),
                                       "g": ("F32", [2, 2, 2], [0.0] * 8), "beta": ("F32", [2, 2], ramp(4))}),
    "bad_a_log_range": kda(extra={"A_log": ("F32", [1], [100.0])}),
    "bad_a_log_nan": kda(extra={"A_log": ("F32", [1], [NAN])}),
    "bad_dt_bias_shape": kda(extra={"A_log": ("F32", [1], [0.0]), "dt_bias": ("F32", [3], [0.0] * 3)}),
    "bad_cu_seqlens_decreasing": kda(extra={"cu_seqlens": ("I64", [3], [0, 2, 1])}),
    "bad_cu_seqlens_last": kda(extra={"cu_seqlens": ("I64", [2], [0, 3])}),
    "bad_cu_seqlens_empty": kda(extra={"cu_seqlens": ("I64", [0], [])}),
    "bad_cu_seqlens_dtype": kda(extra={"cu_seqlens": ("U8", [2], [0, 2])}),
    "bad_initial_state_shape": kda(extra={"initial_state": ("F32", [1, 1, 3, 2], [0.0] * 6)}),
    "bad_too_many_heads": kda(T=0, H=2000, K=4, V=4),
    "bad_final_state_too_big": kda(T=0, H=1024, K=512, V=512, extra={"cu_seqlens": ("I64", [300], [0] * 300)}),
}


def write_kda_inputs():
    os.makedirs(KDA_OUT, exist_ok=True)
    for name, data in KDA_FILES.items():
        with open(os.path.join(KDA_OUT, name + ".safetensors"), "wb") as f:
            f.write(data)


def write_reference_file():
    """valid_reference_writer: written by the reference implementation (PyPI `safetensors`, Rust
    core; committed output of safetensors 0.8.0). SafetensorsFile.ReadsTheReferenceWritersOutput
    checks its contents. Skipped when the module is not installed."""
    try:
        import numpy as np
        from safetensors.numpy import save_file
    except ImportError:
        print("safetensors / numpy not installed: valid_reference_writer left as committed")
        return
    save_file({"a": np.arange(12, dtype=np.uint8).reshape(3, 4), "b": np.full((2, 5), 1.5, dtype=np.float32),
               "c": np.zeros((0, 3), dtype=np.int64), "s": np.array(3.0, dtype=np.float64)},
              os.path.join(OUT, "valid_reference_writer.safetensors"), metadata={"format": "np"})


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, data in FILES.items():
        with open(os.path.join(OUT, name + ".safetensors"), "wb") as f:
            f.write(data)
    write_reference_file()
    write_configs()
    write_kda_inputs()
    print(f"wrote {len(FILES)} files to {os.path.normpath(OUT)}, {len(CONFIGS)} to {os.path.normpath(CONFIG_OUT)}, "
          f"{len(KDA_FILES)} to {os.path.normpath(KDA_OUT)}")


if __name__ == "__main__":
    main()
