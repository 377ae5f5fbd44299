"""Forward overhead of AQAT NVFP4 expert-weight fake quant vs BF16 on a Qwen3-30B-A3B-shaped MoE layer.

  python tools/bench_aqat_overhead.py                       # CUDA, 128 experts, H 2048, F 768, top-8
  python tools/bench_aqat_overhead.py --device cpu --tiny   # smoke run

Plain torch (no megatron-core needed): fp32 router, top-k softmax renormalised, tokens
permuted by expert (each expert's rows padded to 16), ``torch._grouped_mm`` for fc1 ([gate; up])
and fc2, SwiGLU, weighted un-permute.  The weights go through the trainer's own
``quads_megatron.megatron.fake_quant.WeightFakeQuant`` (per-expert global scale, straight-through
autograd), so this times the code path training uses.  Rows:
  bf16            master weights as they are;
  aqat uncached   weights fake-quantized inside every forward (no per-step cache);
  aqat cached     the per-optimizer-step cache is warm (what every micro-batch after the
                  first one costs); ``refresh`` is the once-per-step re-quantization;
  aqat amortised  (M cached micro-batch forwards + 1 refresh) / (M bf16 forwards), M = 1 and --micro-batches;
  w4a4 naive      the nvfp4 activation mode: expert inputs fake-quantized per token too.
CUDA-event timings, median of --iters after warm-up, milliseconds.
"""

import argparse
import json

import torch
import torch.nn.functional as F

from quads_megatron.megatron.fake_quant import WeightFakeQuant, fake_quantize_activation


def grouped_mm(a, w, offs):
    """a [M, K] @ per-expert w[e] [N, K]^T with expert e owning rows offs[e-1]:offs[e]."""
    return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)


