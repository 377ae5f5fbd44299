"""``quads-export-rollout``: an HF (BF16) Qwen3-MoE checkpoint -> the NVFP4 rollout checkpoint SGLang loads.

``--format quads`` (default) writes what ``--quantization quads`` reads (schema:
``quads_megatron.plan.rollout_schema``): the weights the ``QuantPlan`` marks NVFP4 (routed experts,
and attention when the recipe's scope has it) as ModelOpt tensors (``weight`` uint8,
``weight_scale`` e4m3, ``weight_scale_2`` fp32 -- gate+up and q+k+v sharing it -- and
``input_scale`` fp32), the RAC channel sets as int32 ``input_comp_index``, everything else as it
was; config.json gets ``quantization_config`` with ``quant_method: "quads"`` and
``hf_quant_config.json`` the ModelOpt-style summary.
``--format modelopt`` writes a plain ModelOpt NVFP4 (W4A4, ``quant_algo: NVFP4``) checkpoint that
stock SGLang / vLLM load as ``modelopt_fp4``.  All NVFP4 numbers come from ``quads_megatron.nvfp4``,
so dequantizing a weight gives exactly the trainer's ``fake_quantize`` of it.  Tensor names, shapes and dtypes
come from the plan's rollout layout (``plan.layout``); ``input_scale`` and ``input_comp_index`` from the plan's
one calibration (``plan.calibration``) run on the rollout model built from these weights
(``quads_megatron.rollout.RolloutModel``), so the local engine, calibrating itself on the same prompts,
holds the same numbers.
"""

import argparse
import contextlib
from pathlib import Path

import torch
from tqdm import tqdm

from quads_megatron import nvfp4, vocab
from quads_megatron.convert import cli
from quads_megatron.models import qwen3_moe
from quads_megatron.convert.calibration import load_prompts, random_prompts
from quads_megatron.convert.hf_checkpoint import (TOKENIZER_FILES, HFCheckpoint, ShardedSafetensorsWriter,
                                                  check_finite, check_tokenizer_dir, copy_side_files, format_listing,
                                                  side_files,
                                                  write_json)
from quads_megatron.device import resolve_device
from quads_megatron.errors import CheckpointError, ConfigError
from quads_megatron.convert.megatron_to_hf import RECIPE_FILE
from quads_megatron.output_dir import atomic_output_dir, claim_output
from quads_megatron.plan import QuantPlan, quantize_scale_groups
from quads_megatron.plan.layout import NVFP4_WEIGHT_KEYS, RolloutLayout, modelopt_names
from quads_megatron.recipe import add_recipe_args
from quads_megatron.rollout import CALIBRATION_DTYPE, RolloutModel
from quads_megatron.vocab import ActivationScaling, Precision

FORMATS = ("quads", "modelopt")
PRODUCER = {"name": "quads-megatron", "version": "0.1.0"}
_ROLLOUT_PRECISIONS = [p for p in vocab.precision_choices() if vocab.parse_precision(p).quantizes_weights]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="quads-export-rollout", description=__doc__.splitlines()[0])
    p.add_argument("--load-dir", required=True, help="HF checkpoint directory (BF16)")
    p.add_argument("--save-dir", required=True, help="output rollout checkpoint directory")
    p.add_argument("--format", choices=FORMATS, default="quads")
    add_recipe_args(p, train=False, scope=False, rollout_choices=_ROLLOUT_PRECISIONS,
                    recipe_help="QuadsRecipe JSON file (default: --load-dir/quads_recipe.json if present, else "
                                "QuadsRecipe()); --format modelopt is always w4a4 with static input_scale")
    p.add_argument("--calib-data", default=None,
                   help=".txt (a prompt per line) or .jsonl ('text'/'prompt'); default: random tokens (tiny models)")
    p.add_argument("--calib-size", type=int, default=64, help="number of calibration prompts")
    p.add_argument("--calib-seq-len", type=int, default=None,
                   help="tokens per calibration prompt (longer ones are cut); at most the model's "
                        "max_position_embeddings, default: 256 or that limit when smaller")
    p.add_argument("--device", default="cpu",
                   help="where calibration and quantization run (cuda: Triton NVFP4 kernels, bit-identical)")
    p.add_argument("--tokenizer-dir", default=None, help="tokenizer for --calib-data (default: --load-dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", default="5GB")
    cli.add_output_args(p)
    return p.parse_args(argv)


