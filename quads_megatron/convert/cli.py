"""Shared argparse flags and the error/signal handling of the three conversion commands."""

import argparse
import sys

import torch

from quads_megatron.errors import run_cli

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a plain byte count -> bytes (HF ``max_shard_size`` spelling)."""
    units = {"KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    t = text.strip().upper()
    for unit, factor in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * factor)
    return int(t)


def add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true", help="replace an existing --save-dir")
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


def run(main, argv=None) -> int:
    """Run a converter's ``main(argv)`` through the project's one error path (``quads_megatron.errors.run_cli``)."""
    import os

    return run_cli(main, argv, prog=os.path.basename(sys.argv[0]) or "quads-convert")
