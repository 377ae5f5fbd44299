"""The quads `quantization_config` schema: round trip, ModelOpt forms, the checkpoint as the only switch, clear errors
(no SGLang)."""

from __future__ import annotations

import pytest

from quads_megatron.errors import ConfigError
from quads_megatron.plan.rollout_schema import (RolloutQuantConfig, check_server_quantization, is_modelopt_nvfp4,
                                                parse_quantization_config)

MODELOPT_NESTED = {"producer": {"name": "modelopt"},
                   "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                    "exclude_modules": ["lm_head"]}}


def test_round_trip():
    s = RolloutQuantConfig(precision="w4a4_rac", rac_channels=32, exclude_modules=["lm_head"])
    qc = s.to_quantization_config()
    assert qc["quant_method"] == "quads" and qc["quant_algo"] == "NVFP4"
    assert parse_quantization_config(qc) == s


@pytest.mark.parametrize("cfg,mode", [
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"]}, "w4a4"),
    (MODELOPT_NESTED, "w4a4"),
    ({"quant_method": "modelopt_fp4", "quant_algo": "NVFP4"}, "w4a4"),  # SGLang-parsed form
    ({"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4"}, "w4a16"),
])
def test_modelopt_forms(cfg, mode):
    assert is_modelopt_nvfp4(cfg)
    s = parse_quantization_config(cfg)
    assert (s.source, s.precision, s.activation_scaling, s.uses_rac) == \
        ("modelopt", mode, "static", False)


def test_quads_block_of_hf_quant_config_wins_over_the_modelopt_summary():
    qc = RolloutQuantConfig(rac_channels=16, exclude_modules=["lm_head"]).to_quantization_config()
    s = parse_quantization_config({**MODELOPT_NESTED, "quads": qc})
    assert (s.source, s.precision, s.rac_channels) == ("quads", "w4a4_rac", 16)


def test_the_environment_does_not_override_the_checkpoint(monkeypatch):
    """The variables that used to override the checkpoint's plan change nothing now."""
    for var, value in (("QUADS_PRECISION", "w4a4_rac"), ("QUADS_RAC_CHANNELS", "32"),
                       ("QUADS_ACTIVATION_SCALING", "per_token")):
        monkeypatch.setenv(var, value)
    s = parse_quantization_config(MODELOPT_NESTED)
    assert (s.precision, s.rac_channels, s.activation_scaling) == ("w4a4", 0, "static")
    qc = RolloutQuantConfig(precision="w4a4", exclude_modules=["lm_head"]).to_quantization_config()
    assert parse_quantization_config(qc).precision == "w4a4"


QUADS_QC = {"quant_method": "quads", "precision": "w4a4_rac", "rac_channels": 16}


@pytest.mark.parametrize("cfg,flag,want", [
    (QUADS_QC, None, "quads"),
    (QUADS_QC, "quads", "quads"),
    ({**MODELOPT_NESTED, "quads": QUADS_QC}, None, "quads"),      # the export's hf_quant_config.json
    (MODELOPT_NESTED, "quads", "quads"),                           # ModelOpt NVFP4 served by quads: its own plan
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quads", "quads"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, None, None),   # stays ModelOpt without the flag
    ({"quant_method": "fp8"}, "fp8", None),                              # not ours: SGLang decides
])
def test_server_flag_agreeing_with_the_checkpoint(cfg, flag, want):
    assert check_server_quantization(cfg, flag) == want


@pytest.mark.parametrize("cfg,flag,named", [
    (QUADS_QC, "modelopt_fp4", ["--quantization modelopt_fp4", "'quads'"]),
    (QUADS_QC, "fp8", ["--quantization fp8", "'quads'"]),
    ({"quant_method": "fp8"}, "quads", ["--quantization quads", "'fp8'"]),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quads", ["--quantization quads", "'modelopt'"]),
    (None, "quads", ["--quantization quads", "no quantization_config"]),
])
def test_server_flag_disagreeing_with_the_checkpoint_names_both(cfg, flag, named):
    with pytest.raises(ConfigError) as e:
        check_server_quantization(cfg, flag, origin="ckpt/config.json quantization_config")
    assert all(n in str(e.value) for n in named), str(e.value)
    assert "ckpt/config.json" in str(e.value)


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
        parse_quantization_config(cfg)

