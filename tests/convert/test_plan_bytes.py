"""For every recipe carve-out: the trainer's forward weights, the export, the SGLang sync payload and the
local engine hold the same NVFP4 bytes (TP=1 here; TP=2 / EP=2 over gloo in test_megatron_roundtrip)."""

import pytest
import torch

from plan_bytes import RECIPES, plan_mismatches
from quads_megatron.convert.hf_checkpoint import HFCheckpoint
from quads_megatron.recipe import QuadsRecipe


@pytest.fixture(scope="module", autouse=True)
def single_process_megatron():
    from quads_megatron.megatron import initialize_distributed

    initialize_distributed(tp=1, ep=1)


@pytest.mark.parametrize("key", sorted(RECIPES))
def test_trainer_export_sync_and_local_engine_agree(key, tiny_hf, tmp_path):
    from quads_megatron.convert.hf_to_megatron_weights import load_hf_into_megatron
    from quads_megatron.convert.megatron_checkpoint import build_model_from_hf_config

    ckpt = HFCheckpoint(tiny_hf)
    model = build_model_from_hf_config(ckpt.config, params_dtype=torch.float32)
    load_hf_into_megatron(model, ckpt, progress=False)
    assert plan_mismatches(model, QuadsRecipe.from_dict(RECIPES[key]), tiny_hf, tmp_path,
                           ckpt.config["vocab_size"]) == []


def test_a_carve_out_the_trainer_ignores_is_caught(tiny_hf, tmp_path):
    """The check can fail: a trainer that quantizes layer 0 while the plan keeps it BF16 is reported."""
    from quads_megatron.convert.hf_to_megatron_weights import load_hf_into_megatron
    from quads_megatron.convert.megatron_checkpoint import build_model_from_hf_config
    from quads_megatron.megatron import aqat

    ckpt = HFCheckpoint(tiny_hf)
    model = build_model_from_hf_config(ckpt.config, params_dtype=torch.float32)
    load_hf_into_megatron(model, ckpt, progress=False)
    aqat.apply_quads(model, QuadsRecipe())          # all layers, as the pre-plan trainer did
    bad = plan_mismatches_with_converted(model, tiny_hf, tmp_path, ckpt.config["vocab_size"])
    assert any(b.startswith("trainer") for b in bad)


def plan_mismatches_with_converted(model, hf_dir, tmp_path, vocab):
    """plan_mismatches for a first-layer carve-out on a model whose trainer side was converted without it."""
    from quads_megatron.megatron import aqat

    real = aqat.apply_quads
    aqat.apply_quads = lambda m, r: m   # keep the wrong conversion
    try:
        return plan_mismatches(model, QuadsRecipe(bf16_first_layers=1), hf_dir, tmp_path, vocab)
    finally:
        aqat.apply_quads = real
