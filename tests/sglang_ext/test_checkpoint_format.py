"""The quads `quantization_config` schema: round trip, ModelOpt forms, env overrides, clear errors (no SGLang)."""

from __future__ import annotations

import pytest

from quads_megatron.plan.rollout_schema import RolloutQuantConfig, is_modelopt_nvfp4, parse_quantization_config

MODELOPT_NESTED = {"producer": {"name": "modelopt"},
                   "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                    "exclude_modules": ["lm_head"]}}


def test_round_trip():
    s = RolloutQuantConfig(precision="w4a4_rac", rac_channels=32, exclude_modules=["lm_head"])
    qc = s.to_quantization_config()
    assert qc["quant_method"] == "quads" and qc["quant_algo"] == "NVFP4"
    assert parse_quantization_config(qc, env={}) == s


@pytest.mark.parametrize("cfg,mode", [
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"]}, "w4a4"),
    (MODELOPT_NESTED, "w4a4"),
    ({"quant_method": "modelopt_fp4", "quant_algo": "NVFP4"}, "w4a4"),  # SGLang-parsed form
    ({"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4"}, "w4a16"),
])
def test_modelopt_forms(cfg, mode):
    assert is_modelopt_nvfp4(cfg)
    s = parse_quantization_config(cfg, env={})
    assert (s.source, s.precision, s.activation_scaling, s.uses_rac) == \
        ("modelopt", mode, "static", False)


def test_quads_block_of_hf_quant_config_wins_over_the_modelopt_summary():
    qc = RolloutQuantConfig(rac_channels=16, exclude_modules=["lm_head"]).to_quantization_config()
    s = parse_quantization_config({**MODELOPT_NESTED, "quads": qc}, env={})
    assert (s.source, s.precision, s.rac_channels) == ("quads", "w4a4_rac", 16)


def test_env_overrides_turn_rac_on_for_modelopt():
    s = parse_quantization_config(MODELOPT_NESTED, env={
        "QUADS_PRECISION": "w4a4_rac", "QUADS_RAC_CHANNELS": "32",
        "QUADS_ACTIVATION_SCALING": "per_token"})
    assert (s.precision, s.rac_channels, s.activation_scaling) == ("w4a4_rac", 32, "per_token")
    assert s.exclude_modules == ["lm_head"]


@pytest.mark.parametrize("cfg,match", [
    ({"quant_method": "quads", "precision": "w8a8"}, "precision"),
    ({"quant_method": "quads", "precision": "w4a4_rac", "rac_channels": 0}, "rac_channels > 0"),
    ({"quant_method": "quads", "precision": "w4a4_rac", "rac_channels": 20}, "multiple of 16"),
    ({"quant_method": "quads", "precision": "w4a4", "group_size": 32}, "group_size"),
    ({"quant_method": "quads", "precision": "w4a4", "activation_scaling": "per_channel"},
     "activation_scaling"),
    ({"quant_method": "quads"}, r"precision: missing"),
    ({"quant_method": "quads", "precision": "w4a4", "activation_mod": "w4a4"}, "unknown quads keys"),
    ({"quant_method": "quads", "precision": "bf16"}, "not a quantized checkpoint"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "ModelOpt NVFP4"),
    ({"quant_method": "awq"}, "quant_method: expected 'quads'"),
])
def test_bad_configs_name_the_field(cfg, match):
    with pytest.raises(ValueError, match=match):
        parse_quantization_config(cfg, env={})


def test_bad_env_value():
    with pytest.raises(ValueError, match="QUADS_RAC_CHANNELS"):
        parse_quantization_config({"quant_method": "quads", "precision": "w4a4_rac", "rac_channels": 16},
                                  env={"QUADS_RAC_CHANNELS": "many"})
