"""Command-line flags of the GRPO job, named like Megatron's (and slime/miles' RL flags)."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from quads_megatron import vocab
from quads_megatron.errors import CheckpointError, ConfigError
from quads_megatron.recipe import add_recipe_args, recipe_from_args


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are a ConfigError (one line through run_cli, exit 2), not a usage dump."""

    def error(self, message):
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of train_grpo_moe; defaults are the 2-CPU-core tiny run."""
    p = _Parser(
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
    g.add_argument("--max-new-tokens", type=int, default=8, help="response tokens per sample")
    g.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature")
    g.add_argument("--top-p", type=float, default=1.0, help="rollout nucleus sampling")
    g.add_argument("--eps-clip", type=float, default=0.2)
    g.add_argument("--eps-clip-high", type=float, default=None)
    g.add_argument("--no-tis", dest="use_tis", action="store_false", help="disable truncated importance sampling")
    g.add_argument("--tis-cap", type=float, default=2.0)
    g.add_argument("--use-mis", action="store_true", help="token-level masked importance sampling")
    g.add_argument("--mis-low", type=float, default=0.5)
    g.add_argument("--mis-high", type=float, default=2.0)
    g.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL to the rollout policy")
    g.add_argument("--use-rollout-routing-replay", action="store_true",
                   help="R3: the trainer's routers use the rollout's top-k experts of every token (Megatron's "
                        "RouterReplay; the gate probabilities of those experts are still trained). "
                        "mismatch/routing_disagreement is logged either way")
    g.add_argument("--disable-grpo-std-normalization", action="store_true", help="Dr.GRPO advantages (no std)")
    g.add_argument("--sft-iters", type=int, default=None,
                   help="supervised warm-up steps before GRPO (default 60 for the tiny preset, 0 with --hf-checkpoint)")
    g.add_argument("--sft-lr", type=float, default=3e-3)
    g.add_argument("--sft-batch-size", type=int, default=64)

    g = p.add_argument_group("precision (spellings of the QuadsRecipe fields; the QuantPlan decides per weight)")
    add_recipe_args(g)

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
    g.add_argument("--sglang-weight-sync", choices=["tensor", "tensor-bf16", "disk"], default="tensor",
                   help="tensor: NVFP4 tensors (quantized on the trainer's GPU, 0.56 B/weight) through "
                        "update_weights_from_tensor; tensor-bf16: BF16 expert weights (2 B/weight), the server "
                        "quantizes them (routed-experts scope only); disk: NVFP4 safetensors in --sglang-sync-dir")
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
    g.add_argument("--resume-allow-change", action="append", default=None, metavar="FLAG[,FLAG]",
                   help="resume although these training flags differ from the checkpoint's (e.g. lr,seq-length); "
                        f"allowed: {', '.join(f.replace('_', '-') for f in RESUME_MAY_CHANGE)}")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    g.add_argument("--summary-json", default=None, help="also write the final summary here")
    return p


def _writable_dir(path: Path) -> str | None:
    """Why a directory cannot be created or written at ``path`` (its nearest existing ancestor decides), or None."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


