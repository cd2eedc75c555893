#!/usr/bin/env python3
"""PyTorch SDPA's causal bf16 attention on fusec's attention shapes, next to fusec's own kernels.

Times torch.nn.functional.scaled_dot_product_attention forced onto each backend
(FLASH_ATTENTION, CUDNN_ATTENTION) with torch.nn.attention.sdpa_kernel: forward, and backward
(torch.autograd.grad of the output with respect to the q, k, v views: the backward kernel
alone; also printed: into the packed qkv, which adds autograd's copy), each the median of
CUDA-event timings after a warm-up.
q, k, v are views of one packed [B, T, 3C] tensor, as fusec reads them (and as GPT-2 training
code passes them). TFLOP/s counts causal work: forward 2*B*H*T^2*d, backward 2.5 times that.

    python3 attention_sdpa.py [--fusec fusec.json] [--iters 30]

With --fusec (the JSON lines that `attention_bench --json` writes), prints fusec's times beside
and the ratios fusec / fastest backend (below 1: fusec is faster).
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [  # name, B, H, T, d (the same list as attention_bench.rs)
    ("124M", 16, 12, 1024, 64),
    ("1.5B", 8, 25, 1024, 64),
    ("d128", 8, 12, 1024, 128),
]
BACKENDS = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]


def median_ms(fn, iters):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def bench(b, h, t, d, backend, iters):
    c = h * d
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(b, t, 3 * c, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    q, k, v = (x.view(b, t, h, d).transpose(1, 2) for x in qkv.split(c, dim=2))
    dout = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    with sdpa_kernel([backend]):
        fwd = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), iters)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # Gradients of the q, k, v views: the backward kernel alone (what fusec's two backward
        # kernels are compared with); of the packed qkv: plus autograd's copy into one tensor.
        bwd = median_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), iters)
        packed = median_ms(lambda: torch.autograd.grad(out, qkv, dout, retain_graph=True), iters)
    return fwd, bwd, packed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fusec", help="JSON lines from attention_bench --json")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    fusec = {}
    if args.fusec:
        for line in open(args.fusec):
            if line.strip():
                r = json.loads(line)
                fusec.setdefault(r["shape"], []).append(r)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    rows = []
    for name, b, h, t, d in SHAPES:
        flops = 2.0 * b * h * t * t * d
        best = None
        for bname, backend in BACKENDS:
            try:
                fwd, bwd, packed = bench(b, h, t, d, backend, args.iters)
            except RuntimeError as e:
                print(f"{name} {bname}: not available ({str(e).splitlines()[0][:100]})")
                continue
            rows.append((name, f"sdpa {bname}", fwd, bwd, flops))
            print(f"{name} sdpa {bname}: backward into the packed qkv {packed:.3f} ms (views: {bwd:.3f} ms)")
            if best is None or fwd + bwd < best[0] + best[1]:
                best = (fwd, bwd, bname)
        for r in fusec.get(name, []):
            rows.append((name, f"fusec {r['variant']}", r["fwd_ms"], r["dq_ms"] + r["dkv_ms"], flops))
            if best:
                fb = r["fwd_ms"] + r["dq_ms"] + r["dkv_ms"]
                rows.append((name, f"  fusec/{best[2]}", r["fwd_ms"] / best[0], (r["dq_ms"] + r["dkv_ms"]) / best[1], fb / (best[0] + best[1])))
    print(f"\n{'shape':6} {'kernels':28} {'fwd ms':>8} {'TFLOP/s':>8} {'bwd ms':>8} {'TFLOP/s':>8} {'fwd+bwd':>8}")
    for name, what, fwd, bwd, flops in rows:
        if what.startswith("  "):  # a ratio row: fusec / the fastest backend (flops holds fwd+bwd's)
            print(f"{name:6} {what:28} {fwd:>7.2f}x {'':>8} {bwd:>7.2f}x {'':>8} {flops:>7.2f}x")
        else:
            tf, tb = flops / fwd / 1e9, 2.5 * flops / bwd / 1e9
            print(f"{name:6} {what:28} {fwd:8.3f} {tf:8.0f} {bwd:8.3f} {tb:8.0f} {fwd + bwd:8.3f}")


if __name__ == "__main__":
    main()
