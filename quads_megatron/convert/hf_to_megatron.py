"""``quads-convert-hf-to-megatron``: an HF Qwen3-MoE checkpoint -> Megatron torch_dist, in any TP/EP layout.

Single process by default; for a sharded layout run it under ``torchrun --nproc-per-node N``
with the matching ``--tensor-model-parallel-size`` / ``--expert-model-parallel-size`` (each rank
reads only its own shards).  The result loads into any other layout (dist_checkpointing reshards).
"""

import argparse

import torch

from quads_megatron.convert import cli
from quads_megatron.models import qwen3_moe
from quads_megatron.convert.hf_checkpoint import HFCheckpoint
from quads_megatron.convert.megatron_params import padded_vocab_size
from quads_megatron.output_dir import check_output_path


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="quads-convert-hf-to-megatron", description=__doc__.splitlines()[0])
    p.add_argument("--load-dir", required=True, help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--save-dir", required=True, help="output Megatron torch_dist checkpoint directory")
    p.add_argument("--params-dtype", choices=sorted(cli.DTYPES), default="bf16")
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


def main(argv=None):
    args = parse_args(argv)
    cli.check_parallel_args(args)
    inputs = [("--load-dir", args.load_dir)]
    check_output_path(args.save_dir, force=args.force, inputs=inputs)
    ckpt = HFCheckpoint(args.load_dir)
    dims = qwen3_moe.dims_from_hf_config(ckpt.config, str(ckpt.path / "config.json"))
    qwen3_moe.hf_top_k(ckpt.config, str(ckpt.path / "config.json"))
    cli.check_parallel_args(args, dims)
    ckpt.validate(qwen3_moe.hf_shapes(dims))
    if args.dry_run:
        listing = megatron_listing(ckpt.config, args.tensor_model_parallel_size, args.make_vocab_size_divisible_by)
        for name, shape in listing:
            print(f"{name}  {list(shape)}  {args.params_dtype}")
        print(f"-- {len(listing)} tensors -> torch_dist checkpoint {args.save_dir} "
              f"(TP={args.tensor_model_parallel_size}, EP={args.expert_model_parallel_size})")
        return

    from quads_megatron.convert.hf_to_megatron_weights import load_hf_into_megatron
    from quads_megatron.convert.megatron_checkpoint import build_model_from_hf_config, save_megatron_checkpoint
    from quads_megatron.megatron.parallel import initialize_distributed

    tp, ep, etp = args.tensor_model_parallel_size, args.expert_model_parallel_size, args.expert_tensor_parallel_size
    initialize_distributed(tp=tp, ep=ep, etp=etp)
    model = build_model_from_hf_config(
        ckpt.config, tp=tp, ep=ep, etp=etp, params_dtype=cli.DTYPES[args.params_dtype],
        spec="te" if args.transformer_impl == "transformer_engine" else "local",
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    load_hf_into_megatron(model, ckpt, progress=not args.no_progress and _is_rank0())
    save_megatron_checkpoint(model, args.save_dir, ckpt.config, force=args.force, inputs=inputs)
    if _is_rank0():
        print(f"wrote {args.save_dir}")


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def console_main():
    raise SystemExit(cli.run(main))


if __name__ == "__main__":
    console_main()
