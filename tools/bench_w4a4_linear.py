"""Time the dense NVFP4 linear (`w4a4_linear`: fused launch, or activation pre-pass + GEMM) against cuBLAS BF16.

Issue 13's dense goal: attention / shared projections at decode sizes (M = 16-256) not slower than
a BF16 matmul. Shapes of Qwen3-30B-A3B's attention (q/k/v fused 2048 -> 5120, o 4096 -> 2048).
Each call is captured in a CUDA graph (16 calls per graph over 16 weight copies, so weights come
from HBM, not L2), median of the replays; our ops skip the host-syncing checks.

    PYTHONPATH=. python3 tools/bench_w4a4_linear.py [--m 1 16 32 64 256] [--json out.json] [--sweep]

Per size: cuBLAS BF16, the op as dispatched (w4a16 / w4a4 / w4a4_rac), and both W4A4 forms timed
explicitly with their default configs: "two" = act_quant pre-pass + GEMM (+ split-K sum launch),
"fused" = `linear_fused` (one launch); "same" says whether the two forms gave the same bits
under the fused default config.
--sweep also times the parts (pre-pass alone; the GEMM alone, w4a16 and w4a4_rac on a
pre-quantized activation) and the fused RAC launch under several tile / split-K / amax-step
configs, the default first; the summary names the fastest of each, to set `FUSED_MAX_M`,
`dense_config` and `fused_config`.
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


def fused_sweep_configs(m: int) -> list:
    """(GemmConfig or None, amax_k or None) for the fused launch at m rows (--sweep), defaults first."""
    from quads_megatron.kernels.gemm import GemmConfig as C

    if m <= 16:
        tiles = [C(16, 64, 128, 4, 4, 8, True), C(16, 128, 128, 8, 3, 8, True), C(16, 64, 128, 4, 3, 8, False)]
    elif m <= 32:
        tiles = [C(32, 64, 128, 4, 4, 8, True), C(16, 64, 128, 4, 4, 8, True), C(64, 64, 128, 8, 3)]
    elif m <= 64:
        tiles = [C(64, 64, 128, 8, 3), C(64, 128, 128, 8, 3), C(32, 64, 128, 4, 4, 8, True),
                 C(16, 64, 128, 4, 4, 8, True)]
    else:
        tiles = [C(64, 64, 128, 8, 3), C(64, 128, 128, 8, 3)]
    out = [(None, None), (None, 256)]
    return out + [(t._replace(split_k=s), None) for t in tiles for s in (1, 2, 4, 8)]


def fused_frag_sweep_configs(m: int) -> list:
    """GemmConfigs of the fused launch on fragment-order codes at m rows (--sweep)."""
    from quads_megatron.kernels.gemm import GemmConfig as C

    bm = 16 if m <= 16 else 32
    tiles = [C(bm, 128, 128, 8, 3, 8, True), C(bm, 64, 128, 4, 4, 8, True)]
    return [t._replace(split_k=s) for t in tiles for s in (1, 2, 4, 8)]


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
    from quads_megatron.kernels.fragment_layout import to_fragment_order
    from quads_megatron.kernels.gemm import launch_gemm
    from quads_megatron.kernels.linear_fused import FUSED_MAX_M, fused_config, w4a4_linear_fused
    from quads_megatron.kernels.rac_columns import rac_weight_columns

    dev = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        q = [(t.data, t.scale, t.global_scale.reshape(()).float()) for t in (quantize(w.float()) for w in wb)]
        comp = torch.sort(torch.randperm(k, device=dev)[:args.rac_channels]).values.to(torch.int32)
        cols = [rac_weight_columns(d, s, comp) for d, s, _ in q]
        qf = [to_fragment_order(d) for d, _, _ in q] if n % 64 == 0 and k % 128 == 0 else None
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

            def two(rac, config=None):
                i = next(it) % COPIES
                d, s, s2 = q[i]
                qa = quantize_activation_rac(x, comp if rac else None)
                r = (qa.r_values, qa.r_s_dec) if rac else None
                return launch_gemm(qa.values, qa.s_dec, d[None], s[None], s2.reshape(1), out, m=m, r=r,
                                   comp_weight=cols[i][None] if rac else None, config=config)

            def fused(rac, config=None, amax_k=None):
                i = next(it) % COPIES
                d, s, s2 = q[i]
                return w4a4_linear_fused(x, d, s, s2, out, comp_index=comp if rac else None,
                                         comp_weight=cols[i] if rac else None, config=config, amax_k=amax_k)

            same = True
            for rac in (False, True):
                tag = "rac" if rac else "w4a4"
                ms[f"two {tag}"] = time_ms(lambda: two(rac), device="cuda", iters=args.iters, mode="graph", reps=COPIES)
                ms[f"fused {tag}"] = time_ms(lambda: fused(rac), device="cuda", iters=args.iters, mode="graph", reps=COPIES)
                it = iter(range(10 ** 9))  # both on weight copy 0, both under the fused config: same bits
                a = two(rac, fused_config(m, n, k, num_sms)).clone()
                it = iter(range(10 ** 9))
                same = same and torch.equal(fused(rac), a)
            ms["same"] = same
            if n % 64 == 0 and k % 128 == 0:  # the v3 fragment-order codes (`fragment_layout`)
                def two_frag():
                    i = next(it) % COPIES
                    qa = quantize_activation_rac(x, comp, fragment_order=True)
                    return launch_gemm(qa.values, qa.s_dec, qf[i][None], q[i][1][None], q[i][2].reshape(1), out,
                                       m=m, r=(qa.r_values, qa.r_s_dec), comp_weight=cols[i][None],
                                       fragment_layout=True, config=frag_cfg)

                def fused_frag(config=None):
                    i = next(it) % COPIES
                    return w4a4_linear_fused(x, qf[i], q[i][1], q[i][2], out, comp_index=comp, comp_weight=cols[i],
                                             config=config, fragment_layout=True)

                frag_cfg = None
                ms["two rac v3"] = time_ms(two_frag, device="cuda", iters=args.iters, mode="graph", reps=COPIES)
                ms["fused rac v3"] = time_ms(fused_frag, device="cuda", iters=args.iters, mode="graph", reps=COPIES)
                frag_cfg = fused_config(m, n, k, num_sms, fragment_layout=True)
                it = iter(range(10 ** 9))
                a = two_frag().clone()
                it = iter(range(10 ** 9))
                ms["same v3"] = torch.equal(fused_frag(), a)
                if args.sweep:
                    for cfg in fused_frag_sweep_configs(m):
                        key = ",".join(str(int(v)) for v in cfg)
                        try:
                            ms[f"fused_rac_v3 {key}"] = time_ms(lambda: fused_frag(cfg), device="cuda",
                                                                iters=args.iters, mode="graph", reps=COPIES)
                        except Exception as exc:
                            ms[f"fused_rac_v3 {key}"] = f"ERR {type(exc).__name__}: {str(exc)[:60]}"
            if args.sweep:
                ms["act_quant_rac"] = time_ms(lambda: quantize_activation_rac(x, comp), device="cuda",
                                              iters=args.iters, mode="graph", reps=COPIES)
                for cfg, amax_k in fused_sweep_configs(m):
                    key = ("default" if cfg is None else ",".join(str(int(v)) for v in cfg)) + f" amax{amax_k or ''}"
                    try:
                        ms[f"fused_rac {key}"] = time_ms(lambda: fused(True, cfg, amax_k), device="cuda",
                                                         iters=args.iters, mode="graph", reps=COPIES)
                    except Exception as exc:  # a config that does not compile here: report it
                        ms[f"fused_rac {key}"] = f"ERR {type(exc).__name__}: {str(exc)[:60]}"
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
    print(f"\n{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}; ms per call (CUDA graphs, weights from HBM); "
          f"the op runs fused at M <= {FUSED_MAX_M}")
    print("| M x N x K | BF16 (cuBLAS) | w4a16 | w4a4 two | w4a4 fused | RAC two | RAC fused | RAC op | RAC op vs BF16 "
          "| fused RAC vs BF16 | same bits | RAC two v3 | RAC fused v3 | fused v3 vs BF16 | same bits v3 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms = r["ms"]
        print(f"| {r['m']}x{r['n']}x{r['k']} | {ms['bf16']:.4f} | {ms['w4a16']:.4f} | {ms['two w4a4']:.4f} | "
              f"{ms['fused w4a4']:.4f} | {ms['two rac']:.4f} | {ms['fused rac']:.4f} | {ms['w4a4_rac']:.4f} | "
              f"{ms['bf16'] / ms['w4a4_rac']:.2f}x | {ms['bf16'] / ms['fused rac']:.2f}x | {ms['same']} | "
              + (f"{ms['two rac v3']:.4f} | {ms['fused rac v3']:.4f} | {ms['bf16'] / ms['fused rac v3']:.2f}x | "
                 f"{ms['same v3']} |" if "fused rac v3" in ms else "- | - | - | - |"))
    for r in rows:
        parts = {key: v for key, v in r["ms"].items() if key.startswith(("gemm", "act", "fused_rac"))}
        if parts:
            best = {name: min((v, key) for key, v in parts.items() if key.startswith(name + " ") and isinstance(v, float))
                    for name in ("gemm_w4a16", "gemm_rac", "fused_rac")}
            v3 = [(v, key) for key, v in parts.items() if key.startswith("fused_rac_v3 ") and isinstance(v, float)]
            if v3:
                v, key = min(v3)
                print(f"  {r['m']}x{r['n']}x{r['k']}: fused_rac_v3 best {v:.4f} ({key.split(' ', 1)[1]})")
            print(f"  {r['m']}x{r['n']}x{r['k']}: act_quant_rac {parts['act_quant_rac']:.4f}; "
                  + "; ".join(f"{name} default {parts[name + (' default amax' if name == 'fused_rac' else ' default')]:.4f}, "
                              f"best {v:.4f} ({key.split(' ', 1)[1]})" for name, (v, key) in best.items()))
    faster = [r["m"] for r in rows if r["ms"]["fused rac"] < r["ms"]["two rac"]]
    print(f"fused RAC faster than two-launch at M in {sorted(set(faster))} (per shape: "
          + ", ".join(f"{r['m']}x{r['n']}x{r['k']} {r['ms']['two rac'] / r['ms']['fused rac']:.2f}x" for r in rows) + ")")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
