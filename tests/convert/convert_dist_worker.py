"""torchrun worker for test_megatron_roundtrip: every check that needs a TP=2 / EP=2 gloo layout, in one launch.

argv: HF_DIR TP1_MEGATRON_DIR OUT_DIR.  Writes under OUT_DIR:
  mg_tp2ep2/           HF -> Megatron written by TP=2, EP=2 (ETP=1)
  hf_tp2ep2_same/      that checkpoint -> HF, loaded in the same layout
  hf_tp1_in_tp2ep2/    the TP=1 checkpoint -> HF, loaded in TP=2 / EP=2
  logits_tp2ep2.pt     fp32 Megatron logits (TP=2 / EP=2) of the fixed ids
  live_nvfp4.pt        iter_hf_weights(scope=QuantScope()) from the TP=2 / EP=2 model (rank 0)
  local_expert_names.pt     per rank: expert tensor names iter_hf_weights(experts="local") yields
  fake_quant_mismatches.pt  per rank: expert weights where apply_quads' fake quant != the synced NVFP4
"""

import sys

import torch
import torch.distributed as dist

LAYOUT = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
          "--expert-tensor-parallel-size", "1", "--no-progress"]


def fake_quant_mismatches(model, vocab_size) -> list:
    """Names of expert weights where the trainer's AQAT fake quantization (``apply_quads``) differs from
    dequantizing what ``iter_hf_weights(scope=recipe scope)`` sends to the rollout engine (must be [])."""
    from quads_megatron import nvfp4
    from quads_megatron.convert import qwen3_moe
    from quads_megatron.convert.live import hf_dims_of, iter_hf_weights
    from quads_megatron.convert.megatron_params import global_param_refs, parallel_info
    from quads_megatron.convert.nvfp4_export import scope_from_recipe
    from quads_megatron.megatron.aqat import apply_quads, fake_quantized_state
    from quads_megatron.recipe import QuadsRecipe

    recipe = QuadsRecipe()
    apply_quads(model, recipe)
    trainer = fake_quantized_state(model)
    dims = hf_dims_of(model, vocab_size)
    sent = dict(iter_hf_weights(model, vocab_size=vocab_size, scope=scope_from_recipe(recipe, dims)))
    info = parallel_info()
    bad = []
    for ref in global_param_refs(model):
        if not ref.rule.expert:
            continue
        hf = [nvfp4.NVFP4Tensor.from_modelopt(sent[n[:-7] + ".weight"], sent[n[:-7] + ".weight_scale"],
                                              sent[n[:-7] + ".weight_scale_2"]).dequantize(ref.param.dtype)
              for n in qwen3_moe.hf_names(ref.rule, ref.layer, ref.expert)]
        full = qwen3_moe.to_megatron(ref.rule, hf, dims)
        if not torch.equal(qwen3_moe.shard(ref.rule, full, info["etp_rank"], info["etp_size"]),
                           trainer[ref.local_name]):
            bad.append(ref.global_name)
    return bad


def main():
    hf_dir, tp1_dir, out = sys.argv[1:4]
    from quads_megatron.convert import hf_to_megatron, megatron_to_hf
    from quads_megatron.convert.hf_checkpoint import HFCheckpoint
    from quads_megatron.convert.live import iter_hf_weights
    from quads_megatron.convert.megatron_checkpoint import build_model_from_hf_config, load_megatron_checkpoint
    from quads_megatron.convert.nvfp4_export import QuantScope

    hf_to_megatron.main(["--load-dir", hf_dir, "--save-dir", f"{out}/mg_tp2ep2", *LAYOUT])
    megatron_to_hf.main(["--load-dir", f"{out}/mg_tp2ep2", "--save-dir", f"{out}/hf_tp2ep2_same", *LAYOUT])
    megatron_to_hf.main(["--load-dir", tp1_dir, "--save-dir", f"{out}/hf_tp1_in_tp2ep2", *LAYOUT])

    config = HFCheckpoint(hf_dir).config
    model = build_model_from_hf_config(config, tp=2, ep=2, etp=1, params_dtype=torch.float32,
                                       parallel_output=False)
    load_megatron_checkpoint(model, f"{out}/mg_tp2ep2")
    model.eval()
    ids = torch.arange(32).remainder(config["vocab_size"]).reshape(2, 16) * 7 % config["vocab_size"]
    with torch.no_grad():
        logits = model(ids, torch.arange(16).expand(2, -1), None)
    live = {}
    for name, t in iter_hf_weights(model, vocab_size=config["vocab_size"], scope=QuantScope()):
        if ".experts." in name:
            live[name] = t.clone()
    local = [None] * dist.get_world_size()   # experts="local": each EP rank sends only its own experts
    dist.all_gather_object(local, sorted(n for n, _ in iter_hf_weights(model, experts="local") if ".experts." in n))
    bad = [None] * dist.get_world_size()
    dist.all_gather_object(bad, fake_quant_mismatches(model, config["vocab_size"]))
    if dist.get_rank() == 0:
        torch.save(bad, f"{out}/fake_quant_mismatches.pt")
        torch.save(local, f"{out}/local_expert_names.pt")
        torch.save(logits, f"{out}/logits_tp2ep2.pt")
        torch.save(live, f"{out}/live_nvfp4.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
