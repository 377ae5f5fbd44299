"""One recipe, four consumers, the same NVFP4 bytes: trainer forward == export == SGLang sync payload == local engine.

``plan_mismatches`` runs on every rank of a (possibly TP/EP-sharded) Megatron model loaded
from the tiny HF checkpoint and returns the weights where any two consumers disagree
(empty when the quantization plan is honoured everywhere).  The expectations are the
consumers' outputs compared with each other and with the plan's decisions, plus the
trainer's fake-quantized shard against the dequantized synced bytes re-sharded with the
converter's layout table (independent of the quantizer).
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist

RECIPES = {
    "default": {},
    "first_layer_bf16": {"bf16_first_layers": 1},
    "attention_last_layer_bf16": {"scope": ["routed_experts", "attention"], "bf16_last_layers": 1},
    "attention_o_proj_pattern": {"scope": ["routed_experts", "attention"],
                                 "bf16_patterns": ["model.layers.0.self_attn.o_proj",
                                                   "model.layers.1.mlp.experts.*"]},
    "symmetric_w4a4_16x16": {"train_precision": "w4a4", "rollout_precision": "w4a4",
                             "block_shape": [16, 16], "scope": ["attention", "routed_experts"]},
    "bf16_trainer": {"train_precision": "bf16", "rollout_precision": "w4a4"},
}


def _rank0():
    return not dist.is_initialized() or dist.get_rank() == 0


def _bits(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _export(hf_dir, recipe, out):
    from safetensors.torch import load_file

    from quads_megatron.convert import rollout_export

    (out.parent / "recipe.json").write_text(recipe.to_json())
    rollout_export.main(["--load-dir", str(hf_dir), "--save-dir", str(out), "--quads-recipe", str(out.parent / "recipe.json"),
                         "--calib-size", "2", "--calib-seq-len", "8", "--no-progress", "--force"])
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _engine_tensors(hf_dir, plan, stream):
    """What the local engine holds after a weight update, by ModelOpt / HF name."""
    from transformers import AutoConfig

    from quads_megatron.rl.engines.local import LocalEngine

    engine = LocalEngine(AutoConfig.from_pretrained(str(hf_dir)), plan, device="cpu", dtype=torch.float32)
    engine.update_weights(stream)
    out, F = {}, plan.dims.moe_ffn
    for prefix, m in engine.nvfp4_modules.items():  # codes and scales read back in ModelOpt order (the kernel layout's inverse)
        if hasattr(m, "w13"):
            w13, w2 = m.modelopt_codes("w13"), m.modelopt_codes("w2")
            s13, s2 = m.modelopt_scales("w13"), m.modelopt_scales("w2")
            for e in range(m.num_experts):
                for proj, rows in (("gate_proj", slice(0, F)), ("up_proj", slice(F, 2 * F))):
                    base = f"{prefix}.{e}.{proj}"
                    out.update({f"{base}.weight": w13[e, rows], f"{base}.weight_scale": s13[e, rows],
                                f"{base}.weight_scale_2": m.w13_scale_2[e]})
                base = f"{prefix}.{e}.down_proj"
                out.update({f"{base}.weight": w2[e], f"{base}.weight_scale": s2[e],
                            f"{base}.weight_scale_2": m.w2_scale_2[e]})
        else:
            out.update({f"{prefix}.weight": m.modelopt_codes(), f"{prefix}.weight_scale": m.modelopt_scales(),
                        f"{prefix}.weight_scale_2": m.weight_scale_2})
    return out


def plan_mismatches(model, recipe, hf_dir, work_dir, vocab_size) -> list:
    """Names where trainer / export / sync / local engine disagree for ``recipe`` (collective)."""
    from quads_megatron import nvfp4
    from quads_megatron.models import qwen3_moe
    from quads_megatron.convert.live import iter_hf_weights
    from quads_megatron.convert.megatron_params import global_param_refs, parallel_info
    from quads_megatron.megatron.aqat import apply_quads, fake_quantized_state, plan_for_model
    from quads_megatron.plan import quantize_named_params

    plan = plan_for_model(model, recipe)
    if plan.train_quantizes:
        apply_quads(model, recipe)
    trainer = fake_quantized_state(model)
    high = {n: t.clone() for n, t in iter_hf_weights(model, vocab_size=vocab_size)}
    sent = dict(quantize_named_params(iter_hf_weights(model, vocab_size=vocab_size), plan))
    bad = []
    info, dims = parallel_info(), plan.dims
    # trainer: exactly the plan's trainer-NVFP4 weights are fake-quantized, to the synced bytes
    expect_trainer = set()
    for ref in global_param_refs(model):
        plans = plan.for_megatron(ref.global_name)
        if not plans or not plans[0].train.quantizes_weights:
            continue
        expect_trainer.add(ref.local_name)
        names = qwen3_moe.hf_names(ref.rule, ref.layer, ref.expert)
        if not plans[0].rollout.quantizes_weights:
            hf = [nvfp4.dequantize(q, torch.float32) for q in nvfp4.quantize_with_shared_scale(
                [high[n] for n in names], block_shape=plans[0].block_shape)]
        else:
            hf = [nvfp4.NVFP4Tensor.from_modelopt(sent[n[:-7] + ".weight"], sent[n[:-7] + ".weight_scale"],
                                                  sent[n[:-7] + ".weight_scale_2"]).dequantize(torch.float32)
                  for n in names]
        full = qwen3_moe.to_megatron(ref.rule, hf, dims).to(ref.param.dtype)
        rank, size = (info["etp_rank"], info["etp_size"]) if ref.rule.expert else (info["tp_rank"], info["tp_size"])
        got = trainer.get(ref.local_name)
        if got is None or not torch.equal(qwen3_moe.shard(ref.rule, full, rank, size), got):
            bad.append(f"trainer:{ref.global_name}")
    if set(trainer) != expect_trainer:
        bad.append(f"trainer targets: {sorted(set(trainer) ^ expect_trainer)[:4]}")
    if not _rank0():
        return bad
    Path(work_dir).mkdir(parents=True, exist_ok=True)
    # sync, export and local engine: the plan's rollout decision, the same bytes
    exported = _export(hf_dir, recipe, Path(work_dir) / "rollout")
    engine = _engine_tensors(hf_dir, plan, high.items()) if plan.rollout_quantizes else {}
    for t in plan:
        base = t.module
        if t.quantized:
            for suffix in ("weight", "weight_scale", "weight_scale_2"):
                n = f"{base}.{suffix}"
                if n not in sent or n not in exported or n not in engine:
                    bad.append(f"missing:{n}")
                elif not (_same(sent[n], exported[n]) and _same(sent[n].reshape(engine[n].shape), engine[n])):
                    bad.append(f"bytes:{n}")
        elif not (t.name in sent and t.name in exported and sent[t.name].dtype.is_floating_point
                  and torch.equal(sent[t.name].to(exported[t.name].dtype), exported[t.name])):
            bad.append(f"bf16:{t.name}")
    qc = json.loads((Path(work_dir) / "rollout" / "config.json").read_text())["quantization_config"]
    if qc["exclude_modules"] != plan.exclude_modules():
        bad.append("exclude_modules")
    return bad
