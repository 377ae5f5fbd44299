"""HF -> Megatron (torch_dist) -> HF is bitwise for TP=1 and a gloo TP=2 / EP=2 layout; logits match transformers."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from convert_fixtures import assert_same_checkpoint
from quads_megatron.convert import hf_to_megatron, megatron_to_hf
from quads_megatron.models import qwen3_moe
from quads_megatron.convert.hf_checkpoint import HFCheckpoint
from quads_megatron.plan import QuantPlan, quantize_named_params
from quads_megatron.recipe import QuadsRecipe

# fp32 on both sides; measured max |diff| ~1e-6 on logits of magnitude ~1.5 (summation order only).
LOGITS_ATOL = 1e-5
WORKER = Path(__file__).with_name("convert_dist_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ids(vocab):
    return torch.arange(32).remainder(vocab).reshape(2, 16) * 7 % vocab


def _hf_logits(hf_dir, ids):
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def tp1_megatron(tiny_hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("mg") / "tp1"
    hf_to_megatron.main(["--load-dir", str(tiny_hf), "--save-dir", str(out), "--bf16", "--no-progress"])
    return out


def test_dry_run_lists_megatron_tensors(tiny_hf, tmp_path, capsys):
    hf_to_megatron.main(["--load-dir", str(tiny_hf), "--save-dir", str(tmp_path / "x"), "--bf16", "--dry-run"])
    text = capsys.readouterr().out
    assert "decoder.layers.1.self_attention.linear_qkv.weight  [128, 64]  bf16" in text
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight  [128, 64]" in text
    assert not (tmp_path / "x").exists()


def test_tp1_round_trip_is_bitwise_and_logits_match(tiny_hf, tp1_megatron, tmp_path):
    out = tmp_path / "hf"
    megatron_to_hf.main(["--load-dir", str(tp1_megatron), "--save-dir", str(out), "--bf16", "--no-progress"])
    assert_same_checkpoint(tiny_hf, out)

    from quads_megatron.convert.megatron_checkpoint import build_model_from_hf_config, load_megatron_checkpoint

    config = HFCheckpoint(tiny_hf).config
    model = build_model_from_hf_config(config, params_dtype=torch.float32)
    load_megatron_checkpoint(model, tp1_megatron)
    ids = _ids(config["vocab_size"])
    with torch.no_grad():
        ours = model.eval()(ids, torch.arange(16).expand(2, -1), None)[..., : config["vocab_size"]]
    torch.testing.assert_close(ours, _hf_logits(tiny_hf, ids), rtol=0, atol=LOGITS_ATOL)


def test_synced_nvfp4_weights_are_the_trainers_fake_quantized_weights(tiny_hf, tp1_megatron, tmp_path):
    """BF16 trainer + AQAT (apply_quads): what the sync sends dequantizes to what forward uses."""
    from plan_bytes import plan_mismatches
    from quads_megatron.convert.megatron_checkpoint import build_model_from_hf_config, load_megatron_checkpoint

    config = HFCheckpoint(tiny_hf).config
    model = build_model_from_hf_config(config, params_dtype=torch.bfloat16)
    load_megatron_checkpoint(model, tp1_megatron)
    assert plan_mismatches(model, QuadsRecipe(), tiny_hf, tmp_path, config["vocab_size"]) == []


def test_stacked_expert_stream_is_the_per_expert_stream(tiny_hf, tp1_megatron):
    """iter_hf_weights(stacked_experts=True): each layer's experts as one item holding the parameters themselves
    (no copy); spelled out per expert it is the HF stream, and its NVFP4 the per-expert stream's bytes."""
    from quads_megatron.convert.live import iter_hf_weights
    from quads_megatron.convert.megatron_checkpoint import build_model_from_hf_config, load_megatron_checkpoint
    from quads_megatron.plan import ExpertsLayer
    from quads_megatron.plan.named_params import flat_named

    config = HFCheckpoint(tiny_hf).config
    model = build_model_from_hf_config(config, params_dtype=torch.bfloat16)
    load_megatron_checkpoint(model, tp1_megatron)
    vocab = config["vocab_size"]
    stacked = list(iter_hf_weights(model, vocab_size=vocab, stacked_experts=True))
    layers = [x for x in stacked if isinstance(x, ExpertsLayer)]
    assert [x.layer for x in layers] == list(range(config["num_hidden_layers"]))
    params = {p.data_ptr() for p in model.parameters()}
    assert all(t.data_ptr() in params for x in layers for t in (*x.fc1, *x.fc2))
    per_expert = list(iter_hf_weights(model, vocab_size=vocab))
    flat = list(flat_named(stacked))
    assert sorted(n for n, _ in flat) == sorted(n for n, _ in per_expert)
    want = dict(per_expert)
    assert all(torch.equal(t, want[n]) for n, t in flat)
    plan = QuantPlan.resolve(QuadsRecipe(), qwen3_moe.dims_from_hf_config(config))
    got = dict(quantize_named_params(stacked, plan))
    expected = dict(quantize_named_params(per_expert, plan))
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and torch.equal(_bits(got[name]), _bits(t)), name