def load_recipe(args):
    """The recipe (``recipe_from_args``): --quads-recipe (a file, or a QuadsRecipe given to ``export_rollout``),
    else --load-dir/quads_recipe.json, else the default; the precision flags override it."""
    from quads_megatron.recipe import QuadsRecipe, recipe_from_args

    given = args.quads_recipe
    flags = argparse.Namespace(**{**vars(args), "quads_recipe": None if isinstance(given, QuadsRecipe) else given})
    recipe = recipe_from_args(flags, base=given if isinstance(given, QuadsRecipe) else None,
                              default_file=Path(args.load_dir) / RECIPE_FILE)
    if args.format == "modelopt":
        return recipe.replace(rollout_precision=Precision.W4A4, activation_scaling=ActivationScaling.STATIC)
    return recipe


def rollout_specs(plan: QuantPlan) -> tuple:
    """``({name: shape}, {name: dtype})`` of every tensor of the rollout checkpoint (dtype None: as in HF)."""
    return RolloutLayout(plan).tensor_specs(qwen3_moe.hf_shapes(plan.dims))


def _layer_names(dims):
    """HF weight names in checkpoint order, grouped: (None, names) for model-level, (layer, names) per layer."""
    groups, current = [], None
    for rule, layer, expert in qwen3_moe.iter_rule_instances(dims):
        if current is None or current[0] != layer:
            current = (layer, [])
            groups.append(current)
        current[1].extend(qwen3_moe.hf_names(rule, layer, expert))
    return groups


def rollout_tensors(ckpt, plan: QuantPlan, calibration, device="cpu"):
    """Yield every ``(name, tensor)`` of the rollout checkpoint, one layer at a time: the NVFP4 triples of
    the plan's weights, their activation-side tensors from ``calibration`` (``plan.calibration.Calibration``,
    None when the rollout keeps activations high precision), everything else as it is."""
    for _layer, names in _layer_names(plan.dims):
        stream = ((n, ckpt.get(n).to(device)) for n in names)
        for ns, ts, qs in quantize_scale_groups(stream, plan):
            if qs is None:
                yield ns[0], ts[0]
                continue
            for name, q in zip(ns, qs):
                t = plan[name]
                triple = q.to_modelopt()
                for out, key in zip(modelopt_names(name), NVFP4_WEIGHT_KEYS):
                    yield out, triple[key]
                if t.rollout.quantizes_activations:
                    for suffix, value in calibration.for_weight(name).items():
                        yield f"{t.module}.{suffix}", value


def quant_configs(fmt: str, plan: QuantPlan, calib_info: dict) -> tuple:
    """``(config.json quantization_config, hf_quant_config.json)`` for the chosen format."""
    exclude = plan.exclude_modules()
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
    qc = plan.rollout_config().to_quantization_config()
    qc.update(producer=PRODUCER, recipe=plan.recipe.to_dict(), calibration=calib_info)
    return qc, {**summary, "quads": qc}


