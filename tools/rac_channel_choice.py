"""Measure per-layer vs per-expert RAC compensation channels for fc2 on a synthetic MoE layer (CPU, ~1-2 min per seed).

fc2 inputs h = SiLU(x Wg^T) * (x Wu^T) differ per expert. Two synthetic layers:
  "random":     Gaussian weights, hidden states with a few x30 outlier channels;
  "structured": as random, plus 4 intermediate channels per expert (different ones per
                expert) whose up-projection rows are 8x larger, the per-expert massive
                channels seen in real MoE down_proj inputs.
Channels are calibrated on one token set and the fc2 output error (W4A4 vs BF16 activations,
same NVFP4 weights) is measured on held-out tokens, relative Frobenius over routed rows.

    PYTHONPATH=. python tools/rac_channel_choice.py [--seeds 2]
"""

from __future__ import annotations

import argparse

import torch

from quads_megatron.nvfp4 import dequantize, quantize
from quads_megatron.rac import (ActivationStats, calibrate_comp_channels, compensated_activation,
                                weight_column_norm_sq)


def layer(seed, structured, h=512, f=256, e=16, outliers=4):
    g = torch.Generator().manual_seed(seed)
    wg = torch.randn(e, f, h, generator=g) / h ** 0.5
    wu = torch.randn(e, f, h, generator=g) / h ** 0.5
    if structured:
        for i in range(e):
            wu[i, torch.randperm(f, generator=g)[:4]] *= 8
    w2 = torch.randn(e, h, f, generator=g) / f ** 0.5
    w2q = torch.stack([dequantize(quantize(w2[i]), torch.float32) for i in range(e)])
    hot = torch.randperm(h, generator=g)[:outliers]
    return g, wg, wu, w2q, hot


def tokens(g, hot, n, h=512):
    x = torch.randn(n, h, generator=g) * (0.5 + torch.rand(h, generator=g))
    x[:, hot] *= 30
    return x


def fc2_inputs(x, wg, wu, topk, g):
    """Routed rows: (expert id per row, h per row)."""
    e = wg.shape[0]
    ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(x.shape[0])])
    ex = ids.reshape(-1)
    xr = x.repeat_interleave(topk, 0)
    hrows = torch.nn.functional.silu(torch.einsum("mh,mfh->mf", xr, wg[ex])) * \
        torch.einsum("mh,mfh->mf", xr, wu[ex])
    return ex, hrows


def fc2_error(ex, hrows, w2q, comp):
    """||y_w4a4(+RAC) - y_bf16|| / ||y_bf16|| over routed rows."""
    err = ref = 0.0
    for i in range(w2q.shape[0]):
        rows = (ex == i).nonzero().flatten()
        if rows.numel() == 0:
            continue
        hx = hrows[rows]
        y_ref = hx.to(torch.bfloat16).float() @ w2q[i].t()
        c = None if comp is None else (comp if comp.ndim == 1 else comp[i])
        xq, rq = compensated_activation(hx, c)
        y = xq @ w2q[i].t()
        if c is not None:
            y = y + rq @ w2q[i][:, c.long()].t()
        err += (y - y_ref).square().sum().item()
        ref += y_ref.square().sum().item()
    return (err / ref) ** 0.5


def run(seed, structured, k, n_cal=2048, n_eval=2048, topk=4):
    g, wg, wu, w2q, hot = layer(seed, structured)
    e = wg.shape[0]
    ex_c, h_c = fc2_inputs(tokens(g, hot, n_cal), wg, wu, topk, g)
    ex_e, h_e = fc2_inputs(tokens(g, hot, n_eval), wg, wu, topk, g)
    s_layer = ActivationStats(h_c.shape[1])
    s_layer.update(h_c)
    s_exp = ActivationStats(h_c.shape[1], num_groups=e)
    s_exp.update(h_c, ex_c)
    c_layer = calibrate_comp_channels(s_layer, weight_column_norm_sq(w2q, per_expert=False), k)
    c_exp = calibrate_comp_channels(s_exp, weight_column_norm_sq(w2q, per_expert=True), k)
    return dict(none=fc2_error(ex_e, h_e, w2q, None), per_layer=fc2_error(ex_e, h_e, w2q, c_layer),
                per_expert=fc2_error(ex_e, h_e, w2q, c_exp))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--k", type=int, default=32, help="compensation channels per set")
    args = p.parse_args()
    print("| layer | seed | no RAC | per-layer set | per-expert sets |")
    print("|---|---|---|---|---|")
    for structured in (False, True):
        for seed in range(args.seeds):
            r = run(seed, structured, args.k)
            print(f"| {'structured' if structured else 'random'} | {seed} | {r['none']:.4f} | "
                  f"{r['per_layer']:.4f} | {r['per_expert']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
