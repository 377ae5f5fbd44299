"""RL stability: GRPO with BF16 rollouts, naive W4A4 rollouts (BF16 trainer) and QUADS (AQAT + RAC), each also
with rollout routing replay (R3), same seeds.

Runs the GRPO job (quads_megatron.rl) once per row and seed with identical flags otherwise; writes every run's
per-step reward, pass@1, mean and p99 of the |rollout - trainer| log-prob gap, KL, routing disagreement and
gradient norm as JSON, and one PNG panel per metric. Resumable: with --work-dir a finished run is read back
and not rerun, and an unfinished one continues from its last GRPO checkpoint (--save-interval steps). With
--jobs N the runs go N at a time as separate processes (one H200 holds several jobs of the GPU preset).
--plot-only plots a study cut short: finished runs from their records, the others up to their last logged step
(read back from their TensorBoard events).

    python tools/paper_rl_stability.py --hf-checkpoint runs/moe-240m-hf --seeds 1 --naive-seeds 1,2 --jobs 7 \\
        --work-dir runs/paper/rl_stability -- --train-iters 300
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quads_megatron.errors import ConfigError, run_cli

# row -> (trainer precision, rollout precision, --use-rollout-routing-replay)
CONFIGS = {"BF16 rollout": ("bf16", "bf16", False), "naive W4A4 (BF16 trainer)": ("bf16", "w4a4", False),
           "QUADS (AQAT + RAC)": ("w4a16", "w4a4_rac", False), "naive W4A4 + R3": ("bf16", "w4a4", True),
           "QUADS + R3": ("w4a16", "w4a4_rac", True)}
NAIVE = ("naive W4A4 (BF16 trainer)", "naive W4A4 + R3")
COLORS = dict(zip(CONFIGS, ["tab:blue", "tab:red", "tab:green", "tab:orange", "tab:olive"]))
# (history key, y label, log scale)
METRICS = [("reward", "reward (mean over rollouts)", False), ("pass", "pass@1 (greedy, held-out)", False),
           ("gap", "mean |logp_train - logp_rollout|", True), ("gap_p99", "p99 |logp_train - logp_rollout|", True),
           ("kl", "KL(rollout || trainer), k3", True), ("routing_disagreement", "routing disagreement", False),
           ("grad_norm", "gradient norm", True)]


def _slug(name: str, seed: int) -> str:
    return f"{re.sub(r'[^a-z0-9]+', '_', name.lower()).strip('_')}_seed{seed}"


def _seeds(text: str, flag: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated integers") from None


def plan_runs(args) -> list[tuple[str, int]]:
    """(row, seed) of every run: --seeds for every row, --naive-seeds (default: --seeds) for the naive W4A4 rows."""
    rows = [r.strip() for r in args.rows.split(",")] if args.rows else list(CONFIGS)
    unknown = [r for r in rows if r not in CONFIGS]
    if unknown:
        raise ConfigError(f"--rows {unknown}: expected some of {list(CONFIGS)}")
    seeds = _seeds(args.seeds, "--seeds")
    naive = _seeds(args.naive_seeds, "--naive-seeds") if args.naive_seeds else seeds
    return [(row, seed) for row in rows for seed in (naive if row in NAIVE else seeds)]


def run_one(args, row: str, seed: int, work: Path) -> dict:
    """One GRPO job (or its record from an earlier invocation)."""
    from quads_megatron.apps.study import cli
    from quads_megatron.rl.loop import main as grpo_main

    record = work / f"{_slug(row, seed)}.json"
    if record.exists():
        done = json.loads(record.read_text())
        print(f"[rl_stability] {row}, seed {seed}: already done ({record})", flush=True)
        return done
    train, rollout, r3 = CONFIGS[row]
    args.seed = seed
    run_dir = work / _slug(row, seed)
    flags = cli.job_flags(args, train, rollout, str(run_dir / "tb"))
    if r3:
        flags.append("--use-rollout-routing-replay")
    if args.save_interval:
        flags += ["--save", str(run_dir / "ckpt"), "--save-interval", str(args.save_interval), "--resume"]
    s = grpo_main(flags)
    done = {**_record(row, seed, s), "wall_time_s": s["wall_time_s"]}
    cli.write_json(record, done)
    return done


def _record(row: str, seed: int, summary: dict) -> dict:
    """A run's record from the GRPO job's summary (`rl.metrics.history_summary`'s figures)."""
    train, rollout, r3 = CONFIGS[row]
    return {"config": row, "seed": seed, "train": train, "rollout": rollout, "routing_replay": r3,
            "history": summary["history"], "pass@1_before": summary["pass@1_before"],
            "pass@1_after": summary["pass@1_after"], "reward_before": summary["reward_before"],
            "reward_after": summary["reward_after"], "mean_gap": summary["mean_logprob_abs_diff"],
            "mean_routing_disagreement": summary.get("mean_routing_disagreement")}


def read_cut_run(row: str, seed: int, work: Path) -> dict | None:
    """The record of a run that has none yet (cut, or still going), read back from its TensorBoard events:
    its history so far, marked ``unfinished``; None if it never logged a step."""
    from quads_megatron.rl.metrics import history_summary, read_history

    tb = work / _slug(row, seed) / "tb"
    if not tb.is_dir() or not any(tb.glob("events.out.tfevents.*")):
        return None
    history, pass_before = read_history(tb)
    if not history:
        return None
    return {**_record(row, seed, history_summary(history, pass_before)), "unfinished": True}


def collect(planned: list[tuple[str, int]], work: Path) -> list[dict]:
    """Every planned run's record: finished runs' own, unfinished runs' read back from TensorBoard (--plot-only)."""
    runs = []
    for row, seed in planned:
        record = work / f"{_slug(row, seed)}.json"
        run = json.loads(record.read_text()) if record.exists() else read_cut_run(row, seed, work)
        state = "finished" if record.exists() else (f"unfinished, {len(run['history'])} steps" if run else "no step")
        print(f"[rl_stability] {row}, seed {seed}: {state}", flush=True)
        if run is not None:
            runs.append(run)
    return runs


_RUN_SELECTORS = ("--rows", "--seeds", "--naive-seeds", "--jobs", "--out-json", "--out-png")


def child_argv(argv: list[str], row: str, seed: int, work: Path) -> list[str]:
    """This invocation's flags for one (row, seed) run: the run selectors and outputs replaced, the rest
    (checkpoint, task, GRPO flags after --) kept."""
    head, tail = (argv[:argv.index("--")], argv[argv.index("--"):]) if "--" in argv else (argv, [])
    kept, skip = [], False
    for a in head:
        if skip:
            skip = False
        elif a in _RUN_SELECTORS:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in _RUN_SELECTORS)):
            kept.append(a)
    slug = _slug(row, seed)
    return [*kept, "--rows", row, "--seeds", str(seed), "--naive-seeds", str(seed), "--work-dir", str(work),
            "--out-json", str(work / f"{slug}.summary.json"), "--out-png", str(work / f"{slug}.png"), *tail]


