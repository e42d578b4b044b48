#!/usr/bin/env python3
"""k3's CUDA KDA against flash-linear-attention's Triton kernels, on one GPU (device check step).

    python3 scripts/fla_kda_compare.py --k3 build-device/k3 --out DIR [--json FILE] [--quick]

1. Same inputs: writes a KDA problem (T tokens, H heads, K = V = 128, BF16 q/k/v, the log decay g
   of the safe gate computed here, beta) to DIR/kda_in.safetensors, runs
   `k3 kda run --backend cuda --gate log_decay` on it and fla's `chunk_kda` on the same tensors,
   and reports err_ratio = RMS(a - b) / RMS(b) of o and of the final state, each against an FP32
   reference computed here in torch (token by token, the recurrence of docs/kda.md).
2. Speed: fla `chunk_kda` prefill at T = 8192, H = 96 and `fused_recurrent_kda` decode of 64
   sequences (FP32 state), timed with CUDA events (median of N), for the table next to
   `k3 bench kda --backend cuda`.
Writes DIR/fla_kda.json (or --json FILE) after every stage, so that a run stopped half way keeps
what it measured: k3's own error against the FP32 reference first, before fla is imported (its
first call compiles Triton kernels, the slowest and least certain part), then fla's error, then
the speed cases. Prints a table. fla is imported from PYTHONPATH (the device check unpacks the
fla-core wheel it carries there); without it the script saves k3's error, says so and exits 3.
Exit 0: k3 ran and its error is below 5e-3; 1: it did not; 3: k3 passed but fla is missing.
"""
import argparse
import json
import os
import subprocess
import sys
import time


def err_ratio(a, b):
    d = (a.double() - b.double()).pow(2).mean().sqrt()
    r = b.double().pow(2).mean().sqrt()
    return float(d / r) if float(r) > 0 else float(d)