def check_args(args) -> list:
    """Flag checks before anything is read; returns the ``(flag, path)`` inputs the output must not overlap."""
    cli.check_positive(calib_size=args.calib_size, calib_seq_len=args.calib_seq_len)
    if args.rac_channels is not None and args.rac_channels < 0:
        raise ConfigError(f"--rac-channels {args.rac_channels}: must be >= 0")
    resolve_device(args.device, what="--device")
    cli.parse_size(args.max_shard_size)
    if args.format == "modelopt":   # ModelOpt NVFP4 is W4A4 with static input scales, no RAC: nothing else fits
        precision = args.rollout_precision and vocab.parse_precision(args.rollout_precision, "--rollout-precision")
        for flag, value, same, fits in (
                ("--rollout-precision", args.rollout_precision, precision is Precision.W4A4, "w4a4"),
                ("--activation-scaling", args.activation_scaling,
                 args.activation_scaling == ActivationScaling.STATIC.value, ActivationScaling.STATIC.value),
                ("--rac-channels", args.rac_channels, args.rac_channels == 0, 0)):
            if value is not None and not same:
                raise ConfigError(f"{flag} {value}: --format modelopt cannot express it (ModelOpt NVFP4 is W4A4 "
                                  f"with static input scales and no RAC: {flag} {fits}); use --format quads")
    if args.tokenizer_dir is not None:
        check_tokenizer_dir(args.tokenizer_dir)
    return [("--load-dir", args.load_dir), ("--tokenizer-dir", args.tokenizer_dir),
            ("--calib-data", args.calib_data),
            ("--quads-recipe", args.quads_recipe if isinstance(args.quads_recipe, (str, Path)) else None)]


def check_calibration_fits(args, config: dict, source: str) -> None:
    """Settle --calib-seq-len: at most the model's max_position_embeddings (positions past it are outside
    what RoPE was trained on); default 256 or that limit."""
    limit = config.get("max_position_embeddings")
    limit = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None
    if args.calib_seq_len is None:
        args.calib_seq_len = min(256, limit or 256)
    elif limit is not None and args.calib_seq_len > limit:
        raise ConfigError(f"--calib-seq-len {args.calib_seq_len}: longer than the model's max_position_embeddings="
                          f"{limit} ({source})")