def check_output_files(args) -> None:
    """--tensorboard-dir and --summary-json can be written: refused now (one line) rather than at the first
    event or after the last step."""
    tb = Path(args.tensorboard_dir)
    if tb.exists() and not tb.is_dir():
        raise ConfigError(f"--tensorboard-dir {tb}: exists and is not a directory")
    why = _writable_dir(tb)
    if why:
        raise ConfigError(f"--tensorboard-dir {tb}: cannot be created ({why})")
    if args.summary_json:
        out = Path(args.summary_json)
        if out.is_dir():
            raise ConfigError(f"--summary-json {out}: is a directory (expected a file path)")
        if not out.parent.is_dir():
            raise ConfigError(f"--summary-json {out}: its directory {out.parent} does not exist")
        if not os.access(out.parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
            raise ConfigError(f"--summary-json {out}: not writable")


def _held_checkpoint(save: str) -> str | None:
    """'iteration N' when ``save`` holds a Megatron-layout checkpoint (tracker or iter_* directories)."""
    from quads_megatron.megatron.checkpoint import TRACKER, read_tracker

    path = Path(save)
    if (path / TRACKER).is_file():
        return f"iteration {read_tracker(path)}"
    iters = sorted(d.name for d in path.glob("iter_*") if d.is_dir() and not d.name.endswith((".tmp", ".old")))
    return f"{iters[-1]}, no {TRACKER}" if iters else None


def check_save_dir_is_ours(save: Path) -> None:
    """--force starts over in --save: refuse unless everything in it is what a GRPO run writes (the tracker,
    ``iter_*`` and ``hf`` directories holding quads_manifest.json, our temporaries), naming the rest."""
    from quads_megatron.integrity import MANIFEST
    from quads_megatron.megatron.checkpoint import TRACKER
    def ours(p: Path) -> bool:
        if p.name == TRACKER or (p.name.startswith(".") and (".partial-" in p.name or ".old-" in p.name)):
            return True
        return (p.name.startswith("iter_") or p.name in ("hf", "release")) and (p / MANIFEST).is_file()

    foreign = [p for p in sorted(save.iterdir()) if not ours(p)]
    if foreign:
        names = ", ".join(repr(p.name + ("/" if p.is_dir() else "")) for p in foreign[:5])
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise CheckpointError(f"--save {save}: --force starts over only in a directory a GRPO run wrote (the tracker, "
                              f"iter_*/ and hf/ with quads_manifest.json), and it also holds {names}{more}: move "
                              "them away yourself or choose another --save")


def check_outputs_not_inputs(args) -> None:
    """--save, --tensorboard-dir and --summary-json must not be, contain or lie inside an input (task file, eval
    data, recipe, initial checkpoint, tokenizer); --save may equal --load (resume)."""
    from quads_megatron.output_dir import check_not_inside_inputs

    task_file = args.task if args.task and Path(args.task).is_file() else None
    inputs = [("--task", task_file), ("--eval-data", args.eval_data), ("--quads-recipe", args.quads_recipe),
              ("--hf-checkpoint", args.hf_checkpoint), ("--tokenizer", args.tokenizer)]
    if args.save:
        check_not_inside_inputs(args.save, inputs, flag="--save")
    if args.tensorboard_dir:
        check_not_inside_inputs(args.tensorboard_dir, inputs, flag="--tensorboard-dir")
    if args.summary_json:
        load = [("--load", args.load)] if args.load else []
        check_not_inside_inputs(args.summary_json, inputs + load, flag="--summary-json")


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


# (flag, lowest allowed, whether the lowest value itself is allowed); None values are skipped
_LOWER_BOUNDS = [
    ("train_iters", 1, True), ("rollout_batch_size", 1, True), ("n_samples_per_prompt", 2, True),
    ("micro_batch_size", 1, True), ("seq_length", 1, True), ("max_new_tokens", 1, True),
    ("log_interval", 1, True), ("eval_interval", 0, True), ("quant_error_interval", 0, True),
    ("sft_iters", 0, True), ("sft_batch_size", 1, True), ("global_batch_size", 1, True),
    ("num_layers", 1, True), ("hidden_size", 1, True), ("num_experts", 1, True), ("moe_router_topk", 1, True),
    ("tensor_model_parallel_size", 1, True), ("expert_model_parallel_size", 1, True),
    ("expert_tensor_parallel_size", 1, True), ("sglang_port", 1, True),
    ("lr", 0.0, True), ("sft_lr", 0.0, True), ("adam_eps", 0.0, False), ("weight_decay", 0.0, True),
    ("clip_grad", 0.0, True), ("temperature", 0.0, True), ("kl_coef", 0.0, True),
    ("eps_clip", 0.0, False), ("eps_clip_high", 0.0, False), ("tis_cap", 0.0, False),
    ("mis_low", 0.0, True), ("mis_high", 0.0, False),
]
# (flag, highest allowed, whether the highest value itself is allowed)
_UPPER_BOUNDS = [("top_p", 1.0, True), ("adam_beta1", 1.0, False), ("adam_beta2", 1.0, False),
                 ("eps_clip", 1.0, False)]


_FLOAT32_MAX = 3.4028234663852886e38


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_ranges(args) -> None:
    """Every numeric flag finite and inside its range; ConfigError naming the flag, the value and the range."""
    for name, lo, inclusive in _LOWER_BOUNDS:
        v = getattr(args, name)
        if v is None:
            continue
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{_flag(name)} {v}: must be a finite number {'>=' if inclusive else '>'} {lo}")
        if v < lo or (v == lo and not inclusive):
            raise ConfigError(f"{_flag(name)} {v}: must be {'>=' if inclusive else '>'} {lo}"
                              + (" (the GRPO group size: advantages compare samples of one prompt)"
                                 if name == "n_samples_per_prompt" else ""))
    for name, hi, inclusive in _UPPER_BOUNDS:
        v = getattr(args, name)
        if v is not None and (v > hi or (v == hi and not inclusive)):
            raise ConfigError(f"{_flag(name)} {v}: must be {'<=' if inclusive else '<'} {hi}")
    if args.top_p <= 0:
        raise ConfigError(f"--top-p {args.top_p}: must be in (0, 1]")
    for name in ("adam_beta1", "adam_beta2"):
        if getattr(args, name) < 0:
            raise ConfigError(f"{_flag(name)} {getattr(args, name)}: must be in [0, 1)")
    for name in ("lr", "sft_lr"):   # Adam's first update is lr / (1 - beta1), a float32 scalar
        first = getattr(args, name) / (1 - args.adam_beta1)
        if first > _FLOAT32_MAX:
            raise ConfigError(f"{_flag(name)} {getattr(args, name)}: too large: Adam's first step size "
                              f"{_flag(name)} / (1 - --adam-beta1) = {first:.3g} exceeds float32's largest value "
                              f"{_FLOAT32_MAX:.3g}")
    if args.mis_low >= args.mis_high:
        raise ConfigError(f"--mis-low {args.mis_low} / --mis-high {args.mis_high}: --mis-low must be below --mis-high")


def check_engine_flags(args) -> None:
    """SGLang flags only with the SGLang engine (a --sglang-url must never be silently ignored)."""
    if args.sglang_launch:
        args.rollout_engine = "sglang"
    if args.rollout_engine != "sglang":
        for name in ("sglang_url", "sglang_router_url", "sglang_sync_dir"):
            value = getattr(args, name)
            if value:
                value = ",".join(value) if isinstance(value, list) else value
                raise ConfigError(f"{_flag(name)} {value}: needs --rollout-engine sglang "
                                  f"(this run uses --rollout-engine {args.rollout_engine})")
    if args.rollout_engine == "sglang" and not args.sglang_url and not args.sglang_launch:
        raise ConfigError("--rollout-engine sglang needs --sglang-url http://HOST:PORT (or --sglang-launch)")
    if args.sglang_url:
        from .engines.sglang_http import parse_urls

        try:
            parse_urls(args.sglang_url)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def check_paths(args) -> None:
    """--hf-checkpoint / --tokenizer / --eval-data name existing paths; --task is well-formed."""
    if args.hf_checkpoint is not None:
        path = Path(args.hf_checkpoint)
        if not path.is_dir():
            raise CheckpointError(f"--hf-checkpoint {path}: no such checkpoint directory")
        if not (path / "config.json").is_file():
            raise CheckpointError(f"--hf-checkpoint {path}: not a Hugging Face checkpoint (no config.json)")
    if args.tokenizer is not None and not Path(args.tokenizer).exists():
        raise ConfigError(f"--tokenizer {args.tokenizer}: no such tokenizer directory")
    from .tasks import check_task_spec

    check_task_spec(args.task, args.eval_data)


def model_dims(args):
    """The model's ``qwen3_moe.Dims`` (from --hf-checkpoint's config.json, else the preset and the shape flags)."""
    from quads_megatron.models import qwen3_moe
    from quads_megatron.megatron.presets import PRESETS

    if args.hf_checkpoint:
        from quads_megatron.convert.hf_checkpoint import HFCheckpoint

        ckpt = HFCheckpoint(args.hf_checkpoint)
        source = str(ckpt.path / "config.json")
        return ckpt.dims(source), qwen3_moe.hf_top_k(ckpt.config, source)
    if args.preset not in PRESETS:
        raise ConfigError(f"--preset {args.preset}: unknown; expected one of {sorted(PRESETS)}")
    t = dict(PRESETS[args.preset]["transformer"])
    for flag, field in (("num_layers", "num_layers"), ("hidden_size", "hidden_size"),
                        ("num_experts", "num_moe_experts"), ("moe_router_topk", "moe_router_topk")):
        if getattr(args, flag) is not None:
            t[field] = getattr(args, flag)
    dims = qwen3_moe.Dims(vocab_size=PRESETS[args.preset]["model"]["vocab_size"], hidden_size=t["hidden_size"],
                          num_layers=t["num_layers"], num_heads=t["num_attention_heads"],
                          num_kv_heads=t["num_query_groups"], head_dim=t["kv_channels"],
                          num_experts=t["num_moe_experts"], moe_ffn=t["moe_ffn_hidden_size"],
                          tie_word_embeddings=False)
    return dims, t["moe_router_topk"]


def check_model(args) -> None:
    """Shapes, top-k, parallel sizes and the recipe's plan (RAC channels, NVFP4 blocks) before any model is built.

    The plan is resolved here exactly as the trainer and the rollout exporter resolve it
    (``QuantPlan.resolve``), so a recipe one of them refuses is refused here, with the same message.
    """
    from quads_megatron.plan import QuantPlan

    from .memory import check_memory

    dims, topk = model_dims(args)
    check_memory(args, dims)   # before the plan: resolving it lists every expert's tensors
    source = f"--hf-checkpoint {args.hf_checkpoint}" if args.hf_checkpoint else f"--preset {args.preset}"
    if topk is not None and topk > dims.num_experts:
        raise ConfigError(f"--moe-router-topk {topk}: must be <= the number of experts ({dims.num_experts}, "
                          f"{'--num-experts' if args.num_experts else source})")
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp
    if dims.num_experts % ep:
        raise ConfigError(f"--expert-model-parallel-size {ep}: must divide the {dims.num_experts} experts of {source}")
    if dims.num_kv_heads % tp or dims.num_heads % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp}: must divide the {dims.num_heads} attention heads "
                          f"and {dims.num_kv_heads} KV heads of {source}")
    try:
        QuantPlan.resolve(args.recipe, dims, tp=tp, etp=etp)
    except ValueError as e:
        raise ConfigError(f"{source} with this recipe: {e}") from None