def test_tp2_ep2_gloo_layout(tiny_hf, tp1_megatron, tmp_path):
    """One torchrun launch: write with TP=2/EP=2, read it back there and at TP=1, read TP=1 there."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           str(WORKER), str(tiny_hf), str(tp1_megatron), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert_same_checkpoint(tiny_hf, tmp_path / "hf_tp2ep2_same")
    assert_same_checkpoint(tiny_hf, tmp_path / "hf_tp1_in_tp2ep2")
    megatron_to_hf.main(["--load-dir", str(tmp_path / "mg_tp2ep2"), "--save-dir", str(tmp_path / "hf_tp1"), "--bf16",
                         "--no-progress"])
    assert_same_checkpoint(tiny_hf, tmp_path / "hf_tp1")

    config = HFCheckpoint(tiny_hf).config
    ids = _ids(config["vocab_size"])
    logits = torch.load(tmp_path / "logits_tp2ep2.pt")[..., : config["vocab_size"]]
    torch.testing.assert_close(logits, _hf_logits(tiny_hf, ids), rtol=0, atol=LOGITS_ATOL)

    mismatches = torch.load(tmp_path / "plan_mismatches.pt")
    assert mismatches == {k: [[], []] for k in mismatches} and len(mismatches) >= 6
    rank0, rank1 = torch.load(tmp_path / "local_expert_names.pt")   # EP=2: experts 0-1 on rank 0, 2-3 on rank 1
    assert rank0 and not set(rank0) & set(rank1)
    assert sorted(rank0 + rank1) == sorted(n for n in HFCheckpoint(tiny_hf).keys() if ".experts." in n)
    assert all(".experts.0." in n or ".experts.1." in n for n in rank0)
    # Already-quantized weight sync from the sharded model == offline quantization of the HF weights.
    live = torch.load(tmp_path / "live_nvfp4.pt")
    dims = qwen3_moe.dims_from_hf_config(config)
    plan = QuantPlan.resolve(QuadsRecipe(), dims)
    with HFCheckpoint(tiny_hf) as ckpt:
        expected = {n: t for n, t in quantize_named_params(((n, ckpt.get(n).float()) for n in ckpt.keys()), plan)
                    if ".experts." in n}
    stacked = torch.load(tmp_path / "live_nvfp4_stacked.pt")   # the layer stream, experts gathered over EP
    for got in (live, stacked):
        assert got.keys() == expected.keys()
        for name, t in expected.items():
            assert got[name].dtype == t.dtype and torch.equal(_bits(got[name]), _bits(t)), name


def _bits(t):
    return t.reshape(-1).view(torch.uint8)


def test_trainer_checkpoint_to_hf_to_rollout_keeps_the_recipe(tiny_hf, tp1_megatron, tmp_path):
    """A checkpoint saved by the trainer (AQAT model, recipe in common state, no HF config) converts with
    --preset; its recipe travels as quads_recipe.json and decides the rollout export's BF16 carve-outs."""
    import json

    from quads_megatron.convert import rollout_export
    from quads_megatron.convert.megatron_checkpoint import build_model_from_hf_config, load_megatron_checkpoint
    from quads_megatron.megatron.aqat import apply_quads
    from quads_megatron.megatron.checkpoint import save_checkpoint
    from quads_megatron.recipe import QuadsRecipe

    config = HFCheckpoint(tiny_hf).config
    model = build_model_from_hf_config(config)
    load_megatron_checkpoint(model, tp1_megatron)
    recipe = QuadsRecipe(bf16_last_layers=1)
    apply_quads(model, recipe)
    save_checkpoint(model, str(tmp_path / "trainer"))
    with pytest.raises(Exception, match="pass --hf-config"):
        megatron_to_hf.main(["--load-dir", str(tmp_path / "trainer"), "--save-dir", str(tmp_path / "x")])
    megatron_to_hf.main(["--load-dir", str(tmp_path / "trainer"), "--save-dir", str(tmp_path / "hf"), "--bf16",
                         "--preset", "tiny", "--no-progress"])
    assert_same_checkpoint(tiny_hf, tmp_path / "hf")
    assert QuadsRecipe.from_json((tmp_path / "hf" / "quads_recipe.json").read_text()) == recipe
    rollout_export.main(["--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "rollout"),
                         "--rollout-precision", "w4a16", "--no-progress"])
    qc = json.loads((tmp_path / "rollout" / "config.json").read_text())["quantization_config"]
    assert "model.layers.1.mlp.experts*" in qc["exclude_modules"] and qc["recipe"] == recipe.replace(rollout_precision="w4a16").to_dict()


def test_tied_embeddings_round_trip(tmp_path):
    """tie_word_embeddings: no lm_head on disk, Megatron shares embedding and output layer."""
    from convert_fixtures import save_tiny_hf

    hf = save_tiny_hf(tmp_path / "hf", tie_word_embeddings=True)
    assert "lm_head.weight" not in HFCheckpoint(hf)
    hf_to_megatron.main(["--load-dir", str(hf), "--save-dir", str(tmp_path / "mg"), "--bf16", "--no-progress"])
    megatron_to_hf.main(["--load-dir", str(tmp_path / "mg"), "--save-dir", str(tmp_path / "back"), "--bf16", "--no-progress"])
    assert_same_checkpoint(hf, tmp_path / "back")


def test_unnormalised_top_k_router_logits_match(tmp_path):
    """norm_topk_prob=False maps to moe_router_pre_softmax=True (softmax over all experts, then top-k)."""
    from convert_fixtures import save_tiny_hf
    from quads_megatron.convert.megatron_checkpoint import build_model_from_hf_config, load_megatron_checkpoint

    hf = save_tiny_hf(tmp_path / "hf", norm_topk_prob=False)
    hf_to_megatron.main(["--load-dir", str(hf), "--save-dir", str(tmp_path / "mg"), "--bf16", "--no-progress"])
    config = HFCheckpoint(hf).config
    model = build_model_from_hf_config(config, params_dtype=torch.float32)
    load_megatron_checkpoint(model, tmp_path / "mg")
    assert model.config.moe_router_pre_softmax
    ids = _ids(config["vocab_size"])
    with torch.no_grad():
        ours = model.eval()(ids, torch.arange(16).expand(2, -1), None)[..., : config["vocab_size"]]
    torch.testing.assert_close(ours, _hf_logits(hf, ids), rtol=0, atol=LOGITS_ATOL)
