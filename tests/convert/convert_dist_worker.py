"""torchrun worker for test_megatron_roundtrip: every check that needs a TP=2 / EP=2 gloo layout, in one launch.

argv: HF_DIR TP1_MEGATRON_DIR OUT_DIR.  Writes under OUT_DIR:
  mg_tp2ep2/           HF -> Megatron written by TP=2, EP=2 (ETP=1)
  hf_tp2ep2_same/      that checkpoint -> HF, loaded in the same layout
  hf_tp1_in_tp2ep2/    the TP=1 checkpoint -> HF, loaded in TP=2 / EP=2
  logits_tp2ep2.pt     fp32 Megatron logits (TP=2 / EP=2) of the fixed ids
  live_nvfp4.pt        quantize_named_params(iter_hf_weights(...), default plan) from the TP=2 / EP=2 model (rank 0)
  live_nvfp4_stacked.pt     the same from iter_hf_weights(..., stacked_experts=True) (the layer stream)
  plan_mismatches.pt   {recipe: per rank, plan_bytes.plan_mismatches} for every plan_bytes.RECIPES entry
  local_expert_names.pt     per rank: expert tensor names iter_hf_weights(experts="local") yields
  fake_quant_mismatches.pt  per rank: expert weights where apply_quads' fake quant != the synced NVFP4
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist

LAYOUT = ["--bf16", "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
          "--expert-tensor-parallel-size", "1", "--no-progress"]


def main():
    hf_dir, tp1_dir, out = sys.argv[1:4]
    from quads_megatron.convert import hf_to_megatron, megatron_to_hf
    from quads_megatron.convert.hf_checkpoint import HFCheckpoint
    from quads_megatron.convert.live import iter_hf_weights
    from quads_megatron.convert.megatron_checkpoint import build_model_from_hf_config, load_megatron_checkpoint
    from quads_megatron.models import qwen3_moe
    from quads_megatron.plan import QuantPlan, quantize_named_params
    from quads_megatron.recipe import QuadsRecipe
    from plan_bytes import RECIPES, plan_mismatches

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
    plan = QuantPlan.resolve(QuadsRecipe(), qwen3_moe.dims_from_hf_config(config))
    for name, t in quantize_named_params(iter_hf_weights(model, vocab_size=config["vocab_size"]), plan):
        if ".experts." in name:
            live[name] = t.clone()
    stacked = {}   # the refit's layer stream (experts gathered over EP into one item per layer)
    for name, t in quantize_named_params(iter_hf_weights(model, vocab_size=config["vocab_size"], stacked_experts=True),
                                         plan):
        if ".experts." in name:
            stacked[name] = t.clone()
    local = [None] * dist.get_world_size()   # experts="local": each EP rank sends only its own experts
    dist.all_gather_object(local, sorted(n for n, _ in iter_hf_weights(model, experts="local") if ".experts." in n))
    mismatches = {}
    for key, fields in RECIPES.items():
        fresh = build_model_from_hf_config(config, tp=2, ep=2, etp=1, params_dtype=torch.float32)
        load_megatron_checkpoint(fresh, f"{out}/mg_tp2ep2")
        bad = [None] * dist.get_world_size()
        dist.all_gather_object(bad, plan_mismatches(fresh, QuadsRecipe.from_dict(fields), hf_dir,
                                                    f"{out}/plan_{key}", config["vocab_size"]))
        mismatches[key] = bad
    if dist.get_rank() == 0:
        torch.save(mismatches, f"{out}/plan_mismatches.pt")
        torch.save(local, f"{out}/local_expert_names.pt")
        torch.save(logits, f"{out}/logits_tp2ep2.pt")
        torch.save(live, f"{out}/live_nvfp4.pt")
        torch.save(stacked, f"{out}/live_nvfp4_stacked.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
