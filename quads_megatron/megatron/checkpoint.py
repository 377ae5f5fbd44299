"""Megatron dist_checkpointing save/load of an AQAT model: master weights (+ optimizer state) and its QuadsRecipe.

AQAT leaves the Parameters unquantized, so the sharded state dict is Megatron's own (any
TP/EP layout can load it); the recipe rides along as common (rank-0) state under
``quads_recipe`` as JSON, so a resumed run, the converters and the rollout side read the
same description.
"""

import os

import torch
import torch.distributed as dist

from quads_megatron.megatron.aqat import quads_recipe, unwrap_model
from quads_megatron.megatron.cpu import cuda_to_cpu
from quads_megatron.recipe import QuadsRecipe

RECIPE_KEY = "quads_recipe"
# The distributed optimizer's default sharding fails on these versions
# ("flattened_range is not supported"); dp_reshardable works.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(model, ckpt_dir, optimizer=None, metadata=None):
    """Save ``model`` (GPTModel or wrapper), optionally its Megatron optimizer, and the recipe."""
    from megatron.core import dist_checkpointing

    gpt = unwrap_model(model)
    recipe = quads_recipe(gpt)
    if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):  # every rank: no rank left in a barrier
        raise FileExistsError(f"save_checkpoint: {ckpt_dir} exists and is not empty")
    _barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    _barrier()
    with cuda_to_cpu():
        state = {"model": gpt.sharded_state_dict(),
                 RECIPE_KEY: recipe.to_json() if recipe is not None else None}
        if optimizer is not None:
            state["optimizer"] = optimizer.sharded_state_dict(
                state["model"], metadata=metadata or OPTIMIZER_METADATA)
        dist_checkpointing.save(state, ckpt_dir)
    _barrier()


def load_recipe(ckpt_dir):
    """The QuadsRecipe stored in a checkpoint (None for a checkpoint of a BF16 model)."""
    from megatron.core import dist_checkpointing

    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"load_recipe: no checkpoint directory {ckpt_dir}")
    common = dist_checkpointing.load_common_state_dict(ckpt_dir)
    text = common.get(RECIPE_KEY)
    return None if text is None else QuadsRecipe.from_json(text)


def load_checkpoint(model, ckpt_dir, optimizer=None, metadata=None):
    """Load master weights (and optimizer state) into ``model``; its recipe must equal the stored one."""
    from megatron.core import dist_checkpointing

    from quads_megatron.megatron.aqat import post_optimizer_hook

    gpt = unwrap_model(model)
    stored, mine = load_recipe(ckpt_dir), quads_recipe(gpt)
    if stored != mine:
        raise ValueError(f"load_checkpoint: {ckpt_dir} was saved with recipe {stored} but the "
                         f"model is converted with {mine}; apply_quads(model, load_recipe(dir)) "
                         "before loading")
    with cuda_to_cpu():
        loaded = dist_checkpointing.load({"model": gpt.sharded_state_dict()}, ckpt_dir)
        gpt.load_state_dict(loaded["model"])
        if optimizer is not None:
            opt_sd = optimizer.sharded_state_dict(gpt.sharded_state_dict(), is_loading=True,
                                                  metadata=metadata or OPTIMIZER_METADATA)
            loaded_opt = dist_checkpointing.load({"optimizer": opt_sd}, ckpt_dir)
            with torch.no_grad():
                optimizer.load_state_dict(loaded_opt["optimizer"])
    post_optimizer_hook(gpt)
    return stored
