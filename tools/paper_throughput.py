"""Decode throughput of the local rollout engine per precision, next to one MoE layer's time at the same tokens.

Batched sampling with a KV cache (stops disabled, so every row decodes --max-new-tokens tokens);
tokens/s = batch x new tokens / wall time, median of --repeats after a warm-up call. The MoE layer
column times layer 0's experts module of the same engine on --batch-size tokens (decode) and on
--prefill-tokens tokens, random routing, CUDA-graph replay where the module allows it.

    python tools/paper_throughput.py --hf-checkpoint runs/moe-240m-hf --batch-size 64 --max-new-tokens 128
"""

from __future__ import annotations

import sys
import tempfile


from quads_megatron.errors import run_cli

PRECISIONS = ["bf16", "w4a16", "w4a4", "w4a4_rac"]


def main(argv=None) -> dict:
    from quads_megatron.rl.engines.base import SamplingParams
    from quads_megatron.apps.study import cli, plots
    from quads_megatron.apps.study.mismatch import build_setup, make_engine, release, rollout_recipe
    from quads_megatron.apps.study.timing import time_experts, time_ms

    p = cli.common_parser(__doc__.splitlines()[0], "throughput")
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    precisions = args.precisions.split(",")
    results = []
    with tempfile.TemporaryDirectory() as tb:
        setup = build_setup(cli.job_flags(args, "w4a16", "bf16", tb))
        d = setup.policy.plan.dims
        prompts = setup.prompts(args.batch_size)
        calib = setup.prompts(16, seed=-1)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=[])
        for prec in precisions:
            eng = make_engine(setup, rollout_recipe(setup, prec, args.rac_channels), calib)
            eng.generate(prompts, sampling, seed=0)  # warm-up: kernels compiled, graphs captured
            seeds, last = iter(range(1, args.repeats + 1)), {}

            def generate():
                last["outs"] = eng.generate(prompts, sampling, seed=next(seeds))

            sec = time_ms(generate, device=eng.device, iters=args.repeats, warmup=0, mode="wall") / 1e3
            n_tok = sum(len(o.response_ids) for o in last["outs"])
            experts = eng.model.model.layers[0].mlp.experts
            top_k = eng.model.config.num_experts_per_tok
            dec = time_experts(experts, args.batch_size, d.hidden_size, d.num_experts, top_k, eng.dtype, eng.device)
            pre = time_experts(experts, args.prefill_tokens, d.hidden_size, d.num_experts, top_k, eng.dtype, eng.device)
            row = {"precision": prec, "rac_channels": eng.plan.rac_channels, "decode_tokens_per_s": n_tok / sec,
                   "generate_s": sec, "tokens": n_tok,
                   "moe_layer_ms_decode": dec["ms"], "moe_layer_ms_prefill": pre["ms"],
                   "moe_layer_cuda_graph": dec["cuda_graph"]}
            results.append(row)
            print(f"{prec:9s} decode {row['decode_tokens_per_s']:9.1f} tok/s  MoE layer {dec['ms']:.3f} ms "
                  f"({args.batch_size} tok) {pre['ms']:.3f} ms ({args.prefill_tokens} tok)", flush=True)
            release(eng)
        setup.trainer.close()
    out = {"tool": "paper_throughput", "env": cli.environment(), "argv": sys.argv[1:] if argv is None else argv,
           "config": {k: v for k, v in vars(args).items() if k not in ("out_json", "out_png")}, "results": results}
    cli.write_json(args.out_json, out)
    fig, (a1, a2) = plots.figure(2, title=f"Local engine throughput by precision ({cli.environment()['device']})")
    names = [r["precision"] for r in results]
    plots.grouped_bars(a1, names, {f"batch {args.batch_size}": [r["decode_tokens_per_s"] for r in results]},
                       "decode tokens / s")
    plots.grouped_bars(a2, names, {f"{args.batch_size} tokens": [r["moe_layer_ms_decode"] for r in results],
                                   f"{args.prefill_tokens} tokens": [r["moe_layer_ms_prefill"] for r in results]},
                       "one MoE layer, ms")
    plots.save(fig, args.out_png)
    print(f"wrote {args.out_json} and {args.out_png}")
    return out


if __name__ == "__main__":
    raise SystemExit(run_cli(main, prog="paper_throughput"))
