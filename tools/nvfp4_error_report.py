"""Quantize the weights and activations of a tiny random MoE layer to NVFP4 and report errors.

A quick, real look at the format: relative error of weights (1x16 and 16x16 blocks) and
of activations (per-tensor and per-token scales), with and without outlier channels.
"""

import argparse

import torch

from quads_megatron import nvfp4


def rel_err(x, xh):
    return ((x.float() - xh.float()).norm() / x.float().norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--ffn-hidden-size", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    w = (torch.randn(args.ffn_hidden_size, args.hidden_size) * 0.02).bfloat16()
    x = torch.randn(args.tokens, args.hidden_size).bfloat16()
    x_out = x.clone()
    x_out[:, :4] *= 30  # a few outlier channels, as LLM activations have
    print(f"{'tensor':40s} {'rel. error':>10s}")
    for name, t, opts in [
        ("expert weight, 1x16 blocks", w, {}),
        ("expert weight, 16x16 blocks", w, {"block_shape": (16, 16)}),
        ("activations, per-tensor scale", x, {}),
        ("activations, per-token scale", x, {"per_row": True}),
        ("activations + outliers, per-token", x_out, {"per_row": True}),
    ]:
        print(f"{name:40s} {rel_err(t, nvfp4.fake_quantize(t, **opts)):10.4f}")
    y_ref = x_out.float() @ w.float().t()
    y_w4a16 = x_out.float() @ nvfp4.fake_quantize(w).float().t()
    y_w4a4 = nvfp4.fake_quantize(x_out, per_row=True).float() @ nvfp4.fake_quantize(w).float().t()
    print(f"{'GEMM output, W4A16':40s} {rel_err(y_ref, y_w4a16):10.4f}")
    print(f"{'GEMM output, W4A4':40s} {rel_err(y_ref, y_w4a4):10.4f}")


if __name__ == "__main__":
    main()
