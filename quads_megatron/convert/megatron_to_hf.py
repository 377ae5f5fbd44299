"""``quads-convert-megatron-to-hf``: a Megatron torch_dist Qwen3-MoE checkpoint (any layout) -> HF safetensors.

The checkpoint is loaded into a model of this run's layout (1 process by default; under torchrun
with TP/EP flags each rank loads only its shards) and streamed out through ``iter_hf_weights``:
rank 0 writes size-capped shards, then re-opens the result and checks every tensor against the
config before the temporary directory is renamed onto ``--save-dir``.
"""

import argparse
import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from quads_megatron.convert import cli
from quads_megatron.models import qwen3_moe
from quads_megatron.convert.hf_checkpoint import (TOKENIZER_FILES, HFCheckpoint, ShardedSafetensorsWriter,
                                                  check_finite, check_tokenizer_dir, copy_side_files, format_listing,
                                                  read_json, side_files, write_json)
from quads_megatron.output_dir import atomic_output_dir, claim_output
from quads_megatron.errors import CheckpointError, Interrupted
from quads_megatron.megatron.checkpoint import RECIPE_KEY   # the trainer's common-state key

RECIPE_FILE = "quads_recipe.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="quads-convert-megatron-to-hf", description=__doc__.splitlines()[0])
    p.add_argument("--load-dir", required=True,
                   help="Megatron torch_dist checkpoint, or a Megatron-LM / GRPO --save directory (its latest "
                        "iteration, via latest_checkpointed_iteration.txt)")
    p.add_argument("--save-dir", required=True, help="output HF checkpoint directory")
    p.add_argument("--hf-config", default=None,
                   help="config.json (or its directory) when the checkpoint does not carry one")
    p.add_argument("--preset", choices=("tiny", "qwen3-30b-a3b"), default=None,
                   help="architecture of a trainer checkpoint that carries no HF config (instead of --hf-config)")
    p.add_argument("--tokenizer-dir", default=None,
                   help="copy tokenizer/generation files from this HF directory (default: the save directory's "
                        "hf/, which the GRPO loop writes, when there is one)")
    cli.add_dtype_args(p, "written tensors")
    p.add_argument("--max-shard-size", default="5GB")
    cli.add_parallel_args(p)
    cli.add_output_args(p)
    return p.parse_args(argv)


def load_hf_config(ckpt, hf_config=None, preset=None) -> tuple:
    """``(config, where it came from)``: ``hf_config`` (--hf-config), else ``preset`` (--preset), else the config
    stored in the checkpoint ``ckpt`` (a MegatronCheckpoint; or in its save directory's hf/)."""
    from quads_megatron.convert.megatron_checkpoint import hf_config_from_preset, read_hf_config

    if hf_config:
        path = Path(hf_config)
        path = path / "config.json" if path.is_dir() else path
        return read_json(path, "--hf-config"), f"--hf-config {path}"
    if preset:
        return hf_config_from_preset(preset), f"--preset {preset}"
    stored = ckpt.stored_hf_config()
    if stored is None:
        read_hf_config(ckpt.load_dir)    # raises the error that says what to pass
    return stored, f"the config stored in {ckpt.path}"


def write_hf_checkpoint(weights, hf_config: dict, save_dir, *, dtype: torch.dtype, force=False, dry_run=False,
                        max_shard_bytes: int, tokenizer_dir=None, recipe_json: str | None = None, inputs=(),
                        source="the Megatron checkpoint", flag="--save-dir"):
    """Write ``(name, tensor)`` pairs + config.json as an HF checkpoint, validated before it appears.

    A NaN/Inf tensor is refused by its HF name (``source`` says where it came from).
    ``recipe_json`` (the trainer's QuadsRecipe) is kept as ``quads_recipe.json``, which
    ``quads-export-rollout`` then uses by default.
    """
    dims = qwen3_moe.dims_from_hf_config(hf_config)
    expected = qwen3_moe.hf_shapes(dims)
    config = {**hf_config, "torch_dtype": str(dtype).removeprefix("torch."), "dtype": str(dtype).removeprefix("torch.")}
    if dry_run:
        writer = ShardedSafetensorsWriter(save_dir, max_shard_bytes=max_shard_bytes, dry_run=True)
        for name, t in weights:
            writer.add(name, t)
        print(format_listing(writer.listing, writer.close() + ["config.json"]))
        return None
    with atomic_output_dir(save_dir, force=force, inputs=inputs, flag=flag) as tmp:
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes=max_shard_bytes)
        for name, t in weights:
            if name not in expected:
                raise CheckpointError(f"model produced tensor {name}, which config.json does not describe")
            writer.add(name, check_finite(name, t.to(dtype), source))
        writer.close()
        write_json(tmp / "config.json", config)
        if recipe_json:
            (tmp / RECIPE_FILE).write_text(recipe_json + "\n")
        if tokenizer_dir:
            copy_side_files(tokenizer_dir, tmp, TOKENIZER_FILES)
        with HFCheckpoint(tmp, being_written=True) as written:
            written.validate(expected, dtype=dtype)
    return Path(save_dir)