def check_checkpoint_flags(args, explicit_load: bool) -> None:
    """--save / --load / --resume / --force: never start over silently in a directory holding a checkpoint,
    never resume from a mistyped --load, never resume a checkpoint of another task."""
    if args.resume and not args.save:
        raise ConfigError("--resume needs --save (the directory to resume from)")
    if args.save_interval is not None and not args.save:
        raise ConfigError("--save-interval needs --save")
    if args.save_interval is not None and args.save_interval < 0:
        raise ConfigError(f"--save-interval {args.save_interval}: must be >= 0 (0: save only at the end)")
    if args.force and not args.save:
        raise ConfigError("--force needs --save")
    if args.resume_allow_change and not args.load:
        raise ConfigError("--resume-allow-change needs --load or --resume (it allows changes against a checkpoint)")
    if args.save and Path(args.save).exists() and not Path(args.save).is_dir():
        raise ConfigError(f"--save {args.save}: exists and is not a directory")
    if args.force and args.save and Path(args.save).is_dir():
        check_save_dir_is_ours(Path(args.save))
    held = _held_checkpoint(args.save) if args.save and not args.force else None
    if held is not None and (args.load is None or not _same_dir(args.load, args.save)):
        load = "" if args.load is None else f" (this run loads --load {args.load})"
        raise CheckpointError(f"--save {args.save} already holds a checkpoint ({held}) that this run would not "
                              f"continue from{load}; pass --resume to continue it, a new --save directory, or "
                              "--force to start over and replace it")
    if explicit_load:
        from quads_megatron.megatron.checkpoint import TRACKER

        if not Path(args.load).is_dir():
            raise CheckpointError(f"--load {args.load}: no such checkpoint directory")
        if not (Path(args.load) / TRACKER).is_file():
            raise CheckpointError(f"--load {args.load}: holds no checkpoint (no {TRACKER})")
    if args.load and Path(args.load).is_dir():
        check_resume_matches(args)


