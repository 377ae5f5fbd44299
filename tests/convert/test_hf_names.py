"""transformers' save_pretrained writes exactly the HF names and shapes of the Qwen3-MoE table."""

import torch

from quads_megatron.convert.hf_checkpoint import HFCheckpoint
from quads_megatron.models import qwen3_moe


def test_hf_shapes_are_what_transformers_saves(tiny_hf):
    """save_pretrained writes per-expert gate/up/down keys, exactly the names/shapes the table expects."""
    with HFCheckpoint(tiny_hf) as ckpt:
        dims = qwen3_moe.dims_from_hf_config(ckpt.config)
        ckpt.validate(qwen3_moe.hf_shapes(dims), dtype=torch.bfloat16)
        assert "model.layers.1.mlp.experts.3.gate_proj.weight" in ckpt
    covered = {n for r, layer, e in qwen3_moe.iter_rule_instances(dims) for n in qwen3_moe.hf_names(r, layer, e)}
    assert covered == set(qwen3_moe.hf_shapes(dims))