def run_concurrently(argv: list[str], planned: list[tuple[str, int]], work: Path, jobs: int) -> None:
    """Run the unfinished runs as separate processes, ``jobs`` at a time (each log: WORK/<run>.log); the
    caller then reads every record back. A failed run is named with its log."""
    todo = [(row, seed) for row, seed in planned if not (work / f"{_slug(row, seed)}.json").exists()]
    running: list[tuple[str, subprocess.Popen]] = []
    failed = []

    def reap(block: bool):
        while running and (block or len(running) >= jobs):
            for item in list(running):
                if item[1].poll() is not None:
                    running.remove(item)
                    if item[1].returncode:
                        failed.append(item[0])
            time.sleep(2)
            block = block and bool(running)

    for row, seed in todo:
        reap(block=False)
        slug = _slug(row, seed)
        log = open(work / f"{slug}.log", "a")
        print(f"[rl_stability] start {row}, seed {seed} (log {log.name})", flush=True)
        running.append((slug, subprocess.Popen([sys.executable, __file__, *child_argv(argv, row, seed, work)],
                                               stdout=log, stderr=subprocess.STDOUT)))
    reap(block=True)
    if failed:
        raise ConfigError(f"rl_stability: runs failed: {', '.join(f'{s} (log {work / s}.log)' for s in failed)}")


def trailing_mean(values, window: int) -> list[float]:
    """Mean of each run of ``window`` consecutive values (len(values) - window + 1 of them)."""
    sums = [0.0]
    for v in values:
        sums.append(sums[-1] + v)
    return [(sums[i + window] - sums[i]) / window for i in range(len(values) - window + 1)]


