"""Time one whole MoE layer (Qwen3-30B-A3B: 128 experts, hidden 2048, FFN 768, top-8) in BF16, FP8 and our NVFP4 modes.

Issue 13's measurement: random routing (random router logits -> softmax -> top-k, renormalized,
so at 16 tokens only ~81 of 128 experts are hit and some experts get no tokens), every variant
captured in a CUDA graph, all in the same run:
  bf16      a layer built from `torch._grouped_mm` (rows sorted by expert, SiLU(gate) * up, the
            top-k weighted sum), the weights being our NVFP4 weights dequantized to BF16;
  fp8       the same layer on `torch._scaled_grouped_mm` (e4m3, row-wise scales: one per
            weight row per expert, one per activation row computed inside the layer);
  w4a16 / w4a4 / w4a4_rac   `quads_megatron.kernels.w4a4_fused_moe` (RAC with k channels: one set
            for fc1, one set per expert for fc2, and their weight columns built once, as SGLang's
            `process_weights_after_loading` stores them), for each kernel of --kernels:
            v2 (ModelOpt's packed layout) and v3 (the weights in `fragment_layout`'s order,
            weight_layout="fragment"); the ratios and bandwidth columns use the last kernel listed.
The timed region is the layer from (hidden states, top-k weights, top-k ids) to its output
(routing sort included, router excluded). Before timing, each of our modes is checked against
the torch reference (`quads_megatron.kernels.reference`) at the kernel tests' tolerances (bf16
inputs, the timed case, and fp32 inputs: the fp32-accumulation level), and the bf16 / fp8 layers
against a plain per-expert loop on the same operands. A failed check is reported in the table
and the JSON, and the exit status is 1.

Weight bandwidth: bytes of the experts the routing hits (packed codes + block scales, plus the
RAC weight columns where the layer reads them) per layer time, against a device-to-device copy
(read + written bytes per second) measured in the same run.

    PYTHONPATH=. python3 tools/bench_moe_layer.py [--tokens 16 64 256 1024 4096] [--json out.json]
    PYTHONPATH=. python3 tools/bench_moe_layer.py --sweep        # + v3 tile configs (--sweep-kernel v2)
    PYTHONPATH=. python3 tools/bench_moe_layer.py --device cpu --tiny   # CPU smoke run (interpreter)

On CPU (--tiny) the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before
Triton is imported), nothing is graph-captured, and `torch._scaled_grouped_mm` (CUDA only) is
replaced by the same per-group math in torch, so the smoke run covers the plumbing only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, NamedTuple, Optional

import torch

MODES = ("w4a16", "w4a4", "w4a4_rac")
KERNELS = ("v2", "v3")  # v2: ModelOpt's packed layout; v3: fragment order (weight_layout="fragment")
LAYOUT = {"v2": "modelopt", "v3": "fragment"}
# tests/kernels/test_w4a4_kernels.py::_check_moe: bf16 outputs, and fp32 outputs
# (1.5 x FP32_TOL: the fp32-accumulation level)
TOL = {torch.bfloat16: 8e-3, torch.float32: 3e-6}
BASELINE_TOL = 8e-3  # the bf16 layer against the plain loop (a few bf16 roundings)
# the fp8 layer: a bf16 rounding of fc1's output can move an e4m3 code of fc2's input by one step (up to
# 2^-3 of that value); ~2% of them moving gives ~8e-3, as measured at 64 tokens (8.5e-3): allow 2e-2
FP8_BASELINE_TOL = 2e-2
FP8_MAX = 448.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-experts", type=int, default=128)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--moe-ffn-hidden-size", type=int, default=768)
    p.add_argument("--moe-router-topk", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    p.add_argument("--rac-channels", type=int, default=64, help="RAC channels k of fc1 and of fc2")
    p.add_argument("--iters", type=int, default=50, help="timed graph replays per variant (median)")
    p.add_argument("--reps", type=int, default=10, help="layer calls captured per graph")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes (8 experts, hidden 128, FFN 128, top-2, k 16, tokens 3; v3 needs "
                        "multiples of 128)")
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS),
                   help="our kernels timed in the same run (the last one is the table's ratios)")
    p.add_argument("--sweep", action="store_true", help="also time w4a4 and w4a4_rac with several (fc1, fc2) tile configs")
    p.add_argument("--sweep-kernel", choices=KERNELS, default="v3", help="the kernel --sweep times")
    p.add_argument("--pdl-ab", action="store_true",
                   help="also time the last kernel's w4a4 and w4a4_rac launched without PDL (kernels.pdl)")
    p.add_argument("--profile", action="store_true",
                   help="per-kernel CUDA time of the fp8, w4a4 and w4a4_rac layers (plain launches, no PDL)")
    args = p.parse_args(argv)
    if args.tiny:
        args.num_experts, args.hidden_size, args.moe_ffn_hidden_size = 8, 128, 128
        args.moe_router_topk, args.rac_channels = 2, 16
        if "--tokens" not in (argv if argv is not None else sys.argv[1:]):
            args.tokens = [3]
    return args


# ---- operands ---------------------------------------------------------------------------
class Experts(NamedTuple):
    """One layer's expert weights in every form the variants read."""
    w13: tuple  # NVFP4 (codes uint8 [E, 2F, H//2], e4m3 [E, 2F, H//16], scale_2 fp32 [E])
    w2: tuple   # NVFP4 (codes [E, H, F//2], e4m3 [E, H, F//16], scale_2 [E])
    c13: torch.Tensor  # RAC channels of fc1, int32 [k] (one set: all experts read the same x)
    c2: torch.Tensor   # RAC channels of fc2, int32 [E, k] (one set per expert)
    w13_cols: torch.Tensor  # RAC weight columns fp16 [E, 2F, k] (rac_weight_columns, built once)
    w2_cols: torch.Tensor   # fp16 [E, H, k]
    w13_bf16: torch.Tensor  # [E, 2F, H]: the NVFP4 weights dequantized (rounded to bf16)
    w2_bf16: torch.Tensor   # [E, H, F]
    w13_fp8: torch.Tensor   # e4m3 [E, 2F, H], row-wise scales w13_fp8_scale fp32 [E, 2F]
    w13_fp8_scale: torch.Tensor
    w2_fp8: torch.Tensor    # e4m3 [E, H, F], scales [E, H]
    w2_fp8_scale: torch.Tensor
    w13_frag: tuple  # w13 / w2 with codes and block scales in fragment order (the v3 kernel's load-time layout)
    w2_frag: tuple