def export_rollout(load_dir, save_dir, *, fmt: str = "quads", recipe=None, rollout_precision=None,
                   activation_scaling=None, rac_channels: int | None = None, calib_data=None, calib_size: int = 64,
                   calib_seq_len: int | None = None, device: str = "cpu", tokenizer_dir=None, seed: int = 0,
                   max_shard_size: str = "5GB", force: bool = False, dry_run: bool = False,
                   progress: bool = True) -> Path | None:
    """Export the HF checkpoint ``load_dir`` as a rollout checkpoint at ``save_dir`` (``fmt`` "quads" or
    "modelopt"); returns ``save_dir`` (None for ``dry_run``, which prints the listing).  ``recipe``: a
    ``QuadsRecipe``, a recipe JSON file, or None (``load_dir``'s ``quads_recipe.json``, else the default);
    the precision arguments override it.  Every argument is the CLI flag of the same name."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: expected one of {list(FORMATS)}")
    args = argparse.Namespace(
        load_dir=load_dir, save_dir=save_dir, format=fmt, quads_recipe=recipe,
        rollout_precision=rollout_precision and vocab.parse_precision(rollout_precision, "--rollout-precision").value,
        activation_scaling=activation_scaling and vocab.parse_scaling(activation_scaling).value,
        rac_channels=rac_channels, calib_data=calib_data, calib_size=calib_size, calib_seq_len=calib_seq_len,
        device=device, tokenizer_dir=tokenizer_dir, seed=seed, max_shard_size=max_shard_size, force=force,
        dry_run=dry_run, no_progress=not progress)
    inputs = check_args(args)
    recipe = load_recipe(args)
    claim = contextlib.nullcontext() if dry_run else claim_output(save_dir, force=force, inputs=inputs)
    with claim:
        return _export(args, recipe, inputs)


def _export(args, recipe, inputs) -> Path | None:
    ckpt = HFCheckpoint(args.load_dir)
    side_files(args.load_dir, TOKENIZER_FILES)   # a side file leading out of the checkpoint: refused now
    source = str(ckpt.path / "config.json")
    dims = ckpt.dims(source)   # layer / expert counts checked against the tensors present
    qwen3_moe.hf_top_k(ckpt.config, source)
    check_calibration_fits(args, ckpt.config, source)
    ckpt.validate(qwen3_moe.hf_shapes(dims))
    try:
        plan = QuantPlan.resolve(recipe, dims)
    except ValueError as e:
        raise CheckpointError(f"{args.load_dir}: {e}") from None
    if not plan.rollout_quantizes:
        raise CheckpointError(f"{args.load_dir}: the recipe quantizes no weight for the rollout "
                              f"(rollout_precision bf16 or everything carved out); nothing to export")
    shapes, dtypes = rollout_specs(plan)
    max_bytes = cli.parse_size(args.max_shard_size)
    if args.dry_run:
        writer = ShardedSafetensorsWriter(args.save_dir, max_shard_bytes=max_bytes, dry_run=True)
        for name, shape in shapes.items():
            dtype = dtypes.get(name) or ckpt.dtype(name)
            writer.add(name, torch.empty(shape, dtype=dtype, device="meta"))
        print(plan.describe())
        print(format_listing(writer.listing, writer.close() + ["config.json", "hf_quant_config.json"]))
        return None

    calib, calib_info = None, {}
    if plan.rollout_precision.quantizes_activations:
        calib, calib_info = run_calibration(args, dims, plan, ckpt.config)
    qc, summary = quant_configs(args.format, plan, calib_info)
    with atomic_output_dir(args.save_dir, force=args.force, inputs=inputs) as tmp:
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes=max_bytes)
        for name, t in tqdm(rollout_tensors(ckpt, plan, calib, args.device), total=len(shapes),
                            desc=f"export {args.format}", disable=args.no_progress, unit="tensor"):
            writer.add(name, check_finite(name, t, f"the rollout tensors computed from {args.load_dir}"))
        writer.close()
        write_json(tmp / "config.json", {**ckpt.config, "quantization_config": qc})
        write_json(tmp / "hf_quant_config.json", summary)
        copy_side_files(args.load_dir, tmp, TOKENIZER_FILES)
        with HFCheckpoint(tmp, being_written=True) as written:
            written.validate(shapes, dtypes=dtypes, what="the rollout format")
    return Path(args.save_dir)


def run_calibration(args, dims, plan, config: dict):
    """The plan's calibration (``plan.calibration``) of the model as served: the rollout model built from the HF
    weights (NVFP4 modules, fp32) runs the calibration prompts; returns (Calibration, info for config.json)."""
    from transformers import Qwen3MoeConfig

    if args.calib_data:
        prompts = load_prompts(args.calib_data, args.tokenizer_dir or args.load_dir,
                               num_samples=args.calib_size, seq_len=args.calib_seq_len, vocab_size=dims.vocab_size)
        source = str(args.calib_data)
    else:
        print(f"quads-export-rollout: no --calib-data; calibrating on {args.calib_size} random token "
              "sequences (only meaningful for tiny test models)")
        prompts = random_prompts(dims.vocab_size, num_samples=args.calib_size, seq_len=args.calib_seq_len,
                                 seed=args.seed)
        source = f"random(seed={args.seed})"
    hf_config = Qwen3MoeConfig.from_dict(config)
    model = RolloutModel(hf_config, plan, dtype=CALIBRATION_DTYPE, device=resolve_device(args.device),
                         kernel_layout=False)  # calibrates only: the checkpoint keeps ModelOpt's layout
    with HFCheckpoint(args.load_dir) as ckpt:
        model.load_weights((n, ckpt.get(n)) for n in qwen3_moe.hf_shapes(dims))
    model.calibrate(prompts, progress=not args.no_progress)
    calibration = model.calibration
    del model
    info = {"source": source, "num_samples": len(prompts), "num_tokens": int(sum(p.numel() for p in prompts))}
    return calibration, info


def main(argv=None):
    a = parse_args(argv)
    out = export_rollout(a.load_dir, a.save_dir, fmt=a.format, recipe=a.quads_recipe, rollout_precision=a.rollout_precision,
                         activation_scaling=a.activation_scaling, rac_channels=a.rac_channels, calib_data=a.calib_data,
                         calib_size=a.calib_size, calib_seq_len=a.calib_seq_len, device=a.device,
                         tokenizer_dir=a.tokenizer_dir, seed=a.seed, max_shard_size=a.max_shard_size, force=a.force,
                         dry_run=a.dry_run, progress=not a.no_progress)
    if out is not None:
        print(f"wrote {out}")


def console_main():
    raise SystemExit(cli.run(main))


if __name__ == "__main__":
    console_main()
