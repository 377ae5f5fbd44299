"""``quads-export-rollout``: an HF (BF16) Qwen3-MoE checkpoint -> the NVFP4 rollout checkpoint SGLang loads.

``--format quads`` (default) writes what ``--quantization quads`` reads (schema:
``sglang_ext.checkpoint_format``): the recipe's scope (routed experts) in ModelOpt NVFP4 tensors
per expert projection (``weight`` uint8, ``weight_scale`` e4m3, ``weight_scale_2`` fp32 -- gate
and up sharing it -- and ``input_scale`` fp32), the RAC channel sets as int32
``input_comp_index``, everything else BF16 as it was; config.json gets ``quantization_config``
with ``quant_method: "quads"`` and ``hf_quant_config.json`` the ModelOpt-style summary.
``--format modelopt`` writes a plain ModelOpt NVFP4 (W4A4, ``quant_algo: NVFP4``) checkpoint that
stock SGLang / vLLM load as ``modelopt_fp4``.  All NVFP4 numbers come from ``quads_megatron.nvfp4``,
so dequantizing a weight gives exactly the trainer's ``fake_quantize`` of it.
"""

import argparse
import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from quads_megatron import nvfp4
from quads_megatron.convert import cli, qwen3_moe
from quads_megatron.convert.calibration import calibrate, load_prompts, random_prompts
from quads_megatron.convert.errors import CheckpointError
from quads_megatron.convert.hf_checkpoint import HFCheckpoint, ShardedSafetensorsWriter, format_listing, write_json
from quads_megatron.convert.megatron_to_hf import RECIPE_FILE, TOKENIZER_FILES
from quads_megatron.convert.nvfp4_export import (expert_input_scale, modelopt_tensors, quantize_linears,
                                                 scope_from_recipe)
from quads_megatron.convert.output_dir import atomic_output_dir, check_output_path

FORMATS = ("quads", "modelopt")
PRODUCER = {"name": "quads-megatron", "version": "0.1.0"}
# recipe.activation_scaling -> checkpoint activation_scaling
_SCALING = {"per_token": "per_token", "per_tensor": "static"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="quads-export-rollout", description=__doc__.splitlines()[0])
    p.add_argument("--load-dir", required=True, help="HF checkpoint directory (BF16)")
    p.add_argument("--save-dir", required=True, help="output rollout checkpoint directory")
    p.add_argument("--format", choices=FORMATS, default="quads")
    p.add_argument("--recipe", default=None,
                   help="QuadsRecipe JSON file (default: --load-dir/quads_recipe.json if present, else QuadsRecipe())")
    p.add_argument("--activation-mode", choices=("w4a4_rac", "w4a4", "w4a16"), default="w4a4_rac",
                   help="--format quads only; modelopt is always w4a4 with static input_scale")
    p.add_argument("--activation-scaling", choices=("per_token", "static"), default=None,
                   help="default: the recipe's (per_tensor -> static)")
    p.add_argument("--rac-channels", type=int, default=64, help="compensation channels k (multiple of 16)")
    p.add_argument("--calib-data", default=None,
                   help=".txt (a prompt per line) or .jsonl ('text'/'prompt'); default: random tokens (tiny models)")
    p.add_argument("--calib-size", type=int, default=64, help="number of calibration prompts")
    p.add_argument("--calib-seq-len", type=int, default=256, help="tokens per calibration prompt (truncated)")
    p.add_argument("--device", default="cpu",
                   help="where calibration and quantization run (cuda: Triton NVFP4 kernels, bit-identical)")
    p.add_argument("--tokenizer-dir", default=None, help="tokenizer for --calib-data (default: --load-dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", default="5GB")
    cli.add_output_args(p)
    return p.parse_args(argv)


def resolve_settings(args, recipe) -> dict:
    """The activation side of the export: mode, scaling, k."""
    if args.format == "modelopt":
        return dict(activation_mode="w4a4", activation_scaling="static", rac_num_channels=0)
    scaling = args.activation_scaling or _SCALING[recipe.activation_scaling]
    k = args.rac_channels if args.activation_mode == "w4a4_rac" else 0
    if args.activation_mode == "w4a4_rac" and (k <= 0 or k % nvfp4.BLOCK_SIZE):
        raise CheckpointError(f"--rac-channels {k}: w4a4_rac needs a positive multiple of {nvfp4.BLOCK_SIZE}")
    return dict(activation_mode=args.activation_mode, activation_scaling=scaling, rac_num_channels=k)