# flags that must equal the checkpoint's when resuming: another value trains another model on other data
RESUME_MUST_MATCH = ("task", "eval_data", "preset", "num_layers", "hidden_size", "num_experts", "moe_router_topk")
# flags that change how the run continues: refused unless --resume-allow-change names them (then logged)
RESUME_MAY_CHANGE = ("seq_length", "lr", "n_samples_per_prompt", "rollout_batch_size", "global_batch_size",
                     "micro_batch_size", "max_new_tokens", "temperature", "top_p", "eps_clip", "eps_clip_high",
                     "use_tis", "tis_cap", "use_mis", "mis_low", "mis_high", "kl_coef",
                     "disable_grpo_std_normalization", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay",
                     "clip_grad", "seed", "bf16", "use_rollout_routing_replay")


def _allowed_changes(args) -> set:
    """The flags --resume-allow-change names (comma-separated or repeated), each one of RESUME_MAY_CHANGE."""
    allowed = set()
    for item in args.resume_allow_change or ():
        for name in filter(None, (n.strip().removeprefix("--").replace("-", "_") for n in item.split(","))):
            if name in RESUME_MUST_MATCH:
                raise ConfigError(f"--resume-allow-change {_flag(name)[2:]}: {_flag(name)} must always match the "
                                  "checkpoint (another value trains another model or task)")
            if name not in RESUME_MAY_CHANGE:
                raise ConfigError(f"--resume-allow-change {name.replace('_', '-')}: not a flag of the run's training; "
                                  f"expected some of {', '.join(f.replace('_', '-') for f in RESUME_MAY_CHANGE)}")
            allowed.add(name)
    return allowed


