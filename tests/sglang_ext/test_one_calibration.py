"""One calibration for the whole rollout side (issue 23): the exported checkpoint, the local engine after a weight
sync and SGLang's quads methods after loading that checkpoint hold bit-identical input scales and RAC indices.

One tiny two-layer Qwen3-MoE (experts and attention NVFP4, W4A4 + RAC) and one calibration set; static and
per-token activation scaling; with and without BF16 carve-outs (the first layer, and layer 1's o_proj, by
pattern). The exporter calibrates a rollout model it builds from the HF files, the engine its own modules
(after first syncing other weights and calibrating on them, so the numbers compared are a recalibration),
and SGLang only reads what the exporter wrote: three paths, one expected set of tensors.
"""

from __future__ import annotations

import json

import pytest
import torch

from sglang_fixtures import TINY_HF

pytest.importorskip("sglang", reason="SGLang is not installed")

K = 16
CALIB = dict(num_samples=3, seq_len=12, seed=0)
CONFIG = {**TINY_HF, "num_hidden_layers": 2}


@pytest.fixture(autouse=True)
def torch_kernels(monkeypatch):
    monkeypatch.setenv("QUADS_BACKEND", "torch")  # loading and calibration are compared, not kernels


def _save_hf(path, seed: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.empty_like(p).uniform_(0.7, 1.3) if p.ndim == 1 else torch.randn_like(p) * 0.05)
        model.model.embed_tokens.weight[:, 5] *= 20  # an outlier channel: RAC has something to pick
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("one_calibration")
    return _save_hf(root / "hf", seed=0), _save_hf(root / "hf_other", seed=1)


def _recipe(carve_outs: bool, scaling: str):
    from quads_megatron.recipe import QuadsRecipe

    extra = dict(bf16_first_layers=1, bf16_patterns=["model.layers.1.self_attn.o_proj"]) if carve_outs else {}
    return QuadsRecipe(rollout_precision="w4a4_rac", rac_channels=K, activation_scaling=scaling,
                       scope=["routed_experts", "attention"], **extra)


def _hf_stream(path):
    from quads_megatron.convert.hf_checkpoint import HFCheckpoint

    with HFCheckpoint(path) as ck:
        return [(n, ck.get(n)) for n in ck.keys()]


def _export(hf, out, recipe, scaling):
    from quads_megatron.convert import rollout_export

    (out.parent / "recipe.json").write_text(recipe.to_json())
    rollout_export.main(["--load-dir", str(hf), "--save-dir", str(out), "--quads-recipe", str(out.parent / "recipe.json"),
                         "--rac-channels", str(K), "--activation-scaling", scaling, "--calib-size",
                         str(CALIB["num_samples"]), "--calib-seq-len", str(CALIB["seq_len"]), "--seed",
                         str(CALIB["seed"]), "--no-progress"])
    from quads_megatron.convert.hf_checkpoint import HFCheckpoint

    with HFCheckpoint(out) as ck:
        return {n: ck.get(n) for n in ck.keys() if n.endswith(("input_scale", "input_comp_index"))}


def _engine(hf, other, plan, dtype=torch.float32):
    """The local engine after the GRPO loop's sync: other weights synced and calibrated first, then these."""
    from transformers import Qwen3MoeConfig

    from quads_megatron.convert.calibration import random_prompts
    from quads_megatron.rl.engines.local import LocalEngine

    eng = LocalEngine(Qwen3MoeConfig(**CONFIG), plan, max_seq_len=32, device="cpu", dtype=dtype)
    prompts = [p.tolist() for p in random_prompts(CONFIG["vocab_size"], **CALIB)]
    for path in (other, hf):
        eng.update_weights(_hf_stream(path))
        eng.calibrate(prompts)
    return eng


