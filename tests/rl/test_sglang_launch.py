"""--sglang-launch's first half: the live trainer exported as a QUADS NVFP4 rollout checkpoint SGLang can load."""

import json

import pytest

from quads_megatron.rl.arguments import parse_args
from quads_megatron.rl.engines.sglang_launch import export_rollout_checkpoint
from quads_megatron.rl.policy import MegatronPolicy
from quads_megatron.rl.tokenizer import build_char_tokenizer


@pytest.mark.parametrize("precision,flags", [("w4a4_rac", []), ("w4a4", ["--bf16"])])
def test_export_rollout_checkpoint(tiny_args, tmp_path, precision, flags):
    """The launched server serves the run's --rollout-precision (it used to always be w4a4_rac)."""
    args = parse_args(tiny_args("--rollout-precision", precision, *flags))
    policy = MegatronPolicy(args, 128)
    prompts = [f"sort:{i:03d}=" for i in range(8)]
    out = export_rollout_checkpoint(policy, build_char_tokenizer(), tmp_path / "sg", calib_prompts=prompts)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "quads"
    assert cfg["quantization_config"]["precision"] == precision
    assert cfg.get("num_experts", cfg.get("num_local_experts")) == policy.config.num_moe_experts and cfg["vocab_size"] == 128
    assert (out / "tokenizer.json").is_file() and cfg["eos_token_id"] == 1
    from safetensors import safe_open

    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.0.gate_proj.weight_scale_2" in keys
    assert "model.embed_tokens.weight" in keys
