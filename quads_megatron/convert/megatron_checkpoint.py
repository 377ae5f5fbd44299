"""Megatron-Core ``dist_checkpointing`` (torch_dist) save/load of Qwen3-MoE models built from an HF config.

A checkpoint saved here is ``{"model": model.sharded_state_dict(), "hf_config": <config.json>}``:
the sharded tensors under Megatron's global keys (readable by any TP/EP layout, and by
Megatron-LM's own loader) plus the HF config in the common state, so Megatron -> HF needs no
side files.  Megatron-LM training directories (``latest_checkpointed_iteration.txt`` +
``iter_NNNNNNN/``, e.g. a GRPO ``--save`` directory) are resolved to their latest iteration.
The reading side is ``quads_megatron.megatron.checkpoint``'s (one path for trainer and converters);
this module turns its errors into ``CheckpointError``.
"""

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from quads_megatron.convert import qwen3_moe
from quads_megatron.errors import CheckpointError
from quads_megatron.convert.megatron_params import padded_vocab_size
from quads_megatron.convert.output_dir import check_output_path, commit_temp_dir, make_temp_dir
from quads_megatron.megatron.checkpoint import HF_CONFIG_KEY


def build_model_from_hf_config(hf_config: dict, *, tp: int = 1, ep: int = 1, etp=None, spec: str = "local",
                               params_dtype: torch.dtype = torch.bfloat16, make_vocab_size_divisible_by: int = 128,
                               **model_kwargs):
    """A Megatron GPTModel with the architecture of ``hf_config`` for the current parallel layout.

    Needs ``quads_megatron.megatron.initialize_distributed(tp=..., ep=..., etp=...)`` first.
    Experts keep Megatron's initialisation (the weights are loaded right after); ``model_kwargs``
    go to ``build_gpt_model`` (e.g. ``parallel_output=False``).
    """
    from quads_megatron.megatron.model import build_gpt_model
    from quads_megatron.megatron.presets import qwen3_moe_config

    dims = qwen3_moe.dims_from_hf_config(hf_config)
    config = qwen3_moe_config(
        "tiny", tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp if etp is not None else tp, params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, **qwen3_moe.megatron_config_kwargs(hf_config))
    vocab = padded_vocab_size(dims.vocab_size, tp, make_vocab_size_divisible_by)
    return build_gpt_model(
        config, vocab, int(hf_config.get("max_position_embeddings", 4096)), spec=spec,
        rotary_base=qwen3_moe.rope_theta(hf_config), expert_seed=None,
        share_embeddings_and_output_weights=dims.tie_word_embeddings, **model_kwargs)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _broadcast_path(path):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return path
    box = [str(path) if path is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def save_megatron_checkpoint(model, out_dir, hf_config: dict, *, force: bool = False) -> Path:
    """Save ``model`` (every rank calls this) to ``out_dir`` atomically: a temporary sibling directory
    is written by all ranks, then renamed by rank 0 once everyone finished."""
    from megatron.core import dist_checkpointing

    out_dir = check_output_path(out_dir, force=force)
    tmp = _broadcast_path(make_temp_dir(out_dir) if _rank() == 0 else None)
    try:
        state = {"model": model.sharded_state_dict(), HF_CONFIG_KEY: json.dumps(hf_config, sort_keys=True)}
        dist_checkpointing.save(state, str(tmp))
        if dist.is_initialized():
            dist.barrier()
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if _rank() == 0:
        commit_temp_dir(tmp, out_dir)
    if dist.is_initialized():
        dist.barrier()
    return out_dir


def resolve_checkpoint_dir(path) -> Path:
    """The torch_dist directory itself, or the latest ``iter_*`` of a Megatron-LM save directory."""
    from quads_megatron.megatron import checkpoint as mckpt

    if not Path(path).is_dir():
        raise CheckpointError(f"Megatron checkpoint directory not found: {path}")
    try:
        return mckpt.resolve_checkpoint_dir(path)
    except (FileNotFoundError, ValueError) as e:
        raise CheckpointError(str(e)) from None


def read_common_state(ckpt_dir) -> dict:
    """The non-sharded (rank-0) objects of a checkpoint: ``hf_config``, ``quads_recipe`` (trainer's), loop state."""
    from quads_megatron.megatron import checkpoint as mckpt

    return mckpt.load_common_state(resolve_checkpoint_dir(ckpt_dir))


def hf_side_dir(load_dir) -> Path | None:
    """The HF side of a trainer save directory (``{save}/hf``: config.json + tokenizer, written by the GRPO
    loop), for ``load_dir`` = the save directory or one of its ``iter_*``; None when there is none."""
    load_dir = Path(load_dir)
    save_dir = load_dir.parent if load_dir.name.startswith("iter_") or load_dir.name == "release" else load_dir
    return save_dir / "hf" if (save_dir / "hf" / "config.json").is_file() else None


def read_hf_config(ckpt_dir) -> dict:
    """The HF config.json stored in a checkpoint (``save_megatron_checkpoint``, the GRPO loop), else the one
    in the save directory's ``hf/``."""
    common = read_common_state(ckpt_dir)
    if HF_CONFIG_KEY in common:
        return json.loads(common[HF_CONFIG_KEY])
    side = hf_side_dir(ckpt_dir)
    if side is not None:
        from transformers import AutoConfig

        try:  # save_pretrained leaves out default values: let transformers fill them in
            return AutoConfig.from_pretrained(str(side)).to_dict()
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{side / 'config.json'}: {e}") from None
    raise CheckpointError(f"{ckpt_dir}: has no stored '{HF_CONFIG_KEY}' (not written by quads-convert-hf-"
                          "to-megatron) and no hf/config.json beside it; pass --hf-config with the model's "
                          "config.json, or --preset")


def hf_config_from_preset(preset: str) -> dict:
    """HF config.json of a trainer preset (``quads_megatron.megatron.presets``), for its checkpoints."""
    from quads_megatron.megatron.presets import hf_qwen3_moe_config_dict, qwen3_moe_config, qwen3_moe_model_args

    args = qwen3_moe_model_args(preset)
    return hf_qwen3_moe_config_dict(qwen3_moe_config(preset), args["vocab_size"], args["max_seq_len"],
                                    rotary_base=args["rotary_base"])


def load_megatron_checkpoint(model, ckpt_dir) -> None:
    """Load a torch_dist checkpoint written by any TP/EP layout into ``model`` (every rank calls this).

    Missing tensors or shape mismatches come out as CheckpointError naming the key.
    """
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from quads_megatron.megatron import checkpoint as mckpt

    ckpt_dir = resolve_checkpoint_dir(ckpt_dir)
    try:
        mckpt.load_model_state(model, ckpt_dir)
    except CheckpointingException as e:
        raise CheckpointError(f"{ckpt_dir}: cannot load into the model: {e}") from None
    except ValueError as e:  # tensors missing for the model
        raise CheckpointError(str(e)) from None
