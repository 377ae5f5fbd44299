"""torchrun worker for test_aqat_distributed.py: every 2-rank AQAT check in one launch (launches cost ~20 s).

  torchrun --nproc-per-node 2 tests/megatron/dist_worker.py OUT_DIR

Each rank writes OUT_DIR/rank{r}.json with the check results; the test asserts on them.
The ``__main__`` guard is required: dist_checkpointing's async writer spawns a Manager.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

VOCAB, SEQ, BATCH = 256, 16, 2


def _gather(t, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _full_fc1(local, group):
    """Logical [gate; up] from per-rank [gate_r; up_r] shards."""
    halves = [p.chunk(2, dim=0) for p in _gather(local, group)]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves])


def _full_fc2(local, group):
    return torch.cat(_gather(local, group), dim=1)


def _batch(step):
    from megatron.core import parallel_state

    g = torch.Generator().manual_seed(1000 * step + parallel_state.get_data_parallel_rank())
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.arange(SEQ).expand(BATCH, SEQ), torch.roll(tokens, -1, dims=1)


def check_layout(tp, ep, etp):
    """Gathered fake-quant shards == dequantize(quantize(full weight)) bitwise; gate/up share a scale."""
    from megatron.core import parallel_state

    from quads_megatron import nvfp4
    from quads_megatron.megatron.aqat import apply_quads, fake_quantized_state, quads_targets
    from quads_megatron.megatron.model import _expert_seed, _full_expert_weight, build_gpt_model
    from quads_megatron.megatron.parallel import initialize_distributed
    from quads_megatron.megatron.presets import qwen3_moe_config
    from quads_megatron.recipe import QuadsRecipe

    initialize_distributed(tp=tp, ep=ep, etp=etp)
    cfg = qwen3_moe_config("tiny", tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                           expert_tensor_parallel_size=etp)
    model = build_gpt_model(cfg, VOCAB, SEQ)
    apply_quads(model, QuadsRecipe())
    tokens, pos, labels = _batch(0)
    loss = model(tokens, pos, None, labels=labels).mean()   # exercises the wrapped forward
    loss.backward()
    fq = fake_quantized_state(model)
    targets = quads_targets(model)
    params = dict(model.named_parameters())
    group = parallel_state.get_expert_tensor_parallel_group()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    H, F = cfg.hidden_size, cfg.moe_ffn_hidden_size
    res = dict(bitwise=True, logical=True, shared_scale=True, group_size_ok=True, checked=0,
               local_differs=False, naive_differs=False, finite_loss=bool(torch.isfinite(loss)),
               loss=loss.item())
    for layer in model.decoder.layers:
        experts = layer.mlp.experts
        for i in range(experts.num_local_experts):
            expert = ep_rank * experts.num_local_experts + i
            base = f"decoder.layers.{layer.layer_number - 1}.mlp.experts.local_experts.{i}"
            w1, w2 = params[f"{base}.linear_fc1.weight"].detach(), params[f"{base}.linear_fc2.weight"].detach()
            full1, full2 = _full_fc1(w1, group), _full_fc2(w2, group)
            q1 = _full_fc1(fq[f"{base}.linear_fc1.weight"], group)
            q2 = _full_fc2(fq[f"{base}.linear_fc2.weight"], group)
            ref1 = nvfp4.dequantize(nvfp4.quantize(full1), w1.dtype)
            ref2 = nvfp4.dequantize(nvfp4.quantize(full2), w2.dtype)
            res["bitwise"] &= torch.equal(q1, ref1) and torch.equal(q2, ref2)
            # the sharded model holds the layout-independent per-expert weights
            exp1 = _full_expert_weight(cfg.init_method, (2 * F, H), cfg.params_dtype,
                                       _expert_seed(1234, layer.layer_number, expert, "fc1"))
            exp2 = _full_expert_weight(cfg.output_layer_init_method, (H, F), cfg.params_dtype,
                                       _expert_seed(1234, layer.layer_number, expert, "fc2"))
            res["logical"] &= torch.equal(full1, exp1) and torch.equal(full2, exp2)
            # gate and up: one global scale, the max of their amaxes, = the all-reduced one
            wfq = targets[f"{base}.linear_fc1"].weights["weight"]
            gate, up = full1.chunk(2)
            shared = nvfp4.shared_amax([gate, up])
            res["shared_scale"] &= bool(wfq.global_amax(w1) == shared) and bool(
                nvfp4.quantize(full1).global_scale == nvfp4.global_decode_scale(shared))
            res["group_size_ok"] &= dist.get_world_size(wfq.group) == (etp or tp)
            # a shard's own amax is not the global one somewhere (so the all-reduce matters)
            res["local_differs"] |= bool(
                nvfp4.amax_of(w2) != targets[f"{base}.linear_fc2"].weights["weight"].global_amax(w2))
            # negative control: quantizing each shard with its own amax breaks the contract
            naive2 = _full_fc2(nvfp4.dequantize(nvfp4.quantize(w2), w2.dtype), group)
            res["naive_differs"] |= not torch.equal(naive2, ref2)
            res["checked"] += 1
    return res


def check_activation_quant_tp(tp):
    """nvfp4 activation mode under expert-TP: fc2's K-sharded input, gathered, = fake_quantize(full input)."""
    from megatron.core import parallel_state

    from quads_megatron import nvfp4
    from quads_megatron.megatron.aqat import apply_quads
    from quads_megatron.megatron.model import build_gpt_model
    from quads_megatron.megatron.parallel import initialize_distributed
    from quads_megatron.megatron.presets import qwen3_moe_config
    from quads_megatron.recipe import QuadsRecipe

    initialize_distributed(tp=tp)
    cfg = qwen3_moe_config("tiny", tensor_model_parallel_size=tp)
    model = apply_quads(build_gpt_model(cfg, VOCAB, SEQ), QuadsRecipe(train_precision="w4a4"))
    seen = []
    for fc2 in (e.linear_fc2 for e in model.decoder.layers[0].mlp.experts.local_experts):
        record = {}
        fc2.register_forward_pre_hook(lambda m, a, r=record: r.setdefault("raw", a[0].detach()))
        real = fc2._forward_impl

        def spy(input, weight, *args, _real=real, _r=record, **kwargs):
            _r.setdefault("gemm", input.detach())
            return _real(input, weight, *args, **kwargs)

        fc2._forward_impl = spy
        seen.append(record)
    tokens, pos, labels = _batch(0)
    model(tokens, pos, None, labels=labels)
    group = parallel_state.get_expert_tensor_parallel_group()
    ok, checked = True, 0
    for record in seen:
        if record["raw"].shape[0] == 0:
            continue
        raw = torch.cat(_gather(record["raw"], group), dim=-1)
        gemm = torch.cat(_gather(record["gemm"], group), dim=-1)
        ok &= torch.equal(gemm, nvfp4.fake_quantize(raw, per_row=True))
        checked += 1
    return dict(bitwise=ok, checked=checked)


