"""Run examples/train_grpo_moe.sh once per rollout precision and print a table of the summaries.

    .venv/bin/python tools/grpo_precision_table.py                       # CPU default, 4 runs
    .venv/bin/python tools/grpo_precision_table.py --precisions quads w4a4 -- --bf16 --train-iters 40

Everything after `--` goes to every run (e.g. --train-precision bf16 for the naive baseline).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precisions", nargs="+", default=["bf16", "w4a16", "w4a4", "quads"])
    p.add_argument("--nproc-per-node", type=int, default=1)
    args = p.parse_args(argv)
    rows = []
    out_dir = Path(tempfile.mkdtemp(prefix="grpo_table_"))
    for prec in args.precisions:
        summary = out_dir / f"{prec}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(args.nproc_per_node), str(ROOT / "examples" / "train_grpo_moe.sh"), "--rollout-precision", prec,
               "--no-progress", "--summary-json", str(summary), "--exp-name", f"table_{prec}", *extra]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, TORCHDYNAMO_DISABLE="1"), capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            print(f"{prec}: FAILED (exit {r.returncode})\n{r.stderr[-3000:]}", file=sys.stderr)
            rows.append((prec, wall, None))
            continue
        rows.append((prec, wall, json.loads(summary.read_text())))
    f = lambda v: "n/a" if v is None else f"{v:.3g}"
    print("| rollout precision | trainer | wall s | reward before -> after | pass@1 before -> after | mean abs logp gap |")
    print("|---|---|---|---|---|---|")
    for prec, wall, s in rows:
        if s is None:
            print(f"| {prec} | | {wall:.0f} | failed | | |")
            continue
        print(f"| {prec} | {s['train_precision']} | {wall:.0f} | {f(s['reward_before'])} -> {f(s['reward_after'])} | "
              f"{f(s['pass@1_before'])} -> {f(s['pass@1_after'])} | {f(s['mean_logprob_abs_diff'])} |")


if __name__ == "__main__":
    main()