def random_nvfp4(e: int, n: int, k: int, gen: torch.Generator, dev) -> tuple:
    """Random NVFP4 weights: every E2M1 code, finite e4m3 block scales in [2^-3, 2^4], one scale_2 per expert."""
    codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(0x20, 0x60, (e, n, k // 16), dtype=torch.uint8, generator=gen)
    scale_2 = torch.rand(e, generator=gen) * 1e-3 + 5e-4
    return codes.to(dev), scale.view(torch.float8_e4m3fn).to(dev), scale_2.to(dev)


def fp8_rows(v: torch.Tensor) -> tuple:
    """e4m3 with one fp32 scale per row (amax / 448, as torch's row-wise FP8 recipes), over the last dim."""
    scale = v.abs().amax(-1).float().clamp_min(1e-12) / FP8_MAX
    q = (v.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def comp_channels(k_in: int, k: int, groups: Optional[int], gen: torch.Generator, dev) -> torch.Tensor:
    """Sorted random RAC channel set(s): int32 [k], or [groups, k]."""
    def one():
        return torch.sort(torch.randperm(k_in, generator=gen)[:k]).values
    t = one() if groups is None else torch.stack([one() for _ in range(groups)])
    return t.to(torch.int32).to(dev)


def build_experts(args, gen: torch.Generator, dev) -> Experts:
    from quads_megatron.kernels.fragment_layout import to_fragment_order, to_fragment_scale_order
    from quads_megatron.kernels.rac_columns import rac_weight_columns
    from quads_megatron.kernels.reference import dequantize_weight

    e, h, f, k = args.num_experts, args.hidden_size, args.moe_ffn_hidden_size, args.rac_channels
    w13, w2 = random_nvfp4(e, 2 * f, h, gen, dev), random_nvfp4(e, h, f, gen, dev)
    c13, c2 = comp_channels(h, k, None, gen, dev), comp_channels(f, k, e, gen, dev)
    w13_bf16 = dequantize_weight(*w13, backend="torch").to(torch.bfloat16)
    w2_bf16 = dequantize_weight(*w2, backend="torch").to(torch.bfloat16)
    w13_fp8, w13_fp8_scale = fp8_rows(w13_bf16)
    w2_fp8, w2_fp8_scale = fp8_rows(w2_bf16)
    return Experts(w13, w2, c13, c2, rac_weight_columns(w13[0], w13[1], c13), rac_weight_columns(w2[0], w2[1], c2),
                   w13_bf16, w2_bf16, w13_fp8, w13_fp8_scale, w2_fp8, w2_fp8_scale,
                   (to_fragment_order(w13[0]), to_fragment_scale_order(w13[1]), w13[2]),
                   (to_fragment_order(w2[0]), to_fragment_scale_order(w2[1]), w2[2]))


def random_routing(t: int, e: int, topk: int, gen: torch.Generator, dev) -> tuple:
    """Random router logits -> softmax -> top-k, renormalized (Qwen3's norm_topk_prob): (weights fp32, ids int32)."""
    probs = torch.randn(t, e, generator=gen).softmax(-1)
    w, ids = torch.topk(probs, topk, dim=-1)
    return (w / w.sum(-1, keepdim=True)).to(dev), ids.to(torch.int32).to(dev)


def activations(t: int, h: int, gen: torch.Generator, dev, dtype=torch.bfloat16) -> torch.Tensor:
    """Hidden states with uneven channel scales (a few channels 10x larger)."""
    x = torch.randn(t, h, generator=gen) * (0.5 + torch.rand(h, generator=gen))
    x[:, :: max(1, h // 8)] *= 10.0
    return x.to(dtype).to(dev)


# ---- the BF16 and FP8 layers --------------------------------------------------------------
def sort_by_expert(topk_ids: torch.Tensor, e: int) -> tuple:
    """(order of the flat routed rows by expert, int32 group ends [E]) without host syncs (empty groups allowed)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(e, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    return order, torch.cumsum(counts, 0).to(torch.int32)


def combine(y: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor, t: int, topk: int) -> torch.Tensor:
    """sum over each token's top-k rows of w * y (rows in expert order), in fp32, -> bf16 [T, H]."""
    yw = y.float() * topk_weights.reshape(-1)[order].unsqueeze(-1).float()
    out = torch.zeros(t, y.shape[-1], dtype=torch.float32, device=y.device)
    return out.index_add_(0, order // topk, yw).to(torch.bfloat16)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def bf16_layer(x, topk_weights, topk_ids, w: Experts) -> torch.Tensor:
    """MoE layer on torch._grouped_mm (BF16 in, fp32 accumulate, BF16 out)."""
    t, topk = topk_ids.shape
    order, offs = sort_by_expert(topk_ids, w.w13_bf16.shape[0])
    a = x[order // topk]
    gu = torch._grouped_mm(a, w.w13_bf16.transpose(1, 2), offs=offs)
    h = silu_mul(gu).to(torch.bfloat16)
    y = torch._grouped_mm(h, w.w2_bf16.transpose(1, 2), offs=offs)
    return combine(y, order, topk_weights, t, topk)


def scaled_grouped_mm(a8, sa, w8, sw, offs) -> torch.Tensor:
    """torch._scaled_grouped_mm(a8 [M, K], w8 [E, N, K]^T, row-wise scales) -> bf16 [M, N].

    On CPU (no kernel there) the same math per group in fp32, for the smoke run only."""
    if a8.is_cuda:
        return torch._scaled_grouped_mm(a8, w8.transpose(1, 2), sa, sw, offs=offs, out_dtype=torch.bfloat16)
    out = torch.empty(a8.shape[0], w8.shape[1], dtype=torch.bfloat16)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = ((a8[start:end].float() * sa[start:end, None])
                          @ (w8[g].float() * sw[g][:, None]).t()).to(torch.bfloat16)
        start = end
    return out


def fp8_layer(x, topk_weights, topk_ids, w: Experts) -> torch.Tensor:
    """MoE layer on torch._scaled_grouped_mm: activations quantized to e4m3 per row inside the layer."""
    t, topk = topk_ids.shape
    order, offs = sort_by_expert(topk_ids, w.w13_fp8.shape[0])
    x8, sx = fp8_rows(x)  # once per token: every expert of a token reads the same row
    tok = order // topk
    a8 = x8.view(torch.uint8)[tok].view(torch.float8_e4m3fn)
    gu = scaled_grouped_mm(a8, sx[tok], w.w13_fp8, w.w13_fp8_scale, offs)
    h8, sh = fp8_rows(silu_mul(gu))
    y = scaled_grouped_mm(h8, sh, w.w2_fp8, w.w2_fp8_scale, offs)
    return combine(y, order, topk_weights, t, topk)


def loop_layer(x, topk_weights, topk_ids, w13f, w2f, fake_quant: Callable) -> torch.Tensor:
    """Plain per-expert loop in fp32 (the check of the bf16 / fp8 layers); fake_quant: the GEMM input rounding."""
    t, topk = topk_ids.shape
    out = torch.zeros(t, w2f.shape[1], dtype=torch.float32, device=x.device)
    xq = fake_quant(x)
    for e in range(w13f.shape[0]):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = (xq[tok] @ w13f[e].float().t()).to(torch.bfloat16)
        h = fake_quant(silu_mul(gu))
        y = (h @ w2f[e].float().t()).to(torch.bfloat16)
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot, None].float())
    return out.to(torch.bfloat16)


def fp8_fake_quant(v: torch.Tensor) -> torch.Tensor:
    q, s = fp8_rows(v)
    return q.float() * s.unsqueeze(-1)


def bf16_fake_quant(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).float()


# ---- our layer ----------------------------------------------------------------------------
def quads_layer(mode: str, backend: str = "triton", configs: Optional[tuple] = None,
                kernel: str = "v2") -> Callable:
    """(x, topk_weights, topk_ids, experts) -> w4a4_fused_moe in `mode` (no host syncs: check_inputs=False);
    configs: (fc1, fc2) GemmConfigs instead of the defaults (--sweep); kernel: v2 | v3 (the
    weights in fragment order; the torch backend reads the ModelOpt ones)."""
    from quads_megatron.kernels import reference, w4a4_fused_moe

    op = w4a4_fused_moe if backend == "triton" else reference.w4a4_fused_moe
    rac = mode == "w4a4_rac"

    def layer(x, topk_weights, topk_ids, w: Experts):
        extra, w13, w2 = {}, w.w13, w.w2
        if backend == "triton":
            extra = dict(backend="triton", w13_comp_weight=w.w13_cols if rac else None,
                         w2_comp_weight=w.w2_cols if rac else None, configs=configs,
                         weight_layout=LAYOUT[kernel])
            if kernel == "v3":
                w13, w2 = w.w13_frag, w.w2_frag
        return op(x, *w13, *w2, topk_weights, topk_ids, act_mode=mode,
                  w13_comp_index=w.c13 if rac else None, w2_comp_index=w.c2 if rac else None,
                  check_inputs=False, **extra)
    return layer


def without_pdl(layer: Callable) -> Callable:
    """The layer with plain launches (captured so, when timed in a graph)."""
    from quads_megatron.kernels import pdl

    def run(*args):
        with pdl.disabled():
            return layer(*args)
    return run


def variant_name(kernel: str, mode: str) -> str:
    return f"{kernel} {mode}"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check_variants(x, tw, ti, w: Experts, kernels=("v2",)) -> tuple:
    """({variant: {case: (relative error, tolerance)}} of every variant against its reference,
    {mode: per-token agreement stats of the fp32 W4A4 checks})."""
    checks, agreement = {}, {}
    w13f, w2f = w.w13_bf16.float(), w.w2_bf16.float()
    checks["bf16"] = {"loop": (rel_err(bf16_layer(x, tw, ti, w), loop_layer(x, tw, ti, w13f, w2f, bf16_fake_quant)),
                               BASELINE_TOL)}
    w13_8 = w.w13_fp8.float() * w.w13_fp8_scale.unsqueeze(-1)
    w2_8 = w.w2_fp8.float() * w.w2_fp8_scale.unsqueeze(-1)
    checks["fp8"] = {"loop": (rel_err(fp8_layer(x, tw, ti, w), loop_layer(x, tw, ti, w13_8, w2_8, fp8_fake_quant)),
                              FP8_BASELINE_TOL)}
    for kernel, mode in ((k, m) for k in kernels for m in MODES):
        name = variant_name(kernel, mode)
        checks[name] = {}
        for dtype in (torch.bfloat16, torch.float32):
            xd = x.to(dtype)
            ours = quads_layer(mode, kernel=kernel)(xd, tw, ti, w)
            ref = quads_layer(mode, backend="torch")(xd, tw, ti, w)
            if dtype == torch.float32 and mode != "w4a16":  # per token: rare E2M1 code flips of fc2's input
                from quads_megatron.kernels.reference import w4a4_moe_agreement

                ok, stats = w4a4_moe_agreement(ours, ref, TOL[dtype])
                agreement[name] = stats
                checks[name]["float32 per token"] = (stats["median"] if ok else float("inf"), TOL[dtype])
                continue
            checks[name][str(dtype).split(".")[-1]] = (rel_err(ours, ref), TOL[dtype])
    return checks, agreement


# ---- timing: quads_megatron.apps.study.timing (the benchmarks' one timer) -------------------
def layer_ms(fn: Callable, dev: torch.device, iters: int, reps: int) -> float:
    """Median ms per call: CUDA-graph replays of `reps` calls (host launch overhead excluded, as SGLang
    decodes under graphs); CPU: perf_counter per call."""
    from quads_megatron.apps.study.timing import time_ms

    return time_ms(fn, device=dev, iters=iters, warmup=3 if dev.type == "cuda" else 1, mode="graph", reps=reps)


def kernel_profile(fn: Callable, calls: int = 5) -> list:
    """[(kernel name, CUDA us per call)] of `calls` eager calls under torch.profiler, largest first:
    where the layer's time goes (the graph replay removes the host gaps, not the kernels). Launched
    without PDL: under PDL a kernel's time includes its wait for the one before (`kernels.pdl`)."""
    from torch.profiler import ProfilerActivity, profile

    from quads_megatron.kernels import pdl

    with pdl.disabled():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
    per = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name] = per.get(ev.name, 0.0) + ev.device_time / calls
    return sorted(per.items(), key=lambda kv: -kv[1])


def sweep_configs(t: int, e: int, topk: int, kernel: str = "v2") -> list:
    """Candidate (fc1, fc2) GemmConfigs for the layer at t tokens (--sweep), the default first
    (v3: K step 128, N tiles of 64 rows per 4 warps)."""
    from quads_megatron.kernels.gemm import GemmConfig as C

    rows = t * topk / e
    if kernel == "v3":
        mixed = []  # (fc1, fc2) pairs on different tiles
        # 256 weight rows on 8 warps (two warpgroups of 128 sharing one activation tile): half the activation
        # tile reads of the 128-row tiles per weight byte (at 1024 tokens fc1 and fc2 read ~600 MB of fp16
        # activation tiles against 340 MB of weights). Offline (sm_90): 16 tokens at 96 registers no spill,
        # 2 CTAs per SM; 32 at 128 spills 40-64 bytes (2 CTAs), at 168 none (1 CTA); 64 uncapped 211-232 (1 CTA)
        wide = [C(16, 256, 128, 8, 3, 8, True, max_regs=96), C(32, 256, 128, 8, 3, 8, True, max_regs=128),
                C(32, 256, 128, 8, 3, 8, True, max_regs=168), C(64, 256, 128, 8, 3, 8, True)]
        if rows <= 32:
            # the default caps registers at 96 (3 stages, 5 CTAs per SM); uncapped the tile takes 158 (3 CTAs)
            # 32-token tiles: at 256 tokens (16 rows per expert on average) about half the experts have more
            # than 16 rows, so a 16-row tile decodes their weights twice; offline (sm_90) the 32-row tile's
            # step is ~10% more instructions at the same cap, and it spills (72-120 bytes a thread at 96-128
            # registers, none from 168: tools/kernel_sass_report.py)
            cands = [C(16, 128, 128, 4, 3, 8, True, max_regs=96), C(32, 128, 128, 4, 3, 8, True, max_regs=128),
                     C(32, 128, 128, 4, 3, 8, True, max_regs=168)] + wide[:3]
        elif rows <= 128:
            # about half the experts have more rows than the mean (random routing): the next tile up
            # (64 token columns) decodes their weights once instead of twice. Tiles 1.3x or more slower than
            # the default at 64 rows (H100, 2026-12-07) are no longer candidates: 64 / 128 rows x 128 / 64
            # columns without swap-AB, 64 x 64 and 128 x 128 swap-AB, 64 token columns on 8 warps
            t32, t64 = C(32, 128, 128, 4, 3, 8, True, max_regs=168), C(64, 128, 128, 4, 4, 8, True)
            cands = [t32, C(64, 128, 128, 8, 3), C(32, 128, 128, 4, 3, 8, True, max_regs=128),
                     C(64, 128, 128, 4, 3, 8, True), t64] + wide[1:]
            # fc1 (N 1536, K 2048: 16 K-steps) and fc2 (N 2048, K 768: 6) on different tiles: the 32- and 64-token
            # tiles each way, and fc2 on 64 x 256 (the fastest W4A4 tile at 48-64 rows, its RAC step the slowest)
            mixed = [(t32, t64), (t64, t32), (t32, wide[3]), (t64, wide[3])]
        else:
            cands = [C(128, 128, 128, 8, 3), C(128, 128, 128, 8, 4), C(64, 128, 128, 8, 3),
                     C(128, 64, 128, 4, 3), C(64, 64, 128, 4, 4), C(64, 128, 128, 4, 3, 8, True),
                     C(64, 128, 128, 4, 4, 8, True), wide[3]]
        return [None] + [(c, c) for c in cands] + mixed
    if rows <= 32:
        cands = [(C(16, 64, 128, 4, 4, 8, True),) * 2, (C(32, 64, 128, 4, 4, 8, True),) * 2,
                 (C(16, 128, 128, 8, 3, 8, True),) * 2, (C(16, 128, 128, 8, 4, 8, True),) * 2]
    elif rows <= 128:
        cands = [(C(64, 128, 64, 8, 3),) * 2, (C(64, 128, 128, 8, 3),) * 2, (C(64, 128, 128, 8, 4),) * 2,
                 (C(64, 64, 128, 4, 3),) * 2, (C(128, 128, 64, 8, 3),) * 2, (C(32, 128, 128, 8, 3, 8, True),) * 2]
    else:
        cands = [(C(128, 128, 64, 8, 3),) * 2, (C(128, 128, 64, 8, 4),) * 2, (C(128, 128, 128, 8, 3),) * 2,
                 (C(64, 128, 128, 8, 3),) * 2, (C(128, 128, 64, 8, 3), C(128, 128, 32, 8, 4))]
    return [None] + cands


def weight_bytes(args, hit: int, rac: bool) -> int:
    """Bytes of weights the layer reads for `hit` experts: codes + e4m3 scales (+ fp16 RAC columns)."""
    h, f, k = args.hidden_size, args.moe_ffn_hidden_size, args.rac_channels
    per = 2 * f * h * 9 // 16 + h * f * 9 // 16
    if rac:
        per += (2 * f + h) * k * 2
    return hit * per


# ---- report -------------------------------------------------------------------------------
def _ms(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) else "n/a"


def table(rows: list, copy_bw: float, kernels=("v2",)) -> str:
    """Markdown: per T the ms of each variant, then for the last kernel: RAC vs FP8 / BF16 (>1: ours
    faster), RAC over W4A4, weight bandwidth; with two kernels also the last one's RAC speed-up over
    the first's."""
    names = [variant_name(k, m) for k in kernels for m in MODES]
    last = kernels[-1]
    lines = ["| tokens | experts hit | BF16 ms | FP8 ms | " + " | ".join(f"{n} ms" for n in names)
             + f" | {last} RAC vs FP8 | {last} RAC vs BF16 | {last} RAC over W4A4 | "
             f"{last} RAC weight TB/s (% of copy) | "
             + (f"{last} RAC vs {kernels[0]} RAC | " if len(kernels) > 1 else "") + "checks |",
             "|---|---|---|---|" + "---|" * len(names) + "---|---|---|---|"
             + ("---|" if len(kernels) > 1 else "") + "---|"]
    for r in rows:
        ms = r["ms"]
        rac, w4 = ms.get(variant_name(last, "w4a4_rac")), ms.get(variant_name(last, "w4a4"))
        cost = f"{100 * (rac / w4 - 1):+.0f}%" if isinstance(rac, float) and isinstance(w4, float) else "n/a"
        if isinstance(rac, float) and copy_bw == copy_bw:
            tbps = r["rac_weight_bytes"] / (rac * 1e-3)
            bw = f"{tbps / 1e12:.2f} ({100 * tbps / copy_bw:.0f}%)"
        else:
            bw = "n/a"
        bad = [f"{v}/{c}" for v, cs in r["checks"].items() for c, (err, tol) in cs.items() if not err < tol]
        vs = (f"{_ratio(ms.get(variant_name(kernels[0], 'w4a4_rac')), rac)} | "
              if len(kernels) > 1 else "")
        lines.append(f"| {r['tokens']} | {r['experts_hit']} | {_ms(ms.get('bf16'))} | {_ms(ms.get('fp8'))} | "
                     + " | ".join(_ms(ms.get(n)) for n in names)
                     + f" | {_ratio(ms.get('fp8'), rac)} | {_ratio(ms.get('bf16'), rac)} | {cost} | {bw} | "
                     + vs + f"{'FAIL ' + ', '.join(bad) if bad else 'ok'} |")
    return "\n".join(lines)


def run(args) -> dict:
    from quads_megatron.apps.study.timing import copy_bandwidth

    dev = torch.device(args.device)
    gen = torch.Generator().manual_seed(args.seed)
    w = build_experts(args, gen, dev)
    layers = {"bf16": bf16_layer, "fp8": fp8_layer,
              **{variant_name(k, m): quads_layer(m, kernel=k) for k in args.kernels for m in MODES}}
    if args.pdl_ab:
        for m in ("w4a4", "w4a4_rac"):
            layers[variant_name(args.kernels[-1], m) + " no-pdl"] = without_pdl(quads_layer(m, kernel=args.kernels[-1]))
    import triton

    copy_bw = copy_bandwidth(dev)
    meta = dict(date=time.strftime("%Y-%m-%d"), command="python3 tools/bench_moe_layer.py " + " ".join(sys.argv[1:]),
                device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                torch=torch.__version__, triton=triton.__version__, num_experts=args.num_experts,
                hidden_size=args.hidden_size, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                moe_router_topk=args.moe_router_topk, rac_channels=args.rac_channels, iters=args.iters,
                reps=args.reps, graphs=dev.type == "cuda", copy_bytes_per_s=copy_bw, kernels=args.kernels)
    rows = []
    res = dict(meta=meta, rows=rows)
    for t in args.tokens:
        tw, ti = random_routing(t, args.num_experts, args.moe_router_topk, gen, dev)
        x = activations(t, args.hidden_size, gen, dev)
        hit = int(ti.unique().numel())
        checks, agreement = check_variants(x, tw, ti, w, args.kernels)
        ms = {}
        for name, layer in layers.items():
            try:
                ms[name] = layer_ms(lambda: layer(x, tw, ti, w), dev, args.iters, args.reps)
            except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the others still run
                ms[name] = f"ERR {type(exc).__name__}: {str(exc)[:80]}"
        if args.sweep:
            ms["sweep"] = {}
            for cfgs in sweep_configs(t, args.num_experts, args.moe_router_topk, args.sweep_kernel):
                for mode in ("w4a4", "w4a4_rac"):
                    layer = quads_layer(mode, configs=cfgs, kernel=args.sweep_kernel)
                    key = (variant_name(args.sweep_kernel, mode) + " "
                           + ("default" if cfgs is None else " / ".join(str(tuple(c)) for c in cfgs)))
                    try:
                        ms["sweep"][key] = layer_ms(lambda: layer(x, tw, ti, w), dev, args.iters, args.reps)
                    except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported
                        ms["sweep"][key] = f"ERR {type(exc).__name__}: {str(exc)[:80]}"
        if args.profile and dev.type == "cuda":
            ms["profile"] = {name: kernel_profile(lambda: layers[name](x, tw, ti, w))
                             for name in ["fp8"] + [variant_name(k, m) for k in args.kernels
                                                    for m in ("w4a4", "w4a4_rac")]}
        row = dict(tokens=t, experts_hit=hit, ms=ms, checks=checks, agreement=agreement,
                   weight_bytes=weight_bytes(args, hit, False), rac_weight_bytes=weight_bytes(args, hit, True))
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:  # the rows so far: a run cut at its time limit keeps what it measured
            write_json(res, args.json)
    return res


def write_json(res: dict, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import
    from quads_megatron.kernels.gemm import interpreting

    if args.device == "cpu" and not interpreting():
        raise SystemExit("--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1 "
                         "before Triton is imported")
    with torch.no_grad():
        res = run(args)
    bw = res["meta"]["copy_bytes_per_s"]
    how = (f"median of {args.iters} CUDA-graph replays of {args.reps} calls" if res["meta"]["graphs"]
           else f"median of {args.iters} eager calls, Triton interpreter")
    print(f"\n{res['meta']['device']}, {res['meta']['date']}; copy bandwidth (read + write) {bw / 1e12:.2f} TB/s; "
          f"RAC k = {args.rac_channels}; ms per layer ({how})")
    print(table(res["rows"], bw, args.kernels))
    for r in res["rows"]:
        for m in ("w4a4", "w4a4_rac") if args.pdl_ab else ():
            on, off = r["ms"][variant_name(args.kernels[-1], m)], r["ms"][variant_name(args.kernels[-1], m) + " no-pdl"]
            print(f"  T={r['tokens']} {m}: PDL {_ms(on)} ms, plain launches {_ms(off)} ms ({_ratio(off, on)})")
        for key, v in r["ms"].get("sweep", {}).items():
            print(f"  T={r['tokens']} {key}: {_ms(v)} ms")
        for name, kernels in r["ms"].get("profile", {}).items():
            total = sum(us for _, us in kernels)
            print(f"  T={r['tokens']} {name}: {len(kernels)} kernels, {total:.1f} us of kernel time per call")
            for kname, us in kernels[:12]:
                print(f"      {us:8.1f} us  {kname[:110]}")
    if args.json:
        write_json(res, args.json)
    failed = any(not err < tol for r in res["rows"] for cs in r["checks"].values() for err, tol in cs.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
