"""Activation error dominates: the rollout-trainer gap and per-layer MoE output error per rollout precision.

For a BF16 trainer and an AQAT trainer, each rollout precision (bf16, w4a16 = weight error only,
w16a4 = activation error only, w4a4, quads = w4a4 + RAC) samples the same prompts; the trainer scores
the same tokens. Writes JSON (mean |dlogp|, k3 KL, per-layer relative MoE output error) and a PNG.

    python tools/paper_activation_error.py --hf-checkpoint runs/moe-240m-hf --num-prompts 64
"""

from __future__ import annotations

import sys
import tempfile

from quads_megatron.errors import run_cli

PRECISIONS = ["bf16", "w4a16", "w16a4", "w4a4", "w4a4_rac"]
TRAINERS = ["bf16", "w4a16"]
LABEL = {"bf16": "BF16", "w4a16": "W4A16", "w16a4": "W16A4", "w4a4": "W4A4", "w4a4_rac": "QUADS (W4A4+RAC)"}


def main(argv=None) -> dict:
    from quads_megatron.rl.engines.base import SamplingParams
    from quads_megatron.apps.study import cli, plots
    from quads_megatron.apps.study.mismatch import (build_setup, layer_output_errors, make_engine, release, rollout_gap,
                                               rollout_recipe)

    p = cli.common_parser(__doc__.splitlines()[0], "activation_error")
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--trainers", default=",".join(TRAINERS), help="bf16 (plain trainer) and/or w4a16 (AQAT)")
    args = p.parse_args(argv)
    precisions, trainers = args.precisions.split(","), args.trainers.split(",")
    results = []
    with tempfile.TemporaryDirectory() as tb:
        for train in trainers:
            setup = build_setup(cli.job_flags(args, train, "bf16", tb))
            prompts = [q for q in setup.prompts(args.num_prompts) for _ in range(args.n_samples_per_prompt)]
            calib = setup.prompts(16, seed=-1)
            sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens,
                                      stop_token_ids=[setup.trainer.eos])
            ref = make_engine(setup, rollout_recipe(setup, "bf16", args.rac_channels), calib)
            for prec in precisions:
                eng = ref if prec == "bf16" else make_engine(setup, rollout_recipe(setup, prec, args.rac_channels), calib)
                stats, _ = rollout_gap(setup, eng, prompts, sampling, seed=args.seed)
                errs = layer_output_errors(ref, eng, setup.prompts(16, seed=7))
                results.append({"trainer": train, "rollout": prec, "rac_channels": eng.plan.rac_channels, **stats,
                                "layer_rel_err": errs})
                print(f"trainer {train:6s} rollout {prec:9s} mean|dlogp| {stats['mean_abs']:.5f} "
                      f"k3 {stats['k3_kl']:.2e} layer err {sum(errs) / len(errs):.4f}", flush=True)
                if eng is not ref:
                    release(eng)
            release(ref)
            setup.trainer.close()
    out = {"tool": "paper_activation_error", "env": cli.environment(), "argv": sys.argv[1:] if argv is None else argv,
           "config": {k: v for k, v in vars(args).items() if k not in ("out_json", "out_png")}, "results": results}
    cli.write_json(args.out_json, out)
    fig, (a1, a2, a3) = plots.figure(3, title="Rollout-trainer mismatch by rollout precision")
    by = {(r["trainer"], r["rollout"]): r for r in results}
    groups = [LABEL.get(pr, pr) for pr in precisions]
    tname = {"bf16": "BF16 trainer", "w4a16": "AQAT trainer"}
    plots.grouped_bars(a1, groups, {tname.get(t, t): [by[t, pr]["mean_abs"] for pr in precisions] for t in trainers},
                       "mean |logp_train - logp_rollout|")
    plots.grouped_bars(a2, groups, {tname.get(t, t): [max(by[t, pr]["k3_kl"], 1e-9) for pr in precisions]
                                    for t in trainers}, "k3 KL(rollout || trainer)", log=True)
    for pr in precisions:
        if pr != "bf16":
            errs = by[trainers[0], pr]["layer_rel_err"]
            a3.plot(range(len(errs)), errs, marker="o", label=LABEL.get(pr, pr))
    a3.set_xticks(range(len(by[trainers[0], precisions[-1]]["layer_rel_err"])))
    a3.set_xlabel("MoE layer")
    a3.set_ylabel("relative output error vs BF16")
    a3.set_yscale("log")
    a3.legend(fontsize=8)
    a3.grid(alpha=0.3)
    for a in (a1, a2):
        a.tick_params(axis="x", labelrotation=20, labelsize=8)
    plots.save(fig, args.out_png)
    print(f"wrote {args.out_json} and {args.out_png}")
    return out


if __name__ == "__main__":
    raise SystemExit(run_cli(main, prog="paper_activation_error"))
