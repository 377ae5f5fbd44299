"""Shared argparse flags, their up-front checks, and the error/signal handling of the three conversion commands."""

import argparse
import os
import sys

import torch

from quads_megatron.errors import ConfigError, run_cli

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_UNITS = {"KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}


def parse_size(text: str, flag: str = "--max-shard-size") -> int:
    """'5GB', '500MB', '2GiB' or a plain byte count -> bytes (HF ``max_shard_size`` spelling); ConfigError otherwise."""
    t = str(text).strip().upper()
    factor = 1
    for unit, f in _UNITS.items():
        if t.endswith(unit):
            t, factor = t[: -len(unit)].strip(), f
            break
    try:
        size = int(float(t) * factor)
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected a size such as 5GB, 500MB, 2GiB or a byte count") from None
    if size <= 0:
        raise ConfigError(f"{flag} {text!r}: must be positive")
    return size


def check_positive(**flags) -> None:
    """ConfigError for the first ``--flag-name=value`` (given as flag_name=value) that is not a positive int."""
    for name, value in flags.items():
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be a positive integer")


def add_dtype_args(parser: argparse.ArgumentParser, what: str) -> None:
    """Megatron's dtype flags: ``--bf16`` or ``--fp16``, neither = fp32 (``params_dtype(args)`` reads them)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--bf16", action="store_true", help=f"BF16 {what} (Megatron's flag; neither: fp32)")
    group.add_argument("--fp16", action="store_true", help=f"FP16 {what} (Megatron's flag; neither: fp32)")


def params_dtype(args) -> str:
    """``"bf16"``, ``"fp16"`` or ``"fp32"`` from ``add_dtype_args``' flags (a key of ``DTYPES``)."""
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true",
                        help="replace an existing --save-dir this project wrote (with quads_manifest.json) or an empty one")
    parser.add_argument("--dry-run", action="store_true", help="list what would be written; write nothing")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """Megatron's layout flags; the world size (torchrun --nproc-per-node) must fit them."""
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--expert-model-parallel-size", type=int, default=1)
    parser.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                        help="default: --tensor-model-parallel-size (Megatron's default)")
    parser.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128)


def world_size() -> int:
    """The process count torchrun launched (1 for a plain process)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return 1


def check_parallel_args(args, dims=None) -> None:
    """Positive layout flags that fit the world size and, given ``dims`` (qwen3_moe.Dims), the model."""
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size
    check_positive(tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                   make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    etp = etp or tp
    world = world_size()
    if world % tp or world % (etp * ep):
        hint = " (run it under torchrun --nproc-per-node N)" if world == 1 else ""
        raise ConfigError(f"--tensor-model-parallel-size {tp} / --expert-model-parallel-size {ep} / "
                          f"--expert-tensor-parallel-size {etp}: do not fit {world} process(es){hint}")
    if dims is None:
        return
    for what, n, by, flag in (("num_attention_heads", dims.num_heads, tp, "tensor-model-parallel-size"),
                              ("num_key_value_heads", dims.num_kv_heads, tp, "tensor-model-parallel-size"),
                              ("num_experts", dims.num_experts, ep, "expert-model-parallel-size"),
                              ("moe_intermediate_size", dims.moe_ffn, etp, "expert-tensor-parallel-size")):
        if n % by:
            raise ConfigError(f"--{flag} {by}: does not divide the model's {what}={n}")


def run(main, argv=None) -> int:
    """Run a converter's ``main(argv)`` through the project's one error path (``quads_megatron.errors.run_cli``)."""
    return run_cli(main, argv, prog=os.path.basename(sys.argv[0]) or "quads-convert")