def convert_megatron_to_hf(load_dir, save_dir, *, hf_config=None, preset: str | None = None, tokenizer_dir=None,
                           dtype: str = "fp32", max_shard_size: str = "5GB", tensor_model_parallel_size: int = 1,
                           expert_model_parallel_size: int = 1, expert_tensor_parallel_size: int | None = None,
                           transformer_impl: str = "local", make_vocab_size_divisible_by: int = 128,
                           force: bool = False, dry_run: bool = False, progress: bool = True) -> Path | None:
    """Convert the torch_dist checkpoint (or GRPO/Megatron-LM ``--save`` directory) ``load_dir`` into an HF
    checkpoint at ``save_dir`` (every rank calls this); returns ``save_dir`` on rank 0, None for ``dry_run``
    and on the other ranks.  ``dtype``: a key of ``cli.DTYPES``; ``tokenizer_dir`` defaults to the save
    directory's ``hf/`` when there is one."""
    from quads_megatron.convert.live import iter_hf_weights
    from quads_megatron.convert.megatron_checkpoint import (MegatronCheckpoint, build_model_from_hf_config,
                                                            hf_side_dir, load_megatron_checkpoint)
    from quads_megatron.megatron.parallel import initialize_distributed

    layout = argparse.Namespace(tensor_model_parallel_size=tensor_model_parallel_size,
                                expert_model_parallel_size=expert_model_parallel_size,
                                expert_tensor_parallel_size=expert_tensor_parallel_size,
                                make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    cli.check_parallel_args(layout)
    max_shard_bytes = cli.parse_size(max_shard_size)
    if tokenizer_dir is not None:
        check_tokenizer_dir(tokenizer_dir)
    elif hf_side_dir(load_dir) is not None:
        tokenizer_dir = hf_side_dir(load_dir)
    inputs = [("--load-dir", load_dir), ("--hf-config", hf_config), ("--tokenizer-dir", tokenizer_dir)]
    claim = contextlib.nullcontext() if dry_run else claim_output(save_dir, force=force, inputs=inputs)
    with claim:
        if tokenizer_dir is not None:
            side_files(tokenizer_dir, TOKENIZER_FILES)   # a side file leading out of its directory: refused now
        # every file and the config's shapes are checked before a model is built
        ckpt = MegatronCheckpoint(load_dir)
        config, source = load_hf_config(ckpt, hf_config, preset)
        tp, ep, etp = tensor_model_parallel_size, expert_model_parallel_size, expert_tensor_parallel_size
        ckpt.check_config(config, source, tp=tp, divisible_by=make_vocab_size_divisible_by)
        dims = qwen3_moe.dims_from_hf_config(config, source)
        cli.check_parallel_args(layout, dims)
        initialize_distributed(tp=tp, ep=ep, etp=etp)
        rank0 = dist.get_rank() == 0
        # params in the output dtype: the checkpoint's values are cast once, on load (fp32 output of an fp32
        # trainer checkpoint is exact)
        model = build_model_from_hf_config(
            config, tp=tp, ep=ep, etp=etp, spec="te" if transformer_impl == "transformer_engine" else "local",
            params_dtype=cli.DTYPES[dtype], make_vocab_size_divisible_by=make_vocab_size_divisible_by)
        load_megatron_checkpoint(model, ckpt.path)
        recipe_json = ckpt.common.get(RECIPE_KEY) if rank0 else None
        weights = iter_hf_weights(model, vocab_size=dims.vocab_size, progress=rank0 and progress)
        out = None
        if rank0:
            try:
                out = write_hf_checkpoint(weights, config, save_dir, dtype=cli.DTYPES[dtype], force=force,
                                          dry_run=dry_run, max_shard_bytes=max_shard_bytes,
                                          tokenizer_dir=tokenizer_dir, recipe_json=recipe_json, inputs=inputs,
                                          source=str(ckpt.path))
            except Interrupted:
                raise                # every rank got the signal: no gathers to keep going
            except BaseException:
                for _ in weights:  # keep the other ranks' gathers going so they exit instead of hanging
                    pass
                raise
        else:
            for _ in weights:  # take part in the gathers
                pass
        dist.barrier()
        return out


def main(argv=None):
    args = parse_args(argv)
    out = convert_megatron_to_hf(
        args.load_dir, args.save_dir, hf_config=args.hf_config, preset=args.preset, tokenizer_dir=args.tokenizer_dir,
        dtype=cli.params_dtype(args), max_shard_size=args.max_shard_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size, transformer_impl=args.transformer_impl,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, force=args.force, dry_run=args.dry_run,
        progress=not args.no_progress)
    if out is not None:
        print(f"wrote {out}")


def console_main():
    raise SystemExit(cli.run(main))


if __name__ == "__main__":
    console_main()
