"""Rollout-trainer mismatch: |logp_train - logp_rollout| and k3 KL on the rollout's own tokens, per-layer errors."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from quads_megatron.recipe import QuadsRecipe
from quads_megatron.rl.batch import build_train_batch, encode_prompt
from quads_megatron.rl.engines.base import SamplingParams


@dataclass
class Setup:
    """One trainer (a GRPO job's policy, tokenizer, task) that engines of several precisions are compared against."""

    trainer: object  # quads_megatron.rl.loop.GRPOTrainer (its policy holds the weights)

    @property
    def policy(self):
        return self.trainer.policy

    def prompts(self, n: int, seed: int = 12345) -> list[list[int]]:
        """n training-distribution prompts of the task, token ids (a fixed, seeded draw)."""
        t = self.trainer
        return [encode_prompt(t.tokenizer, s.prompt) for s in t.task.train_batch(n, seed=seed)]


def build_setup(flags: list[str]) -> Setup:
    """A GRPO trainer from the job's own flags (weights from --hf-checkpoint or the SFT warm-up), ready to sync."""
    from quads_megatron.rl.arguments import parse_args
    from quads_megatron.rl.loop import GRPOTrainer

    trainer = GRPOTrainer(parse_args(flags))
    if trainer.args.hf_checkpoint:
        trainer.policy.load_hf_checkpoint()
    trainer.sft_warmup()
    return Setup(trainer)


def rollout_recipe(setup: Setup, precision: str, rac_channels: int) -> QuadsRecipe:
    """The trainer's recipe with another rollout precision (``rac_channels`` applies to w4a4_rac / quads only),
    through the CLIs' one ``recipe_from_args``."""
    import argparse

    from quads_megatron.recipe import recipe_from_args
    from quads_megatron.vocab import parse_precision

    rac = parse_precision(precision).uses_rac
    flags = argparse.Namespace(rollout_precision=precision, rac_channels=rac_channels if rac else None)
    return recipe_from_args(flags, base=setup.policy.recipe)


def make_engine(setup: Setup, recipe: QuadsRecipe, calib_prompts: list[list[int]]):
    """A local engine whose plan is ``recipe`` on the trainer's model, loaded with the trainer's weights."""
    from quads_megatron.megatron.aqat import plan_for_model
    from quads_megatron.rl.engines.local import LocalEngine

    p = setup.policy
    plan = plan_for_model(p.model, recipe)
    engine = LocalEngine(p.hf_config(), plan, max_seq_len=setup.trainer.args.seq_length, pad_token_id=setup.trainer.pad)
    engine.update_weights(p.hf_weights())
    if plan.rollout_precision.quantizes_activations:
        engine.calibrate(calib_prompts)
    return engine


def release(engine) -> None:
    """Free an engine's GPU memory before the next one is built."""
    engine.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.no_grad()
def rollout_gap(setup: Setup, engine, prompts: list[list[int]], sampling: SamplingParams, seed: int,
                micro_batch: int = 64) -> tuple[dict, torch.Tensor]:
    """Sample with the engine, score the same tokens with the trainer; (stats, per-token logp_train - logp_rollout).

    stats: mean_abs (mean |d|), k3_kl (mean of e^d - 1 - d, the k3 estimate of KL(rollout || trainer)), tokens.
    """
    rollouts = engine.generate(prompts, sampling, seed=seed)
    batch = build_train_batch(rollouts, torch.zeros(len(rollouts)), setup.trainer.pad)
    lp = torch.cat([setup.policy.token_logprobs(batch.tokens[i:i + micro_batch])[0].float().cpu()
                    for i in range(0, len(batch), micro_batch)])
    d = (lp - batch.rollout_logp)[batch.mask.bool()].double()
    stats = {"mean_abs": float(d.abs().mean()), "k3_kl": float((d.exp() - 1 - d).mean()), "tokens": int(d.numel())}
    return stats, d.float()


@torch.no_grad()
def layer_output_errors(reference, engine, prompts: list[list[int]]) -> list[float]:
    """Per MoE layer: ||moe_q(x) - moe(x)|| / ||moe(x)|| with x the reference engine's input to that layer.

    Each layer sees the reference's own hidden states, so the numbers are that layer's error alone
    (not the drift accumulated from earlier layers).
    """
    ref_layers, q_layers = reference.model.model.layers, engine.model.model.layers
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(i):
        def fn(module, args, out):
            seen[i] = (args[0].detach(), (out[0] if isinstance(out, tuple) else out).detach())
        return fn

    handles = [layer.mlp.register_forward_hook(hook(i)) for i, layer in enumerate(ref_layers)]
    try:
        reference._forward_full(prompts)
    finally:
        for h in handles:
            h.remove()
    errs = []
    for i, layer in enumerate(q_layers):
        x, y = seen[i]
        yq = layer.mlp(x)
        yq = yq[0] if isinstance(yq, tuple) else yq
        errs.append(float((yq.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)))
    return errs
