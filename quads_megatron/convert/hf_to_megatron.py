"""``quads-convert-hf-to-megatron``: an HF Qwen3-MoE checkpoint -> Megatron torch_dist, in any TP/EP layout.

Single process by default; for a sharded layout run it under ``torchrun --nproc-per-node N``
with the matching ``--tensor-model-parallel-size`` / ``--expert-model-parallel-size`` (each rank
reads only its own shards).  The result loads into any other layout (dist_checkpointing reshards).
"""

import argparse
import contextlib
from pathlib import Path

import torch

from quads_megatron.convert import cli
from quads_megatron.models import qwen3_moe
from quads_megatron.convert.hf_checkpoint import HFCheckpoint
from quads_megatron.convert.megatron_params import padded_vocab_size
from quads_megatron.errors import ConfigError
from quads_megatron.output_dir import claim_output


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="quads-convert-hf-to-megatron", description=__doc__.splitlines()[0])
    p.add_argument("--load-dir", required=True, help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--save-dir", required=True, help="output Megatron torch_dist checkpoint directory")
    cli.add_dtype_args(p, "parameters and saved tensors")
    cli.add_parallel_args(p)
    cli.add_output_args(p)
    return p.parse_args(argv)


def megatron_listing(hf_config: dict, tp: int = 1, divisible_by: int = 128) -> list:
    """``(global Megatron name, full shape)`` of every tensor the checkpoint will hold (shape-only)."""
    dims = qwen3_moe.dims_from_hf_config(hf_config)
    hf = qwen3_moe.hf_shapes(dims)
    rows = padded_vocab_size(dims.vocab_size, tp, divisible_by)
    out = []
    for rule, layer, expert in qwen3_moe.iter_rule_instances(dims):
        metas = [torch.empty(hf[n], device="meta") for n in qwen3_moe.hf_names(rule, layer, expert)]
        full = qwen3_moe.to_megatron(rule, metas, dims, rows=rows)
        out.append((qwen3_moe.megatron_name(rule, layer, expert), tuple(full.shape)))
    return out


def convert_hf_to_megatron(load_dir, save_dir, *, params_dtype: str = "fp32", tensor_model_parallel_size: int = 1,
                           expert_model_parallel_size: int = 1, expert_tensor_parallel_size: int | None = None,
                           transformer_impl: str = "local", make_vocab_size_divisible_by: int = 128,
                           force: bool = False, dry_run: bool = False, progress: bool = True) -> Path | None:
    """Convert the HF checkpoint ``load_dir`` into a torch_dist checkpoint at ``save_dir`` (every rank calls
    this; under torchrun with the layout of the parallel sizes); returns ``save_dir``, None for ``dry_run``
    (the tensor listing is printed).  ``save_dir`` is claimed before the model is built (``claim_output``)."""
    layout = argparse.Namespace(tensor_model_parallel_size=tensor_model_parallel_size,
                                expert_model_parallel_size=expert_model_parallel_size,
                                expert_tensor_parallel_size=expert_tensor_parallel_size,
                                make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    cli.check_parallel_args(layout)
    if params_dtype not in cli.DTYPES:
        raise ConfigError(f"--bf16/--fp16: params dtype {params_dtype!r}, expected one of {sorted(cli.DTYPES)}")
    inputs = [("--load-dir", load_dir)]
    claim = contextlib.nullcontext() if dry_run else claim_output(save_dir, force=force, inputs=inputs)
    with claim:
        ckpt = HFCheckpoint(load_dir)
        dims = ckpt.dims()   # layer / expert counts checked against the tensors present, before anything is built
        qwen3_moe.hf_top_k(ckpt.config, str(ckpt.path / "config.json"))
        cli.check_parallel_args(layout, dims)
        ckpt.validate(qwen3_moe.hf_shapes(dims))
        tp, ep = tensor_model_parallel_size, expert_model_parallel_size
        if dry_run:
            listing = megatron_listing(ckpt.config, tp, make_vocab_size_divisible_by)
            for name, shape in listing:
                print(f"{name}  {list(shape)}  {params_dtype}")
            print(f"-- {len(listing)} tensors -> torch_dist checkpoint {save_dir} (TP={tp}, EP={ep})")
            return None

        from quads_megatron.convert.hf_to_megatron_weights import load_hf_into_megatron
        from quads_megatron.convert.megatron_checkpoint import build_model_from_hf_config, save_megatron_checkpoint
        from quads_megatron.megatron.parallel import initialize_distributed

        etp = expert_tensor_parallel_size
        initialize_distributed(tp=tp, ep=ep, etp=etp)
        model = build_model_from_hf_config(
            ckpt.config, tp=tp, ep=ep, etp=etp, params_dtype=cli.DTYPES[params_dtype],
            spec="te" if transformer_impl == "transformer_engine" else "local",
            make_vocab_size_divisible_by=make_vocab_size_divisible_by)
        load_hf_into_megatron(model, ckpt, progress=progress and _is_rank0())
        return save_megatron_checkpoint(model, save_dir, ckpt.config, force=force, inputs=inputs)


def main(argv=None):
    args = parse_args(argv)
    out = convert_hf_to_megatron(
        args.load_dir, args.save_dir, params_dtype=cli.params_dtype(args),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size, transformer_impl=args.transformer_impl,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, force=args.force, dry_run=args.dry_run,
        progress=not args.no_progress)
    if out is not None and _is_rank0():
        print(f"wrote {out}")


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def console_main():
    raise SystemExit(cli.run(main))


if __name__ == "__main__":
    console_main()