def rollout_specs(dims, scope, settings) -> tuple:
    """``({name: shape}, {name: dtype})`` of every tensor of the rollout checkpoint (dtype None: as in HF)."""
    shapes, dtypes = {}, {}
    hf = qwen3_moe.hf_shapes(dims)
    a4 = settings["activation_mode"] != "w4a16"
    k = settings["rac_num_channels"]
    for rule, layer, expert in qwen3_moe.iter_rule_instances(dims):
        for name in qwen3_moe.hf_names(rule, layer, expert):
            if not scope.quantizes(rule, layer):
                shapes[name] = hf[name]
                continue
            N, K = hf[name]
            base = name[: -len(".weight")]
            entries = {"weight": ((N, K // 2), torch.uint8), "weight_scale": ((N, K // 16), torch.float8_e4m3fn),
                       "weight_scale_2": ((), torch.float32)}
            if a4:
                entries["input_scale"] = ((), torch.float32)
            if k:
                entries["input_comp_index"] = ((k,), torch.int32)
            for suffix, (shape, dtype) in entries.items():
                shapes[f"{base}.{suffix}"], dtypes[f"{base}.{suffix}"] = shape, dtype
    return shapes, dtypes


def _expert_layer(ckpt, dims, scope, layer, settings, calib, device):
    """Yield the NVFP4 tensors of every expert of one layer (+ input_scale / input_comp_index).

    The whole layer is quantized first because the RAC channel ranking needs all its experts'
    quantized weights (fc1 shares one set across experts).
    """
    prefix = f"model.layers.{layer}.mlp.experts"
    projs = ("gate_proj", "up_proj", "down_proj")
    quantized = []
    for e in range(dims.num_experts):
        gate, up, down = (ckpt.get(f"{prefix}.{e}.{p}.weight").to(device) for p in projs)
        quantized.append(quantize_linears([gate, up], scope.block_shape) + quantize_linears([down], scope.block_shape))
    a4 = settings["activation_mode"] != "w4a16"
    k = settings["rac_num_channels"]
    if k:
        w13 = torch.stack([torch.cat([g.dequantize(torch.float32), u.dequantize(torch.float32)])
                           for g, u, _ in quantized])
        w2 = torch.stack([d.dequantize(torch.float32) for _, _, d in quantized])
        fc1_idx, fc2_idx = calib[layer].comp_indices(w13.cpu(), w2.cpu(), k)
    for e, qs in enumerate(quantized):
        for proj, q in zip(projs, qs):
            name = f"{prefix}.{e}.{proj}"
            yield from modelopt_tensors(f"{name}.weight", q)
            if not a4:
                continue
            fc1 = proj != "down_proj"
            c = calib[layer]
            yield f"{name}.input_scale", expert_input_scale(c.fc1_amax if fc1 else c.fc2_amax[e])
            if k:
                yield f"{name}.input_comp_index", (fc1_idx if fc1 else fc2_idx[e]).to(torch.int32).contiguous().clone()


def rollout_tensors(ckpt, dims, scope, settings, calib, device="cpu"):
    """Yield every ``(name, tensor)`` of the rollout checkpoint, one layer's experts at a time."""
    done_layers = set()
    for rule, layer, expert in qwen3_moe.iter_rule_instances(dims):
        if not scope.quantizes(rule, layer):
            for name in qwen3_moe.hf_names(rule, layer, expert):
                yield name, ckpt.get(name)
        elif layer not in done_layers:
            done_layers.add(layer)
            yield from _expert_layer(ckpt, dims, scope, layer, settings, calib, device)


def quant_configs(fmt: str, settings: dict, exclude: list, recipe, calib_info: dict) -> tuple:
    """``(config.json quantization_config, hf_quant_config.json)`` for the chosen format."""
    summary = {"producer": PRODUCER,
               "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": nvfp4.BLOCK_SIZE,
                                "exclude_modules": list(exclude)}}
    if fmt == "modelopt":
        # config.json form ModelOpt's exporter writes next to hf_quant_config.json.
        group = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": nvfp4.BLOCK_SIZE}
        qc = {"config_groups": {"group_0": {"input_activations": dict(group), "weights": dict(group),
                                            "targets": ["Linear"]}},
              "ignore": list(exclude), "quant_algo": "NVFP4", "producer": PRODUCER, "quant_method": "modelopt"}
        return qc, summary
    from sglang_ext.checkpoint_format import QuadsSettings

    qc = QuadsSettings(exclude_modules=list(exclude), **settings).to_quantization_config()
    qc.update(producer=PRODUCER, recipe=recipe.to_dict(), calibration=calib_info)
    return qc, {**summary, "quads": qc}


def export_rollout(args) -> Path | None:
    from quads_megatron.recipe import QuadsRecipe

    recipe_path = Path(args.recipe) if args.recipe else Path(args.load_dir) / RECIPE_FILE
    if args.recipe and not recipe_path.is_file():
        raise CheckpointError(f"--recipe {recipe_path}: file not found")
    try:
        recipe = QuadsRecipe.from_json(recipe_path.read_text()) if recipe_path.is_file() else QuadsRecipe()
    except ValueError as e:
        raise CheckpointError(f"{recipe_path}: not a valid QuadsRecipe ({e})") from None
    if not args.dry_run:
        check_output_path(args.save_dir, force=args.force)
    ckpt = HFCheckpoint(args.load_dir)
    dims = qwen3_moe.dims_from_hf_config(ckpt.config)
    ckpt.validate(qwen3_moe.hf_shapes(dims))
    scope = scope_from_recipe(recipe, dims)
    settings = resolve_settings(args, recipe)
    k = settings["rac_num_channels"]
    if k > min(dims.hidden_size, dims.moe_ffn):
        raise CheckpointError(f"--rac-channels {k}: more than the expert inputs have (hidden_size="
                              f"{dims.hidden_size}, moe_intermediate_size={dims.moe_ffn})")
    shapes, dtypes = rollout_specs(dims, scope, settings)
    max_bytes = cli.parse_size(args.max_shard_size)
    if args.dry_run:
        writer = ShardedSafetensorsWriter(args.save_dir, max_shard_bytes=max_bytes, dry_run=True)
        for name, shape in shapes.items():
            dtype = dtypes.get(name) or ckpt.dtype(name)
            writer.add(name, torch.empty(shape, dtype=dtype, device="meta"))
        print(format_listing(writer.listing, writer.close() + ["config.json", "hf_quant_config.json"]))
        return None

    calib, calib_info = {}, {}
    if settings["activation_mode"] != "w4a16":
        calib, calib_info = run_calibration(args, dims, settings)
    qc, summary = quant_configs(args.format, settings, scope.exclude_modules(dims), recipe, calib_info)
    with atomic_output_dir(args.save_dir, force=args.force) as tmp:
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes=max_bytes)
        for name, t in tqdm(rollout_tensors(ckpt, dims, scope, settings, calib, args.device), total=len(shapes),
                            desc=f"export {args.format}", disable=args.no_progress, unit="tensor"):
            writer.add(name, t)
        writer.close()
        write_json(tmp / "config.json", {**ckpt.config, "quantization_config": qc})
        write_json(tmp / "hf_quant_config.json", summary)
        for f in TOKENIZER_FILES:
            if (Path(args.load_dir) / f).is_file():
                shutil.copy2(Path(args.load_dir) / f, tmp / f)
        with HFCheckpoint(tmp) as written:
            written.validate(shapes, dtypes=dtypes, what="the rollout format")
    return Path(args.save_dir)