def plot(runs: list[dict], path) -> None:
    from quads_megatron.apps.study import plots

    plt = plots._plt()
    ncols = 4
    nrows = -(-len(METRICS) // ncols)
    fig, grid = plt.subplots(nrows, ncols, figsize=(5.0 * ncols, 3.8 * nrows), squeeze=False)
    window = max(1, max((len(r["history"]) for r in runs), default=0) // 30)
    fig.suptitle("GRPO on the same seeds: BF16, naive W4A4 and QUADS rollouts, without and with routing replay"
                 + (f" (lines: trailing mean over {window} steps; faint: every step)" if window > 1 else ""),
                 fontsize=11)
    axes = [a for row in grid for a in row]
    first_seed = {}
    for r in runs:
        h, lab, color = r["history"], f"{r['config']} (seed {r['seed']})", COLORS[r["config"]]
        if r.get("unfinished"):
            lab += f", cut at step {h[-1]['step']}"
        style = "--" if r.get("routing_replay") else "-"
        width = 1.6 if first_seed.setdefault(r["config"], r["seed"]) == r["seed"] else 0.9  # a row's other seeds
        for ax, (key, _, _) in zip(axes, METRICS):
            if key == "pass":
                pts = [(0, r["pass@1_before"])] + [(x["step"], x["pass"]) for x in h if x.get("pass") is not None]
                if all(v is not None for _, v in pts):
                    ax.plot(*zip(*pts), style, marker="o", color=color, alpha=0.8, lw=width, label=lab)
                continue
            pts = [(x["step"], x[key]) for x in h if x.get(key) is not None]
            if not pts:
                continue
            steps, values = zip(*pts)
            if window > 1:
                ax.plot(steps, values, color=color, alpha=0.15, lw=0.5)
            ax.plot(steps[window - 1:], trailing_mean(values, window), style, color=color, alpha=0.9, lw=width,
                    label=lab)
    for ax, (_, ylabel, log) in zip(axes, METRICS):
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if log and ax.lines and all(min(line.get_ydata()) > 0 for line in ax.lines):
            ax.set_yscale("log")
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[len(METRICS):]:
        ax.axis("off")
    if len(axes) > len(METRICS):
        axes[-1].legend(handles, labels, fontsize=7, loc="center")
    else:
        axes[0].legend(fontsize=7)
    plots.save(fig, path)


def main(argv=None) -> dict:
    from quads_megatron.apps.study import cli

    p = cli.common_parser(__doc__.splitlines()[0], "rl_stability")
    p.add_argument("--seeds", default="1", help="comma-separated seeds; each row runs once per seed")
    p.add_argument("--naive-seeds", default=None, help="seeds of the two naive W4A4 rows (default: --seeds)")
    p.add_argument("--rows", default=None, help=f"comma-separated subset of the rows {list(CONFIGS)} (default: all)")
    p.add_argument("--work-dir", default=None, help="keep each run's record, TensorBoard and checkpoints here; "
                   "a rerun skips finished runs and resumes unfinished ones (default: a temporary directory)")
    p.add_argument("--save-interval", type=int, default=50,
                   help="GRPO checkpoint every N steps with --work-dir, so a cut run resumes (0: none)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time, each its own process (needs --work-dir)")
    p.add_argument("--plot-only", action="store_true",
                   help="run nothing: plot --work-dir's finished runs and, read back from their TensorBoard events, "
                        "the steps so far of unfinished ones (a study cut short, or one still running)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    planned = plan_runs(args)
    if args.plot_only:
        if not args.work_dir or not Path(args.work_dir).is_dir():
            raise ConfigError(f"--plot-only: --work-dir {args.work_dir}: expected the study's existing work directory")
        runs = collect(planned, Path(args.work_dir))
        if not runs:
            raise ConfigError(f"--plot-only: no run in {args.work_dir} has logged a GRPO step")
        return _write(args, argv, runs)
    if args.jobs > 1 and not args.work_dir:
        raise ConfigError("--jobs > 1: give --work-dir (the runs hand their records over through it)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        if not args.work_dir:
            args.save_interval = 0  # nothing to resume from a temporary directory
        work.mkdir(parents=True, exist_ok=True)
        if args.jobs > 1:
            run_concurrently(argv, planned, work.resolve(), args.jobs)
        runs = [run_one(args, row, seed, work) for row, seed in planned]
    return _write(args, argv, runs)


def summary_table(runs: list[dict], span: int = 25) -> str:
    """Markdown: per run the reward of its first and last ``span`` steps, pass@1 before and at the end, and
    the mismatch figures (mean and p99 log-prob gap, KL, routing disagreement) and gradient norm over its
    whole history and its last ``4 span`` steps."""
    from quads_megatron.rl.metrics import mean_or_none

    def mean(h, key):
        return mean_or_none(x.get(key) for x in h)

    def fmt(v, spec):
        return "n/a" if v is None else format(v, spec)

    lines = ["| run | steps | reward first -> last | pass@1 before -> end | mean gap (all / last) "
             "| p99 gap (last) | KL (last) | routing disagreement (all / last) | grad norm (last) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        h = r["history"]
        tail = h[-4 * span:]
        lines.append(
            f"| {r['config']}, seed {r['seed']} | {h[-1]['step'] if h else 0} "
            f"| {fmt(mean(h[:span], 'reward'), '.3f')} -> {fmt(mean(h[-span:], 'reward'), '.3f')} "
            f"| {fmt(r.get('pass@1_before'), '.3f')} -> {fmt(r.get('pass@1_after'), '.3f')} "
            f"| {fmt(mean(h, 'gap'), '.2e')} / {fmt(mean(tail, 'gap'), '.2e')} | {fmt(mean(tail, 'gap_p99'), '.2e')} "
            f"| {fmt(mean(tail, 'kl'), '.2e')} "
            f"| {fmt(mean(h, 'routing_disagreement'), '.4f')} / {fmt(mean(tail, 'routing_disagreement'), '.4f')} "
            f"| {fmt(mean(tail, 'grad_norm'), '.2f')} |")
    return "\n".join(lines)


def _write(args, argv: list[str], runs: list[dict]) -> dict:
    from quads_megatron.apps.study import cli

    out = {"tool": "paper_rl_stability", "env": cli.environment(), "argv": argv,
           "config": {k: v for k, v in vars(args).items() if k not in ("out_json", "out_png")}, "runs": runs}
    cli.write_json(args.out_json, out)
    plot(runs, args.out_png)
    print(summary_table(runs))
    print(f"wrote {args.out_json} and {args.out_png}")
    return out


if __name__ == "__main__":
    raise SystemExit(run_cli(main, prog="paper_rl_stability"))