def check_resume_matches(args) -> None:
    """Resume only what was saved: refuse (one line listing every difference) a checkpoint of another --task or
    model shape, changed training flags unless --resume-allow-change names them (each allowed change is
    logged), and a --train-iters below the checkpoint's iteration.  Reads only common.pt."""
    import json

    from quads_megatron.megatron.checkpoint import latest_iteration, load_common_state

    allowed = _allowed_changes(args)
    iteration = latest_iteration(args.load)
    if iteration is None:
        return
    state = load_common_state(args.load).get("grpo_loop")
    if not isinstance(state, dict):
        raise CheckpointError(f"--load {args.load}: not a GRPO checkpoint (no 'grpo_loop' state); "
                              "use --hf-checkpoint for initial weights")
    try:
        saved = json.loads(state.get("args") or "{}")
    except (TypeError, json.JSONDecodeError):
        raise CheckpointError(f"--load {args.load}: the GRPO state's 'args' is not JSON") from None
    if not isinstance(saved, dict):
        raise CheckpointError(f"--load {args.load}: the GRPO state's 'args' is not a JSON object")
    saved.setdefault("task", state.get("task"))

    def differs(name):
        return name in saved and saved[name] != getattr(args, name)

    def shown(name, value):
        return f"{_flag(name)} {value}"

    fixed = [n for n in RESUME_MUST_MATCH if differs(n)]
    changed = [n for n in RESUME_MAY_CHANGE if differs(n)]
    refused = fixed + [n for n in changed if n not in allowed]
    if refused:
        diffs = "; ".join(f"{shown(n, getattr(args, n))} (the checkpoint's: {shown(n, saved[n])})" for n in refused)
        hint = "" if fixed else (f"; to change them on purpose pass --resume-allow-change "
                                 f"{','.join(n.replace('_', '-') for n in refused)}")
        raise ConfigError(f"--load {args.load} was trained with other settings: {diffs}; resume with the checkpoint's "
                  f"values{hint}, or start a new --save")
    if args.train_iters < iteration:
        raise ConfigError(f"--train-iters {args.train_iters}: below the checkpoint's iteration {iteration} in "
                          f"{args.load}; pass --train-iters {iteration + 1} or more to continue it")
    if changed and int(os.environ.get("RANK", 0)) == 0:
        for n in changed:
            print(f"train_grpo_moe: note: resuming {args.load} with {shown(n, getattr(args, n))} (the checkpoint "
                  f"was trained with {shown(n, saved[n])}), allowed by --resume-allow-change", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and cross-check every flag before anything is built; a ConfigError/CheckpointError names the flag."""
    p = build_parser()
    args = p.parse_args(argv)
    explicit_load = args.load is not None
    if args.resume and args.load is None:
        args.load = args.save
    check_ranges(args)
    check_engine_flags(args)
    check_paths(args)
    check_outputs_not_inputs(args)
    check_checkpoint_flags(args, explicit_load)
    args.recipe = recipe_from_args(args)
    if args.rollout_engine == "sglang" and args.sglang_weight_sync == "tensor-bf16" and \
            vocab.Scope.ATTENTION in args.recipe.scope:
        raise ConfigError("--sglang-weight-sync tensor-bf16: the server quantizes routed experts only; with "
                          "--quads-scope attention use --sglang-weight-sync tensor (NVFP4 from the trainer)")
    if args.rollout_engine == "sglang" and args.recipe.rollout_precision.local_only:
        raise ConfigError(f"--rollout-precision {args.recipe.rollout_precision.value}: runs in the local engine only "
                          "(no SGLang checkpoint format); use --rollout-engine local")
    check_model(args)
    if args.sft_iters is None:
        args.sft_iters = 0 if args.hf_checkpoint else 60
    if args.exp_name is None:
        args.exp_name = (f"grpo_{args.preset}_{args.recipe.train_precision.value}_"
                         f"{args.recipe.rollout_precision.value}")
    if args.tensorboard_dir is None:
        args.tensorboard_dir = os.path.join("runs", args.exp_name)
    check_output_files(args)
    return args