def check_checkpoint_resume(tp, ep, ckpt_dir):
    """Megatron DDP + optimizer: save after 2 steps, load into a fresh model, next losses identical."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from quads_megatron.megatron.aqat import apply_quads, quads_recipe, register_post_optimizer_hook
    from quads_megatron.megatron.checkpoint import load_checkpoint, load_recipe, save_checkpoint
    from quads_megatron.megatron.cpu import cuda_to_cpu
    from quads_megatron.megatron.model import build_gpt_model
    from quads_megatron.megatron.parallel import initialize_distributed
    from quads_megatron.megatron.presets import qwen3_moe_config
    from quads_megatron.recipe import QuadsRecipe

    initialize_distributed(tp=tp, ep=ep)
    cfg = qwen3_moe_config("tiny", tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    recipe = QuadsRecipe(bf16_last_layers=1, activation_scaling="static")

    def build(seed):
        model = apply_quads(build_gpt_model(cfg, VOCAB, SEQ, expert_seed=seed), recipe if seed == 1
                            else load_recipe(ckpt_dir))
        ddp = DistributedDataParallel(
            config=cfg, module=model,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False))
        with cuda_to_cpu():
            opt = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=3e-3, weight_decay=0.0, bf16=False, fp16=False,
                                params_dtype=torch.float32, clip_grad=1.0), [ddp])
        register_post_optimizer_hook(opt, ddp)
        return ddp, opt

    def step(ddp, opt, k):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        tokens, pos, labels = _batch(k)
        loss = ddp(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        finalize_model_grads([ddp])
        with cuda_to_cpu():
            opt.step()
        return loss.item()

    ddp, opt = build(1)
    first = [step(ddp, opt, k) for k in range(2)]
    save_checkpoint(ddp, ckpt_dir, opt)
    saved = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    after = [step(ddp, opt, k) for k in range(2, 4)]
    fresh, fresh_opt = build(2)
    differs_before = any(not torch.equal(p, saved[n]) for n, p in fresh.module.named_parameters())
    load_checkpoint(fresh, ckpt_dir, fresh_opt)
    masters = all(torch.equal(p, saved[n]) for n, p in fresh.module.named_parameters())
    resumed = [step(fresh, fresh_opt, k) for k in range(2, 4)]
    return dict(first=first, after=after, resumed=resumed, masters_equal=masters,
                fresh_differed=differs_before, recipe_equal=quads_recipe(fresh) == recipe,
                fp32_masters=all(p.dtype == torch.float32 for p in fresh.module.parameters()))


def main():
    out_dir = sys.argv[1]
    from quads_megatron.megatron.parallel import initialize_distributed

    initialize_distributed()
    rank = dist.get_rank()
    results = {}
    for tp, ep, etp in ((1, 1, None), (2, 1, None), (1, 2, None), (2, 2, 1)):
        results[f"tp{tp}_ep{ep}_etp{etp or tp}"] = check_layout(tp, ep, etp)
    results["act_tp2"] = check_activation_quant_tp(2)
    ckpt = os.path.join(out_dir, "ckpt")
    results["resume"] = check_checkpoint_resume(1, 2, ckpt)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