def run_calibration(args, dims, settings):
    """Calibrate input amax (and RAC channels) with the BF16 HF model on the calibration prompts."""
    from transformers import Qwen3MoeForCausalLM

    if args.calib_data:
        prompts = load_prompts(args.calib_data, args.tokenizer_dir or args.load_dir,
                               num_samples=args.calib_size, seq_len=args.calib_seq_len)
        source = str(args.calib_data)
    else:
        print(f"quads-export-rollout: no --calib-data; calibrating on {args.calib_size} random token "
              "sequences (only meaningful for tiny test models)")
        prompts = random_prompts(dims.vocab_size, num_samples=args.calib_size, seq_len=args.calib_seq_len,
                                 seed=args.seed)
        source = f"random(seed={args.seed})"
    model = Qwen3MoeForCausalLM.from_pretrained(args.load_dir, dtype=torch.bfloat16).to(args.device)
    calib = calibrate(model, prompts, rac_stats=settings["rac_num_channels"] > 0,
                      static_scaling=settings["activation_scaling"] == "static", progress=not args.no_progress)
    del model
    info = {"source": source, "num_samples": len(prompts), "num_tokens": int(sum(p.numel() for p in prompts))}
    return calib, info


def main(argv=None):
    out = export_rollout(parse_args(argv))
    if out is not None:
        print(f"wrote {out}")


def console_main():
    raise SystemExit(cli.run(main))


if __name__ == "__main__":
    console_main()
