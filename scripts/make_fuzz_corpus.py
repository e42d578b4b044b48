#!/usr/bin/env python3
"""Writes the fuzzing seed corpora: tests/data/safetensors_corpus/ (tiny valid_* and malformed bad_*
safetensors files) and tests/data/model_config_corpus/ (config.json texts). The unit tests
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
    print(f"wrote {len(FILES)} files to {os.path.normpath(OUT)}, {len(CONFIGS)} to {os.path.normpath(CONFIG_OUT)}")


if __name__ == "__main__":
    main()
