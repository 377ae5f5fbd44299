"""Megatron-Core ``dist_checkpointing`` (torch_dist) save/load of Qwen3-MoE models built from an HF config.

A checkpoint saved here is ``{"model": model.sharded_state_dict(), "hf_config": <config.json>}``:
the sharded tensors under Megatron's global keys (readable by any TP/EP layout, and by
Megatron-LM's own loader) plus the HF config in the common state, so Megatron -> HF needs no
side files.  Megatron-LM training directories (``latest_checkpointed_iteration.txt`` +
``iter_NNNNNNN/``) are resolved to their latest iteration.
"""

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from quads_megatron.convert import qwen3_moe
from quads_megatron.convert.errors import CheckpointError
from quads_megatron.convert.megatron_params import padded_vocab_size
from quads_megatron.convert.output_dir import check_output_path, commit_temp_dir, make_temp_dir

HF_CONFIG_KEY = "hf_config"


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
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"Megatron checkpoint directory not found: {path}")
    tracker = path / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        text = tracker.read_text().strip()
        path = path / ("release" if text == "release" else f"iter_{int(text):07d}")
    if not dist_checkpointing.check_is_distributed_checkpoint(str(path)):
        raise CheckpointError(f"{path}: not a Megatron dist_checkpointing checkpoint (no valid metadata.json)")
    return path


def read_common_state(ckpt_dir) -> dict:
    """The non-sharded (rank-0) objects of a checkpoint: ``hf_config`` (ours), ``quads_recipe`` (trainer's)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(resolve_checkpoint_dir(ckpt_dir)))


def read_hf_config(ckpt_dir) -> dict:
    """The HF config.json stored in a checkpoint written by ``save_megatron_checkpoint``."""
    common = read_common_state(ckpt_dir)
    if HF_CONFIG_KEY not in common:
        raise CheckpointError(f"{ckpt_dir}: has no stored '{HF_CONFIG_KEY}' (not written by quads-convert-hf-"
                              "to-megatron); pass --hf-config with the model's config.json, or --preset")
    return json.loads(common[HF_CONFIG_KEY])


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
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    ckpt_dir = resolve_checkpoint_dir(ckpt_dir)
    try:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt_dir))
    except CheckpointingException as e:
        raise CheckpointError(f"{ckpt_dir}: cannot load into the model: {e}") from None
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise CheckpointError(f"{ckpt_dir}: tensors missing for the model: {missing[:5]}")
