"""Helpers of the convert tests: the tiny Qwen3-MoE HF checkpoint and a bitwise checkpoint comparison."""

import torch

TINY_VOCAB = 256
TINY_SEQ = 64


def tiny_hf_config_dict() -> dict:
    """HF config of the trainer's tiny preset (hidden 64, 2 layers, 4 experts, GQA 4/2)."""
    from quads_megatron.megatron.presets import hf_qwen3_moe_config_dict, qwen3_moe_config

    return hf_qwen3_moe_config_dict(qwen3_moe_config("tiny"), TINY_VOCAB, TINY_SEQ)


def save_tiny_hf(path, seed: int = 0, **overrides):
    """Save a transformers Qwen3MoeForCausalLM of the tiny preset with varied BF16 weights."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**{**tiny_hf_config_dict(), **overrides})
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            # norms around 1, matrices with a spread of magnitudes (and one outlier channel)
            p.copy_(torch.empty_like(p).uniform_(0.7, 1.3) if p.ndim == 1 else torch.randn_like(p) * 0.05)
        model.model.embed_tokens.weight[:, 5] *= 20
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def assert_same_checkpoint(a, b):
    """Every tensor of HF checkpoint ``a`` is bitwise equal (and same dtype) in ``b``, and no more."""
    from quads_megatron.convert.hf_checkpoint import HFCheckpoint

    with HFCheckpoint(a) as ca, HFCheckpoint(b) as cb:
        assert ca.keys() == cb.keys()
        for name in ca.keys():
            x, y = ca.get(name), cb.get(name)
            assert x.dtype == y.dtype, name
            assert torch.equal(x.view(torch.uint8) if x.dtype.itemsize == 1 else x,
                               y.view(torch.uint8) if y.dtype.itemsize == 1 else y), name
