"""QuadsRecipe: JSON round trip, defaults, and clear errors for bad values."""

import json

import pytest

from quads_megatron.recipe import QuadsRecipe


def test_defaults_are_quads_asymmetric_routed_experts():
    r = QuadsRecipe()
    assert (r.weight_format, r.block_shape, r.activation_mode) == ("nvfp4", (1, 16), "bf16")
    assert r.scope == ("routed_experts",) and r.activation_scaling == "per_token"
    assert not r.quantize_activations


def test_json_and_dict_round_trip():
    r = QuadsRecipe(block_shape=[16, 16], activation_mode="nvfp4", activation_scaling="per_tensor",
                    scope=["routed_experts", "attention"], bf16_first_layers=1, bf16_last_layers=2,
                    bf16_patterns=["decoder.layers.3.*"], cache_weights=False)
    text = r.to_json()
    assert json.loads(text)["block_shape"] == [16, 16]
    assert QuadsRecipe.from_json(text) == r
    assert QuadsRecipe.from_dict(r.to_dict()) == r
    assert hash(r) == hash(QuadsRecipe.from_json(text))


@pytest.mark.parametrize("kwargs,match", [
    (dict(activation_mode="fp8"), "activation_mode='fp8' is not one of"),
    (dict(activation_scaling="per_channel"), "activation_scaling"),
    (dict(block_shape=(1, 32)), "block_shape"),
    (dict(scope=["experts"]), "scope='experts'"),
    (dict(scope="routed_experts"), "must be a list"),
    (dict(scope=[]), "scope is empty"),
    (dict(bf16_first_layers=-1), "bf16_first_layers must be an int >= 0"),
    (dict(bf16_patterns=[""]), "non-empty strings"),
    (dict(weight_format="mxfp4"), "weight_format"),
    (dict(backend="cuda"), "backend"),
    (dict(version=99), "version"),
])
def test_bad_values_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuadsRecipe(**kwargs)


def test_unknown_keys_are_rejected():
    with pytest.raises(ValueError, match=r"unknown keys \['activation'\]"):
        QuadsRecipe.from_dict({"activation": "bf16"})
