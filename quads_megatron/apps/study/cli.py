"""Flags shared by the tools/paper_*.py commands, and the GRPO-job flags they build trainers from."""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch


class _StudyParser(argparse.ArgumentParser):
    """argparse that refuses --out-json / --out-png over an input (--hf-checkpoint, a --task file) once parsed."""

    def parse_args(self, args=None, namespace=None):
        from quads_megatron.output_dir import check_not_inside_inputs

        ns = super().parse_args(args, namespace)
        task = getattr(ns, "task", None)
        inputs = [("--hf-checkpoint", getattr(ns, "hf_checkpoint", None)),
                  ("--task", task if task and Path(task).is_file() else None)]
        for flag in ("out_json", "out_png"):
            if getattr(ns, flag, None):
                check_not_inside_inputs(getattr(ns, flag), inputs, flag="--" + flag.replace("_", "-"))
        return ns


def common_parser(description: str, out_stem: str) -> argparse.ArgumentParser:
    p = _StudyParser(description=description)
    p.add_argument("--hf-checkpoint", default=None,
                   help="HF Qwen3-MoE checkpoint to start from (e.g. quads-pretrain's output); default: the tiny "
                        "preset after the GRPO job's SFT warm-up")
    p.add_argument("--task", default="sort:6")
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=64, help="prompts per measurement")
    p.add_argument("--n-samples-per-prompt", type=int, default=4, help="samples per prompt (temperature 1)")
    p.add_argument("--rac-channels", type=int, default=64, help="k of the QUADS rollout (w4a4_rac)")
    p.add_argument("--sft-iters", type=int, default=None, help="the GRPO job's warm-up (default: 0 with "
                   "--hf-checkpoint, else 60)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out-json", default=f"runs/paper/{out_stem}.json")
    p.add_argument("--out-png", default=f"runs/paper/{out_stem}.png")
    p.add_argument("job_flags", nargs="*", help="after --: more flags of the GRPO job (quads_megatron.rl)")
    return p


def job_flags(args, train: str, rollout: str, tb_dir: str) -> list[str]:
    """The GRPO job's flags for a trainer of precision ``train`` with a ``rollout`` engine."""
    f = ["--task", args.task, "--seq-length", str(args.seq_length), "--max-new-tokens", str(args.max_new_tokens),
         "--train-precision", train, "--rollout-precision", rollout, "--seed", str(args.seed),
         "--tensorboard-dir", tb_dir, "--no-progress"]
    if rollout in ("w4a4_rac", "quads"):
        f += ["--rac-channels", str(args.rac_channels)]
    if args.hf_checkpoint:
        f += ["--hf-checkpoint", args.hf_checkpoint]
    if args.sft_iters is not None:
        f += ["--sft-iters", str(args.sft_iters)]
    if torch.cuda.is_available():
        f += ["--bf16"]
    return f + list(args.job_flags)


def environment() -> dict:
    """Where and when a result was measured (recorded in every JSON)."""
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"date": time.strftime("%Y-%m-%d"), "device": dev, "torch": torch.__version__}


def write_json(path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    return path