class MoELayer:
    """Qwen3-MoE expert block: router, top-k, permute, grouped SwiGLU experts, weighted combine."""

    def __init__(self, experts, hidden, ffn, topk, device, dtype=torch.bfloat16):
        g = torch.Generator(device="cpu").manual_seed(0)
        init = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(device=device, dtype=dtype)
        self.E, self.H, self.F, self.topk = experts, hidden, ffn, topk
        self.router = init(experts, hidden).float()
        self.w13 = init(experts, 2 * ffn, hidden).requires_grad_()   # [gate; up] per expert
        self.w2 = init(experts, hidden, ffn).requires_grad_()

    def route(self, x):
        logits = x.float() @ self.router.t()
        probs, ids = torch.topk(torch.softmax(logits, dim=-1), self.topk, dim=-1)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.E)
        padded = (counts + 15) // 16 * 16
        starts = torch.cumsum(padded, 0) - padded
        rank_in_expert = torch.arange(flat.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
        dest = starts[flat[order]] + rank_in_expert                  # padded row of each routed copy
        rows = int(padded.sum())
        src_token = torch.full((rows,), x.shape[0], dtype=torch.long, device=x.device)
        src_token[dest] = order // self.topk
        weight = torch.zeros(rows, dtype=torch.float32, device=x.device)
        weight[dest] = probs.flatten()[order]
        offs = torch.cumsum(padded, 0).to(torch.int32)
        return src_token, weight, offs

    def forward(self, x, routing, w13, w2, act_quant=False):
        src_token, weight, offs = routing
        xp = torch.cat([x, x.new_zeros(1, x.shape[1])])[src_token]   # pad rows read a zero row
        if act_quant:
            xp = fake_quantize_activation(xp, "per_token")
        h = grouped_mm(xp, w13, offs)
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
        if act_quant:
            h = fake_quantize_activation(h, "per_token")
        y = grouped_mm(h, w2, offs) * weight.unsqueeze(-1).to(h.dtype)
        out = x.new_zeros(x.shape[0] + 1, x.shape[1]).index_add_(0, src_token, y)
        return out[:-1]


def timer(device):
    """``run(fn, iters, warmup)`` -> median ms per call: the benchmarks' one timer (CUDA events per call, a
    backward pass cannot be graph-captured; perf_counter on CPU)."""
    from quads_megatron.apps.study.timing import time_ms

    return lambda fn, iters, warmup: time_ms(fn, device=device, iters=iters, warmup=warmup, mode="events")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="8 experts, hidden 128, ffn 64, top-2")
    p.add_argument("--num-experts", type=int, default=128)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--moe-ffn-hidden-size", type=int, default=768)
    p.add_argument("--moe-router-topk", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384],
                   help="tokens per micro-batch")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per optimizer step")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default="", help="also write the rows here")
    args = p.parse_args()
    if args.tiny:
        args.num_experts, args.hidden_size, args.moe_ffn_hidden_size, args.moe_router_topk = 8, 128, 64, 2
        args.tokens = [t for t in args.tokens if t <= 1024] or [256]
        args.iters, args.warmup = min(args.iters, 5), 1
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available (use --device cpu --tiny)")
    layer = MoELayer(args.num_experts, args.hidden_size, args.moe_ffn_hidden_size,
                     args.moe_router_topk, device)
    run = timer(device)
    q13 = WeightFakeQuant("w13", layer.w13, cache=True)
    q2 = WeightFakeQuant("w2", layer.w2, cache=True)
    u13 = WeightFakeQuant("w13", layer.w13, cache=False)
    u2 = WeightFakeQuant("w2", layer.w2, cache=False)
    refresh = lambda: (q13.compute(layer.w13), q2.compute(layer.w2))
    ms_refresh = run(refresh, args.iters, args.warmup)
    name = (f"{args.num_experts} experts, hidden {args.hidden_size}, ffn {args.moe_ffn_hidden_size}, "
            f"top-{args.moe_router_topk}, {device}" + (f" ({torch.cuda.get_device_name()})"
                                                       if device.type == "cuda" else ""))
    print(f"AQAT forward overhead: {name}; refresh (re-quantize all experts once per step) "
          f"{ms_refresh:.3f} ms")
    print(f"| tokens | bf16 ms | aqat uncached ms | aqat cached ms | aqat amortised M=1 | "
          f"aqat amortised M={args.micro_batches} | w4a4 naive ms |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for T in args.tokens:
        x = (torch.randn(T, args.hidden_size, generator=torch.Generator().manual_seed(T)) * 1.0).to(
            device=device, dtype=torch.bfloat16)
        routing = layer.route(x)
        check = layer.forward(x, routing, layer.w13, layer.w2)
        if not torch.isfinite(check).all():
            raise RuntimeError("non-finite MoE output")
        bf16 = run(lambda: layer.forward(x, routing, layer.w13, layer.w2), args.iters, args.warmup)
        unc = run(lambda: layer.forward(x, routing, u13(layer.w13), u2(layer.w2)), args.iters, args.warmup)
        cached = run(lambda: layer.forward(x, routing, q13(layer.w13), q2(layer.w2)), args.iters, args.warmup)
        naive = run(lambda: layer.forward(x, routing, q13(layer.w13), q2(layer.w2), act_quant=True),
                    args.iters, args.warmup)
        m = args.micro_batches
        amortised = lambda k: (k * cached + ms_refresh) / (k * bf16) - 1
        amort = amortised(m) + 1
        pct = lambda v: f"{v:.3f} ({(v / bf16 - 1) * 100:+.1f}%)"
        print(f"| {T} | {bf16:.3f} | {pct(unc)} | {pct(cached)} | {amortised(1) * 100:+.1f}% | "
              f"{amortised(m) * 100:+.1f}% | {pct(naive)} |")
        rows.append(dict(tokens=T, bf16_ms=bf16, aqat_uncached_ms=unc, aqat_cached_ms=cached,
                         refresh_ms=ms_refresh, micro_batches=m, amortised_overhead=amort - 1,
                         w4a4_naive_ms=naive))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(layer=name, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
