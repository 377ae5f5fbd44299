"""Fill a live (any TP/EP layout) Megatron Qwen3-MoE model with the weights of an HF checkpoint."""

import torch
from tqdm import tqdm

from quads_megatron.models import qwen3_moe
from quads_megatron.errors import CheckpointError
from quads_megatron.convert.megatron_params import global_param_refs, parallel_info


@torch.no_grad()
def load_hf_into_megatron(model, ckpt, *, progress: bool = True) -> int:
    """Copy every parameter's shard for this rank from ``ckpt`` (an HFCheckpoint); return the count.

    Each rank reads only the HF tensors of its own parameters (one at a time, from the mmap'd
    safetensors), so no rank materialises the whole model.
    """
    dims = qwen3_moe.dims_from_hf_config(ckpt.config)
    ckpt.validate(qwen3_moe.hf_shapes(dims))
    info = parallel_info()
    refs = global_param_refs(model)
    for ref in tqdm(refs, desc="HF -> Megatron", disable=not progress, unit="tensor"):
        rule = ref.rule
        rank, size = ((info["etp_rank"], info["etp_size"]) if rule.expert else (info["tp_rank"], info["tp_size"]))
        names = qwen3_moe.hf_names(rule, ref.layer, ref.expert)
        rows = ref.param.shape[0] * size if rule.layout == "vocab" else None
        full = qwen3_moe.to_megatron(rule, [ckpt.get(n) for n in names], dims, rows=rows)
        piece = qwen3_moe.shard(rule, full, rank, size)
        if tuple(piece.shape) != tuple(ref.param.shape):
            raise CheckpointError(f"{ref.local_name}: HF tensor(s) {names} give a shard of shape "
                                  f"{list(piece.shape)}, the Megatron model has {list(ref.param.shape)}")
        ref.param.copy_(piece.to(ref.param.dtype))
    return len(refs)
