"""Time the dense NVFP4 linear (`w4a4_linear`: activation pre-pass + GEMM) against cuBLAS BF16.

Issue 13's dense goal: attention / shared projections at decode sizes (M = 16-256) not slower than
a BF16 matmul. Shapes of Qwen3-30B-A3B's attention (q/k/v fused 2048 -> 5120, o 4096 -> 2048).
Each call is captured in a CUDA graph (16 calls per graph over 16 weight copies, so weights come
from HBM, not L2), median of the replays; our ops skip the host-syncing checks.

    PYTHONPATH=. python3 tools/bench_w4a4_linear.py [--m 1 16 32 64 256] [--json out.json] [--sweep]

Per size: cuBLAS BF16, the op on ModelOpt-order codes (w4a16 / w4a4 / w4a4_rac) and w4a4_rac on the
v3 kernel layout (`fragment_layout`, where N % 64 == 0 and K % 128 == 0).
--sweep also times the parts (pre-pass alone; the GEMM alone, w4a16 and w4a4_rac on a
pre-quantized activation) under several tile / split-K configs, the default first; the summary
names the fastest, to set `dense_config`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

COPIES = 16


def sweep_configs(m: int) -> list:
    """Candidate dense GemmConfigs at m rows (--sweep), None (the default) first."""
    from quads_megatron.kernels.gemm import GemmConfig as C

    if m <= 16:
        tiles = [C(16, 64, 128, 4, 4, 8, True), C(16, 128, 128, 8, 3, 8, True)]
    elif m <= 64:
        tiles = [C(64, 128, 128, 8, 3), C(64, 64, 128, 4, 3), C(32, 64, 128, 4, 4, 8, True)]
    else:
        tiles = [C(128, 128, 64, 8, 3), C(128, 128, 128, 8, 3), C(64, 128, 128, 8, 3), C(128, 64, 128, 4, 3)]
    return [None] + [t._replace(split_k=s) for t in tiles for s in (1, 2, 4, 8)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 32, 64, 256])
    p.add_argument("--shapes", default="5120x2048,2048x4096", help="N x K of each linear")
    p.add_argument("--rac-channels", type=int, default=64)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", default=None)
    p.add_argument("--sweep", action="store_true", help="also time the pre-pass and the GEMM alone per config")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_w4a4_linear times CUDA graphs: it needs a GPU")
    from quads_megatron.nvfp4 import quantize
    from quads_megatron.apps.study.timing import time_ms
    from quads_megatron.kernels import w4a4_linear
    from quads_megatron.kernels.act_quant import quantize_activation_rac
    from quads_megatron.kernels.fragment_layout import to_fragment_order, to_fragment_scale_order
    from quads_megatron.kernels.gemm import launch_gemm
    from quads_megatron.kernels.rac_columns import rac_weight_columns

    dev = torch.device("cuda")
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        q = [(t.data, t.scale, t.global_scale.reshape(()).float()) for t in (quantize(w.float()) for w in wb)]
        comp = torch.sort(torch.randperm(k, device=dev)[:args.rac_channels]).values.to(torch.int32)
        cols = [rac_weight_columns(d, s, comp) for d, s, _ in q]
        qf = ([(to_fragment_order(d), to_fragment_scale_order(s)) for d, s, _ in q]
              if n % 64 == 0 and k % 128 == 0 else None)
        for m in args.m:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            it = iter(range(10 ** 9))
            ms = {"bf16": time_ms(lambda: x @ wb[next(it) % COPIES].t(), device="cuda", iters=args.iters, mode="graph", reps=COPIES)}
            for mode in ("w4a16", "w4a4", "w4a4_rac"):
                extra = dict(comp_index=comp) if mode == "w4a4_rac" else {}

                def ours(mode=mode, extra=extra):
                    i = next(it) % COPIES
                    d, s, s2 = q[i]
                    cw = dict(comp_weight=cols[i]) if extra else {}
                    return w4a4_linear(x, d, s, s2, act_mode=mode, backend="triton", check_inputs=False, **extra, **cw)

                ms[mode] = time_ms(ours, device="cuda", iters=args.iters, mode="graph", reps=COPIES)
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            if qf is not None:  # the v3 kernel layout: w4a4_rac on fragment-order codes and scales
                def rac_v3():
                    i = next(it) % COPIES
                    return w4a4_linear(x, *qf[i], q[i][2], act_mode="w4a4_rac", comp_index=comp, comp_weight=cols[i],
                                       backend="triton", check_inputs=False, weight_layout="fragment")

                ms["w4a4_rac v3"] = time_ms(rac_v3, device="cuda", iters=args.iters, mode="graph", reps=COPIES)
            if args.sweep:
                ms["act_quant_rac"] = time_ms(lambda: quantize_activation_rac(x, comp), device="cuda",
                                              iters=args.iters, mode="graph", reps=COPIES)
                qa = quantize_activation_rac(x, comp)
                for cfg in sweep_configs(m):
                    def gemm(w4a16, cfg=cfg):
                        i = next(it) % COPIES
                        d, s, s2 = q[i]
                        w = (d[None], s[None], s2.reshape(1))
                        if w4a16:
                            return launch_gemm(x, None, *w, out, m=m, w4a16=True, config=cfg)
                        return launch_gemm(qa.values, qa.s_dec, *w, out, m=m, r=(qa.r_values, qa.r_s_dec),
                                           comp_weight=cols[i][None], config=cfg)
                    key = "default" if cfg is None else ",".join(str(int(v)) for v in cfg)
                    for name, flag in (("gemm_w4a16", True), ("gemm_rac", False)):
                        try:
                            ms[f"{name} {key}"] = time_ms(lambda: gemm(flag), device="cuda", iters=args.iters, mode="graph", reps=COPIES)
                        except Exception as exc:  # a config that does not compile here: report it
                            ms[f"{name} {key}"] = f"ERR {type(exc).__name__}: {str(exc)[:60]}"
            rows.append(dict(n=n, k=k, m=m, ms=ms))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}; ms per call (CUDA graphs, weights from HBM)")
    print("| M x N x K | BF16 (cuBLAS) | w4a16 | w4a4 | w4a4_rac | RAC vs BF16 | w4a4_rac v3 | RAC v3 vs BF16 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms = r["ms"]
        v3 = (f"{ms['w4a4_rac v3']:.4f} | {ms['bf16'] / ms['w4a4_rac v3']:.2f}x |" if "w4a4_rac v3" in ms
              else "- | - |")
        print(f"| {r['m']}x{r['n']}x{r['k']} | {ms['bf16']:.4f} | {ms['w4a16']:.4f} | {ms['w4a4']:.4f} | "
              f"{ms['w4a4_rac']:.4f} | {ms['bf16'] / ms['w4a4_rac']:.2f}x | " + v3)
    for r in rows:
        parts = {key: v for key, v in r["ms"].items() if key.startswith(("gemm", "act"))}
        if parts:
            best = {name: min((v, key) for key, v in parts.items() if key.startswith(name + " ") and isinstance(v, float))
                    for name in ("gemm_w4a16", "gemm_rac")}
            print(f"  {r['m']}x{r['n']}x{r['k']}: act_quant_rac {parts['act_quant_rac']:.4f}; "
                  + "; ".join(f"{name} default {parts[name + ' default']:.4f}, best {v:.4f} ({key.split(' ', 1)[1]})"
                              for name, (v, key) in best.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
