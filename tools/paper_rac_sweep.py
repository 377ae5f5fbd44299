"""RAC cost/benefit: the rollout-trainer gap and the MoE layer time as the compensation channels k grow.

AQAT trainer (QUADS); for each k in --ks the rollout runs w4a4_rac with calibrated channels and with
random channels of the same k (k = 0 is plain W4A4). The MoE layer time is one layer's experts
module of that engine on --layer-tokens tokens with random routing (CUDA-graph replay on a GPU).

    python tools/paper_rac_sweep.py --hf-checkpoint runs/moe-240m-hf --ks 0,16,32,64,128,256
"""

from __future__ import annotations

import sys
import tempfile

from quads_megatron.errors import ConfigError, run_cli


def main(argv=None) -> dict:
    from quads_megatron.rl.engines.base import SamplingParams
    from quads_megatron.apps.study import cli, plots
    from quads_megatron.apps.study.mismatch import build_setup, make_engine, release, rollout_gap, rollout_recipe
    from quads_megatron.apps.study.rac_sweep import randomize_channels
    from quads_megatron.apps.study.timing import time_experts

    p = cli.common_parser(__doc__.splitlines()[0], "rac_sweep")
    p.add_argument("--ks", default="0,16,32,64,128,256")
    p.add_argument("--layer-tokens", type=int, default=256, help="tokens of the timed MoE layer call")
    p.add_argument("--trainer", default="w4a16", help="w4a16 (AQAT, the QUADS trainer) or bf16")
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tb:
        setup = build_setup(cli.job_flags(args, args.trainer, "bf16", tb))
        d = setup.policy.plan.dims
        kmax = min(d.hidden_size, d.moe_ffn)
        ks = [int(k) for k in args.ks.split(",")]
        skipped = [k for k in ks if k > kmax]
        ks = [k for k in ks if k <= kmax]
        if not ks:
            raise ConfigError(f"--ks {args.ks}: every k exceeds this model's smallest GEMM K ({kmax})")
        prompts = [q for q in setup.prompts(args.num_prompts) for _ in range(args.n_samples_per_prompt)]
        calib = setup.prompts(16, seed=-1)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=[setup.trainer.eos])
        for k in ks:
            for channels in (["calibrated", "random"] if k else ["none"]):
                recipe = rollout_recipe(setup, "w4a4_rac" if k else "w4a4", k)
                eng = make_engine(setup, recipe, calib)
                if channels == "random":
                    randomize_channels(eng, seed=args.seed)
                stats, _ = rollout_gap(setup, eng, prompts, sampling, seed=args.seed)
                experts = eng.model.model.layers[0].mlp.experts
                t = time_experts(experts, args.layer_tokens, d.hidden_size, d.num_experts,
                                 eng.model.config.num_experts_per_tok, eng.dtype, eng.device)
                results.append({"k": k, "channels": channels, **stats, "moe_layer_ms": t["ms"],
                                "cuda_graph": t["cuda_graph"]})
                print(f"k {k:3d} {channels:10s} mean|dlogp| {stats['mean_abs']:.5f} k3 {stats['k3_kl']:.2e} "
                      f"layer {t['ms']:.3f} ms", flush=True)
                release(eng)
        setup.trainer.close()
    out = {"tool": "paper_rac_sweep", "env": cli.environment(), "argv": sys.argv[1:] if argv is None else argv,
           "config": {k: v for k, v in vars(args).items() if k not in ("out_json", "out_png")},
           "skipped_ks": skipped, "results": results}
    cli.write_json(args.out_json, out)
    fig, (a1, a2) = plots.figure(2, title=f"RAC: gap and MoE layer time vs compensation channels k "
                                          f"({'AQAT' if args.trainer == 'w4a16' else 'BF16'} trainer)")
    base = [r for r in results if r["k"] == 0]
    for ch, style in (("calibrated", "o-"), ("random", "s--")):
        rows = base + [r for r in results if r["channels"] == ch]
        a1.plot([r["k"] for r in rows], [r["mean_abs"] for r in rows], style, label=f"{ch} channels")
        if ch == "calibrated":
            a2.plot([r["k"] for r in rows], [r["moe_layer_ms"] for r in rows], style, label="w4a4_rac layer")
    a1.set_xlabel("k (compensated channels)")
    a1.set_ylabel("mean |logp_train - logp_rollout|")
    a2.set_xlabel("k (compensated channels)")
    a2.set_ylabel(f"MoE layer ms ({args.layer_tokens} tokens)")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    plots.save(fig, args.out_png)
    print(f"wrote {args.out_json} and {args.out_png}")
    return out


if __name__ == "__main__":
    raise SystemExit(run_cli(main, prog="paper_rac_sweep"))
