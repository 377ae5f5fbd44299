"""Benchmark the W4A4(+RAC) NVFP4 GEMMs against torch's FP8 and BF16 grouped GEMMs, all in one run.

Qwen3-30B-A3B MoE shapes (128 experts, hidden 2048, expert FFN 768, top-8), tokens
T in {16, 64, 256, 1024, 4096}: fc1 (N = 1536, K = 2048) and fc2 (N = 2048, K = 768) as grouped
GEMMs over expert-sorted rows (balanced routing), the activation quantization (+RAC) pre-pass,
RAC in its exact form (k extra fp16 K-steps over the stored weight columns, the only RAC path),
the whole fused MoE (tools/bench_moe_layer.py times the layer with random routing),
and one dense linear. Baselines: torch._grouped_mm (BF16) and
torch._scaled_grouped_mm (FP8 e4m3, row-wise scales) called as the H200 baseline anchors do.
Median of CUDA-event timings of CUDA-graph replays (10 calls per graph) after warm-up, so host
launch overhead is excluded (SGLang decodes under CUDA graphs); weights are larger than L2
(dense: rotated copies).

    PYTHONPATH=. python3 tools/bench_w4a4_gemm.py [--sweep] [--json out.json]
    PYTHONPATH=. TRITON_INTERPRET=1 python tools/bench_w4a4_gemm.py --tiny   # CPU smoke run

Timed calls skip the host-syncing input checks (`check_inputs=False`) and run the Triton
kernels (`backend="triton"`: on CPU the interpreter).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from quads_megatron.kernels import w4a4_fused_moe
from quads_megatron.kernels.act_quant import quantize_activation_rac
from quads_megatron.kernels.gemm import GemmConfig, default_config, launch_gemm
from quads_megatron.kernels.rac_columns import rac_weight_columns
from quads_megatron.kernels.routing import moe_align_block_size

SWEEP = {  # spill-free on sm_90 per ptxas (checked offline), plus more warps for decode
    "small": [GemmConfig(16, 64, 128, 4, 4), GemmConfig(16, 32, 256, 4, 4),
              GemmConfig(16, 64, 256, 4, 3), GemmConfig(16, 128, 128, 4, 3),
              GemmConfig(16, 64, 128, 8, 4), GemmConfig(16, 128, 128, 8, 3),
              # swap-AB (C^T = W A^T): the decoded weight tile as wgmma's register A operand
              GemmConfig(16, 64, 128, 4, 4, 8, True), GemmConfig(16, 128, 128, 8, 3, 8, True),
              GemmConfig(16, 64, 256, 4, 3, 8, True)],
    "mid": [GemmConfig(64, 128, 64, 8, 3), GemmConfig(32, 64, 128, 4, 4),
            GemmConfig(64, 64, 64, 4, 4), GemmConfig(32, 128, 64, 8, 3),
            GemmConfig(32, 64, 128, 4, 4, 8, True), GemmConfig(64, 128, 64, 8, 3, 8, True)],
    "large": [GemmConfig(128, 128, 64, 8, 3), GemmConfig(128, 128, 32, 8, 4),
              GemmConfig(64, 128, 64, 8, 3), GemmConfig(128, 64, 64, 8, 3)],
}


def timer(fn, iters: int, warmup: int = 3, reps: int = 10, graph: bool = True) -> float:
    """Median milliseconds per call of fn (the benchmarks' one timer, ``quads_megatron.apps.study.timing``):
    on GPU `reps` calls captured into one CUDA graph (as SGLang serves decode), replays timed with CUDA
    events (graph=False: plain events around each call); on CPU, perf_counter."""
    from quads_megatron.apps.study.timing import time_ms

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return time_ms(fn, device=device, iters=iters, warmup=warmup, reps=reps, mode="graph" if graph else "events")


def rand_packed(e, n, k, dev):
    """Random NVFP4 weight tensors (codes, finite e4m3 scales in [2^-4, 2^4), scale_2)."""
    data = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=dev)
    scale = torch.randint(0x20, 0x60, (e, n, k // 16), dtype=torch.uint8, device=dev)
    return data, scale.view(torch.float8_e4m3fn), torch.rand(e, device=dev) * 1e-3 + 1e-4


def balanced_topk(t, topk, e, dev):
    """Every expert gets t * topk / e rows (distinct experts per token)."""
    ids = (torch.arange(t * topk, device=dev) % e).view(t, topk).to(torch.int32)
    return torch.full((t, topk), 1.0 / topk, device=dev), ids


def copy_bandwidth(dev) -> float:
    """Device-to-device copy, bytes read + written per second."""
    from quads_megatron.apps.study.timing import copy_bandwidth as bandwidth

    return bandwidth(dev)


def baselines(t, topk, e, n, k, dev, iters):
    """(bf16 ms, fp8 ms) of torch's grouped GEMMs, routed rows split evenly (h200_anchors.py)."""
    per = max(16, (t * topk // e + 15) // 16 * 16)
    offs = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * per
    a = torch.randn(per * e, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device=dev, dtype=torch.bfloat16) * 0.02
    out = {}
    try:
        wt = w.transpose(1, 2)
        out["bf16"] = timer(lambda: torch._grouped_mm(a, wt, offs=offs), iters)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        out["bf16"] = f"ERR {str(exc)[:60]}"
    try:
        a8, w8t = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn).transpose(1, 2)
        sa = torch.ones(per * e, device=dev)
        sw = torch.ones(e, n, device=dev)
        out["fp8"] = timer(lambda: torch._scaled_grouped_mm(
            a8, w8t, sa, sw, offs=offs, out_dtype=torch.bfloat16), iters)
    except Exception as exc:  # noqa: BLE001
        out["fp8"] = f"ERR {str(exc)[:60]}"
    return out


def grouped_case(t, gemm, shapes, dev, iters, k_comp, sweep):
    """Time one grouped GEMM (fc1 or fc2) in w4a4 / w4a4_rac with the best of the configs."""
    e, h, f, topk = shapes
    n, k = (2 * f, h) if gemm == "fc1" else (h, f)
    m = t * topk
    w = rand_packed(e, n, k, dev)
    tw, ti = balanced_topk(t, topk, e, dev)
    a_rows = t if gemm == "fc1" else m
    x = torch.randn(a_rows, k, device=dev, dtype=torch.bfloat16)
    comp = torch.sort(torch.randperm(k, device=dev)[:k_comp]).values.to(torch.int32)
    if gemm == "fc2":
        comp = comp.repeat(e, 1)  # per-expert sets (the chosen layout)
    groups = ti.reshape(-1) if gemm == "fc2" else None
    qa = quantize_activation_rac(x, comp, None, groups)
    cols = rac_weight_columns(w[0], w[1], comp)  # built once, as at load time
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    kw = dict(m=m, a_row_div=topk if gemm == "fc1" else 1,
              topk_weights=tw.reshape(-1) if gemm == "fc2" else None)
    default = default_config(m / e, n, k)
    regime = "small" if default.block_m == 16 else ("mid" if default.block_m == 64 else "large")
    configs = SWEEP[regime] if sweep else [default]
    res = {}
    best = None
    for cfg in configs:
        routing = moe_align_block_size(ti, cfg.block_m, e)
        fn = lambda: launch_gemm(qa.values, qa.s_dec, *w, out, routing=routing,  # noqa
                                 r=(qa.r_values, qa.r_s_dec), comp_weight=cols,
                                 config=cfg, **kw)
        try:
            ms = timer(fn, iters)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
            print(f"  config {tuple(cfg)} failed: {str(exc)[:80]}", flush=True)
            continue
        res[str(tuple(cfg))] = ms
        if best is None or ms < best[1]:
            best = (cfg, ms)
    cfg = best[0]
    routing = moe_align_block_size(ti, cfg.block_m, e)
    naive = timer(lambda: launch_gemm(qa.values, qa.s_dec, *w, out, routing=routing,
                                      config=cfg, **kw), iters)
    if gemm == "fc1":
        aq = timer(lambda: quantize_activation_rac(x, comp), iters)
    else:
        inter = torch.randn(m, 2 * k, device=dev, dtype=torch.bfloat16)
        aq = timer(lambda: quantize_activation_rac(inter, comp, None, groups, silu_mul=True),
                   iters)
    return dict(w4a4_ms=naive, rac_ms=best[1], actq_ms=aq,
                config=tuple(cfg), sweep=res, weight_bytes=e * n * k * 0.5625, m=m, n=n, k=k)


def moe_case(t, shapes, dev, iters, k_comp):
    """The whole w4a4_fused_moe (routing, both pre-passes, both GEMMs, top-k sum)."""
    e, h, f, topk = shapes
    w13, w2 = rand_packed(e, 2 * f, h, dev), rand_packed(e, h, f, dev)
    tw, ti = balanced_topk(t, topk, e, dev)
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    c13 = torch.sort(torch.randperm(h, device=dev)[:k_comp]).values.to(torch.int32)
    c2 = torch.sort(torch.randperm(f, device=dev)[:k_comp]).values.to(torch.int32).repeat(e, 1)
    return timer(lambda: w4a4_fused_moe(x, *w13, *w2, tw, ti, act_mode="w4a4_rac",
                                        w13_comp_index=c13, w2_comp_index=c2,
                                        backend="triton", check_inputs=False), iters)


def dense_case(m, n, k, dev, iters, k_comp, copies=16):
    """One linear [m, k] x [n, k]^T: W4A4+RAC (weights rotated past L2) vs bf16 / fp8 matmul."""
    ws = [rand_packed(1, n, k, dev) for _ in range(copies)]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    comp = torch.sort(torch.randperm(k, device=dev)[:k_comp]).values.to(torch.int32)
    qa = quantize_activation_rac(x, comp)
    cols = [rac_weight_columns(w[0], w[1], comp) for w in ws]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    it = iter(range(10 ** 9))

    def ours():
        i = next(it) % copies
        w = ws[i]
        launch_gemm(qa.values, qa.s_dec, w[0], w[1], w[2][:1], out, m=m,
                    r=(qa.r_values, qa.r_s_dec), comp_weight=cols[i])

    res = dict(m=m, n=n, k=k, rac_ms=timer(ours, iters, reps=copies),
               actq_ms=timer(lambda: quantize_activation_rac(x, comp), iters))
    if torch.cuda.is_available():
        wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        res["bf16_ms"] = timer(lambda: x @ wb[next(it) % copies].t(), iters, reps=copies)
        w8 = [w_.to(torch.float8_e4m3fn) for w_ in wb]
        x8 = x.to(torch.float8_e4m3fn)
        sa, sb = torch.ones(m, 1, device=dev), torch.ones(1, n, device=dev)
        try:
            res["fp8_ms"] = timer(lambda: torch._scaled_mm(
                x8, w8[next(it) % copies].t(), sa, sb, out_dtype=torch.bfloat16), iters,
                reps=copies)
        except Exception as exc:  # noqa: BLE001
            res["fp8_ms"] = f"ERR {str(exc)[:60]}"
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="16,64,256,1024,4096")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--comp-channels", type=int, default=64, help="RAC channels k per linear")
    p.add_argument("--sweep", action="store_true", help="try several tile configs per shape")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU interpreter smoke run)")
    p.add_argument("--json", default=None, help="write all numbers here")
    args = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = (4, 64, 32, 2) if args.tiny else (128, 2048, 768, 8)
    tokens = [2, 8] if args.tiny else [int(t) for t in args.tokens.split(",")]
    iters = 3 if args.tiny else args.iters
    k_comp = 16 if args.tiny else args.comp_channels
    meta = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                torch=torch.__version__, date=time.strftime("%Y-%m-%d"), shapes=shapes,
                k_comp=k_comp)
    import triton
    meta["triton"] = triton.__version__
    bw = copy_bandwidth(dev) if dev == "cuda" else float("nan")
    meta["copy_TBps_rw"] = bw / 1e12
    print(json.dumps(meta), flush=True)
    rows = []
    for t in tokens:
        for gemm in ("fc1", "fc2"):
            r = grouped_case(t, gemm, shapes, dev, iters, k_comp, args.sweep)
            e, h, f, topk = shapes
            n, k = (2 * f, h) if gemm == "fc1" else (h, f)
            r.update(baselines(t, topk, e, n, k, dev, iters) if dev == "cuda" else {})
            r.update(T=t, gemm=gemm)
            rows.append(r)
            print(json.dumps({k_: v for k_, v in r.items() if k_ != "sweep"}), flush=True)
        moe = moe_case(t, shapes, dev, iters, k_comp)
        rows.append(dict(T=t, gemm="moe", rac_ms=moe))
        print(json.dumps(rows[-1]), flush=True)
    dense = [dense_case(m, 64 if args.tiny else 4096, 64 if args.tiny else 2048, dev, iters,
                        k_comp) for m in ([4] if args.tiny else [16, 256, 4096])]
    for d in dense:
        print(json.dumps(d), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(meta=meta, rows=rows, dense=dense), fh, indent=1)

    f_ = lambda v: f"{v:.4f}" if isinstance(v, float) else str(v)  # noqa: E731
    print(f"\ncopy bandwidth (read+write) {bw / 1e12:.2f} TB/s; RAC k = {k_comp}")
    print("| T | gemm | bf16 grouped ms | fp8 grouped ms | w4a4 ms | w4a4+RAC ms (+k fp16 steps) |"
          " RAC vs fp8 | RAC vs bf16 | weight TB/s (% copy) | act-quant ms (share) | tile |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    moe_by_t = {r["T"]: r["rac_ms"] for r in rows if r["gemm"] == "moe"}
    for r in rows:
        if r["gemm"] == "moe":
            continue
        fp8, bf16 = r.get("fp8"), r.get("bf16")
        sp8 = f"{fp8 / r['rac_ms']:.2f}x" if isinstance(fp8, float) else "n/a"
        sp16 = f"{bf16 / r['rac_ms']:.2f}x" if isinstance(bf16, float) else "n/a"
        wbw = r["weight_bytes"] / (r["rac_ms"] * 1e-3)
        share = r["actq_ms"] / (r["actq_ms"] + r["rac_ms"])
        print(f"| {r['T']} | {r['gemm']} | {f_(bf16)} | {f_(fp8)} | {r['w4a4_ms']:.4f} | "
              f"{r['rac_ms']:.4f} | {sp8} | {sp16} | {wbw / 1e12:.2f} ({100 * wbw / bw:.0f}%) | "
              f"{r['actq_ms']:.4f} ({100 * share:.0f}%) | {r['config']} |")
    print("\n| T | fused MoE w4a4+RAC ms (routing + 2 pre-passes + fc1 + fc2 + sum) |")
    print("|---|---|")
    for t, ms in moe_by_t.items():
        print(f"| {t} | {ms:.4f} |")
    print("\n| dense M x N x K | bf16 ms | fp8 ms | w4a4+RAC ms | act-quant ms |")
    print("|---|---|---|---|---|")
    for d in dense:
        print(f"| {d['m']}x{d['n']}x{d['k']} | {f_(d.get('bf16_ms'))} | {f_(d.get('fp8_ms'))} | "
              f"{d['rac_ms']:.4f} | {d['actq_ms']:.4f} |")


if __name__ == "__main__":
    main()