def cuda_time(fn, iters):
    import torch
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    times.sort()
    return {"median_s": times[len(times) // 2], "min_s": times[0], "max_s": times[-1], "iterations": iters}


def reference(q, k, v, g, beta, scale):
    """FP32 token recurrence, K-first state [H, K, V]; q, k L2-normalized (eps 1e-6 inside sqrt)."""
    import torch
    T, H, K = q.shape
    V = v.shape[-1]
    q = q.float()
    k = k.float()
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    S = torch.zeros(H, K, V, device=q.device, dtype=torch.float32)
    o = torch.empty(T, H, V, device=q.device, dtype=torch.float32)
    for t in range(T):
        S = S * torch.exp(g[t]).unsqueeze(-1)
        pred = torch.einsum("hk,hkv->hv", k[t], S)
        vn = beta[t].unsqueeze(-1) * (v[t].float() - pred)
        S = S + k[t].unsqueeze(-1) * vn.unsqueeze(1)
        o[t] = torch.einsum("hk,hkv->hv", q[t], S)
    return o, S


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k3", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--json", help="where the JSON goes (default OUT/fla_kda.json)")
    ap.add_argument("--quick", action="store_true", help="smaller speed cases")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    json_path = args.json or os.path.join(args.out, "fla_kda.json")
    result = {"steps": {}}

    def save():
        tmp = json_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=2)
        os.replace(tmp, json_path)

    try:
        import torch
        from safetensors.torch import load_file, save_file
    except Exception as e:  # noqa: BLE001
        print(f"fla compare: torch / safetensors not importable: {e}")
        result["error"] = f"torch / safetensors not importable: {e}"
        save()
        return 1
    dev = torch.device("cuda")
    torch.manual_seed(0)
    result["device"] = torch.cuda.get_device_name(0)

    # 1. Same inputs, correctness.
    T, H, K = 256, 4, 128
    q = torch.randn(T, H, K, device=dev).bfloat16()
    k = torch.randn(T, H, K, device=dev).bfloat16()
    v = torch.randn(T, H, K, device=dev).bfloat16()
    f = torch.randn(T, H, K, device=dev)
    a_log = torch.rand(H, device=dev) - 0.5
    g = (-5.0 * torch.sigmoid(torch.exp(a_log).view(1, H, 1) * f)).float().contiguous()  # safe gate, lb -5
    # beta rounded to BF16 once: fla takes it in the activations' dtype, k3 the same values as FP32.
    beta_b = torch.sigmoid(torch.randn(T, H, device=dev)).bfloat16()
    beta = beta_b.float().contiguous()
    scale = K ** -0.5
    path_in = os.path.join(args.out, "kda_in.safetensors")
    path_out = os.path.join(args.out, "kda_out_k3.safetensors")
    save_file({"q": q.cpu(), "k": k.cpu(), "v": v.cpu(), "g": g.cpu(), "beta": beta.cpu()}, path_in)
    step = {}
    result["steps"]["same_inputs"] = step
    o_k3 = None
    try:  # k3 against the FP32 reference, saved before fla is touched
        run = subprocess.run([args.k3, "kda", "run", "--backend", "cuda", "--gate", "log_decay", "--input", path_in,
                              "--output", path_out], capture_output=True, text=True, timeout=120)
        step["k3_rc"] = run.returncode
        step["k3_output"] = (run.stdout + run.stderr)[-2000:]
        o_ref, s_ref = reference(q, k, v, g, beta, scale)
        if run.returncode == 0:
            out = load_file(path_out)
            o_k3 = out["o"].to(dev).float().view(T, H, K)
            s_k3 = out["final_state"].to(dev).float().view(H, K, K)
            step["k3_o_err_ratio_vs_fp32_ref"] = err_ratio(o_k3, o_ref)
            step["k3_state_err_ratio_vs_fp32_ref"] = err_ratio(s_k3, s_ref)
    except Exception as e:  # noqa: BLE001
        step["error"] = repr(e)
    save()
    k3_ok = step.get("k3_rc") == 0 and step.get("k3_o_err_ratio_vs_fp32_ref", 1) < 5e-3
    print("k3 kda run --backend cuda:", {key: val for key, val in step.items() if key != "k3_output"}, flush=True)
    if step.get("k3_rc", 0) != 0:
        print("  k3 kda run output:", step.get("k3_output", "")[-600:], flush=True)
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except Exception as e:  # noqa: BLE001
        print(f"fla compare: fla not importable ({e}); carry the fla-core wheel (scripts/device-check.sh build)")
        result["error"] = f"fla not importable: {e}"
        save()
        return 3 if k3_ok else 1
    print("fla compare: fla imported; first chunk_kda call (Triton compile and autotune) ...", flush=True)
    try:
        t0 = time.time()
        o_fla, s_fla = chunk_kda(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta_b.unsqueeze(0),
                                 scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.cuda.synchronize()
        step["fla_first_call_s"] = time.time() - t0  # Triton compilation included
        step["fla_o_err_ratio_vs_fp32_ref"] = err_ratio(o_fla[0].float(), o_ref)
        step["fla_state_err_ratio_vs_fp32_ref"] = err_ratio(s_fla[0].float(), s_ref)
        if o_k3 is not None:
            step["k3_vs_fla_o_err_ratio"] = err_ratio(o_k3, o_fla[0].float())
    except Exception as e:  # noqa: BLE001
        step["fla_error"] = repr(e)
    save()

    # 2. Speed.
    Tp = 2048 if args.quick else 8192
    Hp = 96
    speed = {}
    result["steps"]["speed"] = speed  # saved after each case
    try:
        qp = torch.randn(1, Tp, Hp, K, device=dev).bfloat16()
        kp = torch.randn(1, Tp, Hp, K, device=dev).bfloat16()
        vp = torch.randn(1, Tp, Hp, K, device=dev).bfloat16()
        gp = (-5.0 * torch.sigmoid(torch.randn(1, Tp, Hp, K, device=dev))).float()
        bp = torch.sigmoid(torch.randn(1, Tp, Hp, device=dev)).bfloat16()
        print(f"fla compare: same inputs done ({step.get('fla_first_call_s', float('nan')):.1f} s first call); "
              f"speed, chunk_kda T = {Tp} ...", flush=True)
        t0 = time.time()
        chunk_kda(qp, kp, vp, gp, bp, scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.cuda.synchronize()
        speed["chunk_kda_first_call_s"] = time.time() - t0  # Triton compilation included
        speed["chunk_kda"] = {"T": Tp, "H": Hp, "K": K, "V": K, **cuda_time(
            lambda: chunk_kda(qp, kp, vp, gp, bp, scale=scale, output_final_state=True,
                              use_qk_l2norm_in_kernel=True), 10)}
    except Exception as e:  # noqa: BLE001
        speed["chunk_kda_error"] = repr(e)
    save()
    print("fla compare: speed, fused_recurrent_kda decode N = 64 ...", flush=True)
    try:
        N = 64
        qd = torch.randn(1, N, Hp, K, device=dev).bfloat16()
        kd = torch.randn(1, N, Hp, K, device=dev).bfloat16()
        vd = torch.randn(1, N, Hp, K, device=dev).bfloat16()
        gd = (-5.0 * torch.sigmoid(torch.randn(1, N, Hp, K, device=dev))).float()
        bd = torch.sigmoid(torch.randn(1, N, Hp, device=dev)).bfloat16()
        cu = torch.arange(N + 1, device=dev, dtype=torch.long)
        h0 = torch.randn(N, Hp, K, K, device=dev, dtype=torch.float32) * 0.01
        fn = lambda: fused_recurrent_kda(qd, kd, vd, gd, bd, scale=scale, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        tm = cuda_time(fn, 20)
        state_bytes = 2 * N * Hp * K * K * 4
        speed["fused_recurrent_kda_decode"] = {"N": N, "H": Hp, "K": K, "V": K, "state_bytes_read_written": state_bytes,
                                               "GBps": state_bytes / tm["median_s"] / 1e9, **tm}
    except Exception as e:  # noqa: BLE001
        speed["fused_recurrent_kda_error"] = repr(e)
    result["steps"]["speed"] = speed
    save()

    print("fla (flash-linear-attention / fla-core) on", result["device"])
    for key, val in step.items():
        if key != "k3_output":
            print(f"  same inputs  {key:34s} {val}")
    if step.get("k3_rc", 0) != 0:
        print("  k3 kda run output:", step.get("k3_output", "")[-600:])
    if "chunk_kda" in speed:
        c = speed["chunk_kda"]
        print(f"  chunk_kda prefill T={c['T']} H={c['H']}: {c['median_s'] * 1e3:.3f} ms median "
              f"[{c['min_s'] * 1e3:.3f}, {c['max_s'] * 1e3:.3f}] (first call {speed['chunk_kda_first_call_s']:.1f} s)")
    if "fused_recurrent_kda_decode" in speed:
        d = speed["fused_recurrent_kda_decode"]
        print(f"  fused_recurrent_kda decode N={d['N']} H={d['H']}: {d['median_s'] * 1e3:.3f} ms, {d['GBps']:.0f} GB/s "
              "of state read + written")
    for key in ("chunk_kda_error", "fused_recurrent_kda_error"):
        if key in speed:
            print("  error:", key, speed[key][:300])
    return 0 if k3_ok else 1


if __name__ == "__main__":
    sys.exit(main())
