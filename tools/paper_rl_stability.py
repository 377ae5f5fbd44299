"""RL stability: GRPO with BF16 rollouts, naive W4A4 rollouts (BF16 trainer) and QUADS (AQAT + RAC), same seeds.

Runs the GRPO job (quads_megatron.rl) once per configuration and seed with identical flags otherwise;
writes every run's per-step reward, pass@1 and rollout-trainer gap as JSON and a 3-panel PNG.

    python tools/paper_rl_stability.py --hf-checkpoint runs/moe-240m-hf --seeds 1 -- --train-iters 100
"""

from __future__ import annotations

import sys
import tempfile

from quads_megatron.errors import run_cli

CONFIGS = {"BF16 rollout": ("bf16", "bf16"), "naive W4A4 (BF16 trainer)": ("bf16", "w4a4"),
           "QUADS (AQAT + RAC)": ("w4a16", "w4a4_rac")}


def main(argv=None) -> dict:
    from quads_megatron.rl.loop import main as grpo_main
    from quads_megatron.apps.study import cli, plots

    p = cli.common_parser(__doc__.splitlines()[0], "rl_stability")
    p.add_argument("--seeds", default="1", help="comma-separated seeds; each configuration runs once per seed")
    args = p.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as tb:
        for seed in [int(s) for s in args.seeds.split(",")]:
            args.seed = seed
            for name, (train, rollout) in CONFIGS.items():
                s = grpo_main(cli.job_flags(args, train, rollout, f"{tb}/{len(runs)}"))
                runs.append({"config": name, "seed": seed, "train": train, "rollout": rollout,
                             "history": s["history"], "pass@1_before": s["pass@1_before"],
                             "pass@1_after": s["pass@1_after"], "reward_before": s["reward_before"],
                             "reward_after": s["reward_after"], "mean_gap": s["mean_logprob_abs_diff"],
                             "wall_time_s": s["wall_time_s"]})
    out = {"tool": "paper_rl_stability", "env": cli.environment(), "argv": sys.argv[1:] if argv is None else argv,
           "config": {k: v for k, v in vars(args).items() if k not in ("out_json", "out_png")}, "runs": runs}
    cli.write_json(args.out_json, out)
    fig, axes = plots.figure(3, title="GRPO on the same seeds: BF16 vs naive W4A4 vs QUADS rollouts")
    colors = dict(zip(CONFIGS, ["tab:blue", "tab:red", "tab:green"]))
    for r in runs:
        h = r["history"]
        steps = [x["step"] for x in h]
        lab = f"{r['config']} (seed {r['seed']})"
        axes[0].plot(steps, [x["reward"] for x in h], color=colors[r["config"]], alpha=0.8, label=lab)
        ev = [(x["step"], x["pass"]) for x in h if x.get("pass") is not None]
        axes[1].plot([0] + [e[0] for e in ev], [r["pass@1_before"]] + [e[1] for e in ev], "o-",
                     color=colors[r["config"]], alpha=0.8, label=lab)
        axes[2].plot(steps, [x["gap"] for x in h], color=colors[r["config"]], alpha=0.8, label=lab)
    for a, yl in zip(axes, ["reward (mean over rollouts)", "pass@1 (greedy, held-out)",
                            "mean |logp_train - logp_rollout|"]):
        a.set_xlabel("GRPO step")
        a.set_ylabel(yl)
        a.grid(alpha=0.3)
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=7)
    plots.save(fig, args.out_png)
    print(f"wrote {args.out_json} and {args.out_png}")
    return out


if __name__ == "__main__":
    raise SystemExit(run_cli(main, prog="paper_rl_stability"))
