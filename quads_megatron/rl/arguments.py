"""Command-line flags of the GRPO job, named like Megatron's (and slime/miles' RL flags)."""

from __future__ import annotations

import argparse
import os

from quads_megatron import vocab


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of train_grpo_moe; defaults are the 2-CPU-core tiny run."""
    p = argparse.ArgumentParser(
        prog="train_grpo_moe",
        description="GRPO on a Qwen3-MoE with a Megatron-Core trainer (AQAT) and NVFP4 (QUADS) rollouts.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    g = p.add_argument_group("model")
    g.add_argument("--preset", default="tiny", help="Qwen3-MoE preset of quads_megatron.megatron.presets")
    g.add_argument("--hf-checkpoint", default=None,
                   help="initial weights from an HF Qwen3-MoE checkpoint dir (converted with quads_megatron.convert)")
    g.add_argument("--tokenizer", default=None, help="HF tokenizer dir (default: the checkpoint's, or the char tokenizer)")
    g.add_argument("--seq-length", type=int, default=32, help="max prompt + response tokens")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--moe-router-topk", type=int, default=None)
    g.add_argument("--bf16", action="store_true", help="BF16 params in the trainer (default fp32 on CPU)")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None)

    g = p.add_argument_group("training")
    g.add_argument("--train-iters", type=int, default=150, help="GRPO steps (one rollout each)")
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.99)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--micro-batch-size", type=int, default=64, help="sequences per forward/backward")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="sequences per optimizer step over all DP ranks (default: one step per rollout)")

    g = p.add_argument_group("rl")
    g.add_argument("--task", default="sort:6", help="'arithmetic[:digits]', 'sort[:length]' or a .jsonl path")
    g.add_argument("--eval-data", default=None, help="held-out .jsonl for pass@1 (JSONL tasks)")
    g.add_argument("--rollout-batch-size", type=int, default=32, help="prompts per step over all DP ranks")
    g.add_argument("--n-samples-per-prompt", type=int, default=8, help="G, the GRPO group size")
    g.add_argument("--max-new-tokens", "--rollout-max-response-len", dest="max_new_tokens", type=int, default=8)
    g.add_argument("--temperature", "--rollout-temperature", dest="temperature", type=float, default=1.0)
    g.add_argument("--top-p", "--rollout-top-p", dest="top_p", type=float, default=1.0)
    g.add_argument("--eps-clip", type=float, default=0.2)
    g.add_argument("--eps-clip-high", type=float, default=None)
    g.add_argument("--no-tis", dest="use_tis", action="store_false", help="disable truncated importance sampling")
    g.add_argument("--tis-cap", type=float, default=2.0)
    g.add_argument("--use-mis", action="store_true", help="token-level masked importance sampling")
    g.add_argument("--mis-low", type=float, default=0.5)
    g.add_argument("--mis-high", type=float, default=2.0)
    g.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL to the rollout policy")
    g.add_argument("--disable-grpo-std-normalization", action="store_true", help="Dr.GRPO advantages (no std)")
    g.add_argument("--sft-iters", type=int, default=None,
                   help="supervised warm-up steps before GRPO (default 60 for the tiny preset, 0 with --hf-checkpoint)")
    g.add_argument("--sft-lr", type=float, default=3e-3)
    g.add_argument("--sft-batch-size", type=int, default=64)

    g = p.add_argument_group("precision (spellings of the QuadsRecipe fields; the QuantPlan decides per weight)")
    g.add_argument("--quads-train", choices=vocab.precision_choices(train=True), default=None,
                   help="trainer precision of the quantized weights: bf16, aqat (= w4a16: NVFP4 fake-quantized "
                        "weights, BF16 activations; the default) or the symmetric w4a4 baseline")
    g.add_argument("--quads-recipe", default=None, help="QuadsRecipe JSON file (default recipe otherwise)")
    g.add_argument("--rollout-precision", choices=vocab.precision_choices(), default=None,
                   help="rollout GEMMs: bf16, w4a16 (NVFP4 weights only), w4a4, w4a4_rac (= quads: W4A4 + RAC; "
                        "the default)")
    g.add_argument("--activation-scaling", choices=[s.value for s in vocab.ActivationScaling], default=None,
                   help="W4A4 activation scales (default: the recipe's, per_token)")
    g.add_argument("--rac-channels", type=int, default=None,
                   help="RAC compensation channels per GEMM (multiple of 16; default: the recipe's, 16)")
    g.add_argument("--quads-scope", nargs="+", choices=[s.value for s in vocab.Scope], default=None,
                   help="weights to quantize in trainer and rollout alike (default: the recipe's, routed_experts)")

    g = p.add_argument_group("rollout engine")
    g.add_argument("--rollout-engine", choices=["local", "sglang"], default="local")
    g.add_argument("--sglang-url", action="append", default=None,
                   help="SGLang server URL(s) (repeat or comma-separate); prompts are spread over them")
    g.add_argument("--sglang-launch", action="store_true",
                   help="export the initial weights to a QUADS rollout checkpoint and start an SGLang server on it")
    g.add_argument("--sglang-port", type=int, default=30000, help="port of the --sglang-launch server")
    g.add_argument("--sglang-server-args", default="", help="extra flags for the launched server (one string)")
    g.add_argument("--sglang-router-url", default=None,
                   help="generate through this SGLang router; weights still go to every --sglang-url worker")
    g.add_argument("--sglang-weight-sync", choices=["tensor", "disk"], default="tensor")
    g.add_argument("--sglang-sync-dir", default=None, help="directory for --sglang-weight-sync disk")

    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--exp-name", default=None, help="run name (default from the flags)")
    g.add_argument("--tensorboard-dir", default=None, help="default runs/<exp-name>")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--eval-interval", type=int, default=25, help="pass@1 on the held-out set every N steps")
    g.add_argument("--quant-error-interval", type=int, default=10, help="per-layer NVFP4 error every N steps")
    g.add_argument("--save", default=None,
                   help="checkpoint directory (Megatron dist_checkpointing: iter_NNNNNNN/ + "
                        "latest_checkpointed_iteration.txt, config.json + tokenizer in hf/; converts with "
                        "quads-convert-megatron-to-hf --load-dir); saved every --save-interval steps and "
                        "always at the end of training")
    g.add_argument("--save-interval", type=int, default=None,
                   help="steps between checkpoints (unset or 0: only at the end of training)")
    g.add_argument("--load", default=None, help="resume from the latest checkpoint of this directory")
    g.add_argument("--resume", action="store_true", help="resume from --save if it holds a checkpoint")
    g.add_argument("--force", action="store_true",
                   help="start over in a --save directory that already holds a checkpoint: its iterations "
                        "are replaced at this run's first save")
    g.add_argument("--no-tqdm", action="store_true")
    g.add_argument("--summary-json", default=None, help="also write the final summary here")
    return p


def _held_checkpoint(save: str) -> str | None:
    """'iteration N' when ``save`` holds a Megatron-layout checkpoint (tracker or iter_* directories)."""
    from pathlib import Path

    from quads_megatron.megatron.checkpoint import TRACKER

    path = Path(save)
    if (path / TRACKER).is_file():
        return f"iteration {(path / TRACKER).read_text().strip()}"
    iters = sorted(d.name for d in path.glob("iter_*") if d.is_dir() and not d.name.endswith((".tmp", ".old")))
    return f"{iters[-1]}, no {TRACKER}" if iters else None


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def resolve_recipe(args):
    """The run's QuadsRecipe: --quads-recipe (or the default) with the precision flags applied."""
    from quads_megatron.recipe import QuadsRecipe

    recipe = QuadsRecipe()
    if args.quads_recipe:
        try:
            recipe = QuadsRecipe.from_json(open(args.quads_recipe).read())
        except (OSError, ValueError) as e:
            raise ValueError(f"--quads-recipe {args.quads_recipe}: {e}") from None
    return recipe.replace(
        train_precision=args.quads_train and vocab.parse_precision(args.quads_train, "--quads-train"),
        rollout_precision=args.rollout_precision and vocab.parse_precision(args.rollout_precision,
                                                                           "--rollout-precision"),
        activation_scaling=args.activation_scaling, rac_channels=args.rac_channels,
        scope=tuple(args.quads_scope) if args.quads_scope else None)


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and cross-check flags; errors name the flag."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.resume and not args.save:
        p.error("--resume needs --save (the directory to resume from)")
    if args.resume and args.load is None:
        args.load = args.save
    if args.save_interval is not None and not args.save:
        p.error("--save-interval needs --save")
    if args.save_interval is not None and args.save_interval < 0:
        p.error(f"--save-interval {args.save_interval}: must be >= 0 (0: save only at the end)")
    if args.force and not args.save:
        p.error("--force needs --save")
    held = _held_checkpoint(args.save) if args.save and not args.force else None
    if held is not None and (args.load is None or not _same_dir(args.load, args.save)):
        load = "" if args.load is None else f" (this run loads --load {args.load})"
        p.exit(2, f"{p.prog}: error: --save {args.save} already holds a checkpoint ({held}) that this run would "
                  f"not continue from{load}; pass --resume to continue it, a new --save directory, or --force "
                  "to start over and replace it\n")
    try:
        args.recipe = resolve_recipe(args)
    except (OSError, ValueError) as e:
        p.error(str(e))
    if args.sglang_launch:
        args.rollout_engine = "sglang"
    if args.rollout_engine == "sglang" and not args.sglang_url and not args.sglang_launch:
        p.error("--rollout-engine sglang needs --sglang-url http://HOST:PORT (or --sglang-launch)")
    for flag in ("rollout_batch_size", "n_samples_per_prompt", "micro_batch_size", "seq_length", "max_new_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.sft_iters is None:
        args.sft_iters = 0 if args.hf_checkpoint else 60
    if args.exp_name is None:
        args.exp_name = (f"grpo_{args.preset}_{args.recipe.train_precision.value}_"
                         f"{args.recipe.rollout_precision.value}")
    if args.tensorboard_dir is None:
        args.tensorboard_dir = os.path.join("runs", args.exp_name)
    return args