def _sglang_layers(ckpt, layout):
    """SGLang's FusedMoE / QKVParallelLinear / RowParallelLinear of every NVFP4 unit, loaded from the export
    through the layers' own weight loaders, processed as after a load."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.linear import QKVParallelLinear, RowParallelLinear
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.model_loader.weight_utils import get_quant_config, safetensors_weights_iterator

    mc = ModelConfig(model_path=str(ckpt), quantization="quads")
    qc = get_quant_config(mc, LoadConfig(), {})
    hf = mc.hf_config
    E, H, D = hf.num_experts, hf.hidden_size, hf.head_dim
    layers = {}
    for g in layout:
        unit = g.name
        if g.experts and unit.endswith("gate_up_proj"):
            prefix = unit.rsplit(".", 1)[0]
            layers[prefix] = FusedMoE(num_experts=E, hidden_size=H, intermediate_size=hf.moe_intermediate_size,
                                      layer_id=g.layer, top_k=hf.num_experts_per_tok, params_dtype=torch.bfloat16,
                                      quant_config=qc, prefix=prefix)
        elif unit.endswith("qkv_proj"):
            layers[unit] = QKVParallelLinear(H, D, hf.num_attention_heads, hf.num_key_value_heads, bias=False,
                                             params_dtype=torch.bfloat16, quant_config=qc, prefix=unit)
        elif unit.endswith("o_proj"):
            layers[unit] = RowParallelLinear(hf.num_attention_heads * D, H, bias=False, params_dtype=torch.bfloat16,
                                             quant_config=qc, prefix=unit)
    mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", E)
    files = sorted(str(p) for p in ckpt.glob("*.safetensors"))
    for name, t in safetensors_weights_iterator(files):
        head, _, suffix = name.rpartition(".")
        if ".mlp.experts." in name:
            prefix = name.split(".mlp.experts.")[0] + ".mlp.experts"
            if prefix not in layers:
                continue
            layer = layers[prefix]
            rel = "experts." + name.split(".mlp.experts.")[1]
            for param_name, weight_name, expert_id, shard_id in mapping:
                if weight_name in rel:
                    target = rel.replace(weight_name, param_name)
                    p = dict(layer.named_parameters(prefix="experts"))[target]
                    p.weight_loader(p, t, target, shard_id=shard_id, expert_id=expert_id)
                    break
        elif ".self_attn." in name and head.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj"):
            proj = head.rsplit(".", 1)[-1]
            unit = head if proj == "o_proj" else head.rsplit(".", 1)[0] + ".qkv_proj"
            p = getattr(layers.get(unit), suffix, None) if unit in layers else None
            if p is None:
                continue
            if proj == "o_proj":
                p.weight_loader(p, t)
            else:
                p.weight_loader(p, t, proj[0])
    for layer in layers.values():
        layer.quant_method.process_weights_after_loading(layer)
    return qc, layers


@pytest.mark.parametrize("carve_outs", [False, True])
@pytest.mark.parametrize("scaling", ["per_token", "static"])
def test_export_engine_and_sglang_hold_the_same_calibration(sglang_runtime, hf_dirs, tmp_path, carve_outs, scaling):
    from quads_megatron.models import qwen3_moe
    from quads_megatron.plan import QuantPlan
    from quads_megatron.plan.layout import RolloutLayout

    hf, other = hf_dirs
    recipe = _recipe(carve_outs, scaling)
    plan = QuantPlan.resolve(recipe, qwen3_moe.dims_from_hf_config(json.loads((hf / "config.json").read_text())))
    layout = RolloutLayout(plan)
    static = scaling == "static"
    units = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    want = [f"model.layers.{i}.{u}" for i in (0, 1) for u in units]
    if carve_outs:
        want = [n for n in want if n.startswith("model.layers.1.") and "o_proj" not in n]
    assert [g.name for g in layout] == want

    disk = _export(hf, tmp_path / "ckpt", recipe, scaling)
    eng = _engine(hf, other, plan)
    qc, layers = _sglang_layers(tmp_path / "ckpt", layout)
    assert qc.rollout.static_activation_scale == static and qc.rollout.rac_channels == K
    if carve_outs:  # carved-out weights carry no activation-side tensors
        assert not [n for n in disk if n.startswith("model.layers.0.") or ".o_proj." in n]
    assert set(disk) == {f"{m[:-len('.weight')]}.{s}" for g in layout for m in g.members
                         for s in ("input_scale", "input_comp_index")}

    cal = eng.rollout.calibration
    for g in layout:
        c = cal[g.name]
        scale = c.input_scale
        assert scale.dtype == torch.float32 and float(scale) > 0
        mods = eng.nvfp4_modules
        for i, m in enumerate(g.members):
            base = m[: -len(".weight")]
            assert torch.equal(disk[f"{base}.input_scale"], scale), base
            idx = disk[f"{base}.input_comp_index"]
            assert idx.dtype == torch.int32 and idx.shape == (K,)
            # the engine's modules
            if g.experts:
                em = mods[g.name.rsplit(".", 1)[0]]
                fc1 = g.name.endswith("gate_up_proj")
                assert torch.equal(idx, em.w13_comp_index if fc1 else em.w2_comp_index[i]), base
                if static:
                    assert torch.equal(em.w13_input_scale if fc1 else em.w2_input_scale, scale), base
            else:
                lm = mods[base]
                assert torch.equal(idx, lm.comp_index), base
                assert torch.equal(lm.input_scale, scale) if static else lm.input_scale is None, base
        # SGLang's layers after loading the checkpoint
        if g.experts:
            sl = layers[g.name.rsplit(".", 1)[0]]
            if g.name.endswith("gate_up_proj"):
                assert torch.equal(sl.w13_input_scale.detach(), scale.expand(len(g.members) // 2, 2))
                assert torch.equal(sl.w13_comp_index, c.comp_index)
                if static:
                    assert torch.equal(sl.w13_input_global_scale, scale)
            else:
                assert torch.equal(sl.w2_input_scale.detach(), scale.expand(len(g.members)))
                assert torch.equal(sl.w2_input_comp_index.detach(), c.comp_index)
                if static:
                    assert torch.equal(sl.w2_input_global_scale, scale)
        else:
            sl = layers[g.name]
            n = len(g.members)
            assert torch.equal(sl.input_scale.detach(), scale.expand(n))
            assert torch.equal(sl.input_comp_index.detach(), c.comp_index.repeat(n))
            if static:
                assert torch.equal(sl.input_global_scale, scale)


def test_a_bf16_engine_calibrates_on_an_fp32_twin(hf_dirs, tmp_path):
    """An engine serving in BF16 (as on a GPU) calibrates an fp32 copy of itself: the checkpoint's numbers again."""
    from quads_megatron.models import qwen3_moe
    from quads_megatron.plan import QuantPlan
    from quads_megatron.plan.layout import RolloutLayout

    hf, other = hf_dirs
    recipe = _recipe(False, "static")
    plan = QuantPlan.resolve(recipe, qwen3_moe.dims_from_hf_config(json.loads((hf / "config.json").read_text())))
    disk = _export(hf, tmp_path / "ckpt", recipe, "static")
    eng = _engine(hf, other, plan, dtype=torch.bfloat16)
    assert eng.rollout._twin is not None and eng.model.dtype == torch.bfloat16
    for g in RolloutLayout(plan):
        c = eng.rollout.calibration[g.name]
        for i, m in enumerate(g.members):
            base = m[: -len(".weight")]
            assert torch.equal(disk[f"{base}.input_scale"], c.input_scale), base
            idx = c.comp_index[i] if g.per_member_rac else c.comp_index
            assert torch.equal(disk[f"{base}.input_comp_index"], idx), base
    experts = eng.nvfp4_modules["model.layers.0.mlp.experts"]
    assert torch.equal(experts.w2_input_scale, eng.rollout.calibration["model.layers.0.mlp.experts.down_proj"].input_scale)
