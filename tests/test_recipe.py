"""QuadsRecipe: JSON round trip, defaults, flag overrides, and clear errors for bad values."""

import json

import pytest

from quads_megatron.recipe import QuadsRecipe
from quads_megatron.vocab import ActivationScaling, Precision, Scope, parse_precision, precision_choices


def test_defaults_are_quads_aqat_trainer_and_rac_rollout():
    r = QuadsRecipe()
    assert (r.weight_format, r.block_shape) == ("nvfp4", (1, 16))
    assert (r.train_precision, r.rollout_precision) == (Precision.W4A16, Precision.W4A4_RAC)
    assert r.scope == (Scope.ROUTED_EXPERTS,) and r.activation_scaling is ActivationScaling.PER_TOKEN
    assert r.rac_channels == 16


def test_json_and_dict_round_trip():
    r = QuadsRecipe(block_shape=[16, 16], train_precision="w4a4", rollout_precision="quads",
                    activation_scaling="static", scope=["routed_experts", "attention"], bf16_first_layers=1,
                    bf16_last_layers=2, bf16_patterns=["model.layers.3.*"], cache_weights=False, rac_channels=32)
    text = r.to_json()
    d = json.loads(text)
    assert d["block_shape"] == [16, 16] and d["rollout_precision"] == "w4a4_rac" and d["scope"][1] == "attention"
    assert QuadsRecipe.from_json(text) == r
    assert QuadsRecipe.from_dict(r.to_dict()) == r
    assert hash(r) == hash(QuadsRecipe.from_json(text))


def test_flag_overrides_leave_unset_fields_alone():
    r = QuadsRecipe(rac_channels=32).replace(rollout_precision="w4a4", rac_channels=None)
    assert (r.rollout_precision, r.rac_channels) == (Precision.W4A4, 32)


def test_one_vocabulary_with_the_paper_aliases():
    assert parse_precision("quads") is Precision.W4A4_RAC and parse_precision("aqat") is Precision.W4A16
    assert precision_choices(train=True) == ["bf16", "w4a16", "w4a4", "aqat"]
    assert not Precision.W4A16.quantizes_activations and Precision.W4A4_RAC.uses_rac


@pytest.mark.parametrize("kwargs,match", [
    (dict(train_precision="fp8"), "train_precision: 'fp8' is not one of"),
    (dict(train_precision="w4a4_rac"), "rollout-only"),
    (dict(rollout_precision="int4"), "rollout_precision"),
    (dict(activation_scaling="per_channel"), "activation_scaling"),
    (dict(block_shape=(1, 32)), "block_shape"),
    (dict(scope=["experts"]), "scope: 'experts'"),
    (dict(scope="routed_experts"), "must be a list"),
    (dict(scope=[]), "scope is empty"),
    (dict(rac_channels=20), "multiple of 16"),
    (dict(rac_channels=0), "needs rac_channels > 0"),
    (dict(bf16_first_layers=-1), "bf16_first_layers must be an int >= 0"),
    (dict(bf16_patterns=[""]), "non-empty strings"),
    (dict(weight_format="mxfp4"), "weight_format"),
    (dict(backend="cuda"), "backend"),
    (dict(version=1), "version"),
])
def test_bad_values_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuadsRecipe(**kwargs)


def test_unknown_keys_are_rejected():
    with pytest.raises(ValueError, match=r"unknown keys \['activation_mode'\]"):
        QuadsRecipe.from_dict({"activation_mode": "bf16"})
