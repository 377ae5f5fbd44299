"""Megatron-Core integration of QUADS: CPU support, Qwen3-MoE presets, model builder, AQAT converter.

Submodules import megatron-core lazily; the names below resolve on first access.
"""

_EXPORTS = {
    "setup_megatron_cpu": "quads_megatron.megatron.cpu",
    "cuda_to_cpu": "quads_megatron.megatron.cpu",
    "qwen3_moe_config": "quads_megatron.megatron.presets",
    "qwen3_moe_model_args": "quads_megatron.megatron.presets",
    "hf_qwen3_moe_config_dict": "quads_megatron.megatron.presets",
    "initialize_distributed": "quads_megatron.megatron.parallel",
    "sync_grads": "quads_megatron.megatron.parallel",
    "build_gpt_model": "quads_megatron.megatron.model",
    "apply_quads": "quads_megatron.megatron.aqat",
    "post_optimizer_hook": "quads_megatron.megatron.aqat",
    "register_post_optimizer_hook": "quads_megatron.megatron.aqat",
    "QuadsConverter": "quads_megatron.megatron.aqat",
    "save_checkpoint": "quads_megatron.megatron.checkpoint",
    "load_checkpoint": "quads_megatron.megatron.checkpoint",
    "load_recipe": "quads_megatron.megatron.checkpoint",
}


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'quads_megatron.megatron' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
