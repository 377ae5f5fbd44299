"""How far two equally valid fp32 W4A4 MoE results can differ: fc1's summation order flips fc2's NVFP4 codes.

W4A4 quantizes fc2's input h = SiLU(gate) * up, a computed value. fc1's output differs by ulps
between any two fp32 summation orders (the kernel's K tiles vs cuBLAS / MKL), and an ulp change
moves an element across an E2M1 rounding boundary about once in 10^6 elements. One such code
flip changes one token's output by ~1% (one quantization step of one of its 8 routed rows), so
the layer's relative error (Frobenius) is ~1e-2 / sqrt(tokens) per flip, while every other token
agrees at the fp32 level (~1e-7). This script measures that between the torch reference
(`quads_megatron.kernels.reference.w4a4_fused_moe`) and the same math with fc1 summed in K chunks
of 128 (the kernel's order); with --kernel also the Triton op against the reference. The same
signature (a few tokens at ~1e-2, the rest at ~1e-7) means code flips, not a wrong kernel.

    PYTHONPATH=. python3 tools/moe_fp32_order_sensitivity.py --device cuda --experts 128 --kernel
    .venv/bin/python tools/moe_fp32_order_sensitivity.py            # CPU, 16 experts (~20 s)
"""

from __future__ import annotations

import argparse

import torch

from quads_megatron.rac import compensated_activation
from quads_megatron.kernels import reference


def random_packed(e: int, n: int, k: int, dev: str, gen: torch.Generator) -> tuple:
    """Random NVFP4 experts as in the kernel tests (every code, e4m3 scales in [2^-3, 2^4])."""
    return (torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=dev, generator=gen),
            torch.randint(0x20, 0x60, (e, n, k // 16), dtype=torch.uint8, device=dev,
                          generator=gen).view(torch.float8_e4m3fn),
            torch.rand(e, device=dev, generator=gen) * 1e-3 + 5e-4)


def moe_fc1_in_chunks(x, w13, w2, tw, ti, chunk: int) -> torch.Tensor:
    """The reference's W4A4 MoE with fc1 summed over K in chunks (another valid fp32 order)."""
    w13f = reference.dequantize_weight(*w13, backend="torch")
    w2f = reference.dequantize_weight(*w2, backend="torch")
    tokens, topk = ti.shape
    f = w2f.shape[-1]
    xq, _ = compensated_activation(x, None)
    flat, rows_out = ti.reshape(-1), x.new_zeros(tokens * topk, w2f.shape[1])
    for e in range(w13f.shape[0]):
        rows = (flat == e).nonzero().flatten()
        if rows.numel() == 0:
            continue
        a = xq[rows // topk]
        gu = sum(a[:, k0:k0 + chunk] @ w13f[e][:, k0:k0 + chunk].t()
                 for k0 in range(0, a.shape[1], chunk))
        h = torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]
        hq, _ = compensated_activation(h, None)
        rows_out[rows] = (hq @ w2f[e].t()) * tw.reshape(-1)[rows, None]
    return rows_out.view(tokens, topk, -1).sum(1)


def report(name: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    per_token = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
    total = ((out - ref).norm() / ref.norm()).item()
    print(f"  {name:28s} rel {total:.2e}  tokens > 1e-5: {int((per_token > 1e-5).sum())}"
          f"/{per_token.numel()}  max token {per_token.max().item():.2e}  median token "
          f"{per_token.median().item():.2e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--kernel", action="store_true", help="also run the Triton op (GPU)")
    args = p.parse_args()
    e, h, f, topk, dev = args.experts, 2048, 768, 8, args.device
    for t in args.tokens:
        gen = torch.Generator(device=dev).manual_seed(t)
        w13, w2 = random_packed(e, 2 * f, h, dev, gen), random_packed(e, h, f, dev, gen)
        x = torch.randn(t, h, device=dev, generator=gen) * 2
        tw, ti = torch.topk(torch.randn(t, e, device=dev, generator=gen).softmax(-1), topk)
        tw, ti = tw / tw.sum(-1, keepdim=True), ti.int()
        ref = reference.w4a4_fused_moe(x, *w13, *w2, tw, ti, act_mode="w4a4")
        print(f"tokens {t} (experts {e}, fp32 inputs, w4a4)")
        report("fc1 in K chunks of 128", moe_fc1_in_chunks(x, w13, w2, tw, ti, 128), ref)
        if args.kernel:
            from quads_megatron.kernels import w4a4_fused_moe

            report("Triton w4a4_fused_moe", w4a4_fused_moe(x, *w13, *w2, tw, ti, act_mode="w4a4",
                                                            backend="triton"), ref)


if __name__ == "__main__":
    main()
