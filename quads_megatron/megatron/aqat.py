"""Asymmetric NVFP4 QAT for a Megatron-Core GPTModel: ``apply_quads(model, recipe)`` + ``post_optimizer_hook(model)``.

A model converter in the shape of torchtitan's float8 one.  It finds the recipe's target
modules in a GPTModel built with Megatron's own layer specs and wraps their ``forward`` so
that, for the duration of the call, each weight attribute reads the NVFP4 fake-quantized
weight (straight-through gradient to the BF16/FP32 master Parameter).  The Parameters
themselves are untouched, so ``state_dict``/``sharded_state_dict`` names, optimizers and
dist_checkpointing see exactly the unquantized model.  Activation mode ``nvfp4`` also
fake-quantizes each target's input (the naive symmetric baseline).

Cost: each quantized weight is fake-quantized once per optimizer step and cached (one extra
copy of those weights in memory; ``QuadsRecipe(cache_weights=False)`` trades it for
re-quantizing every forward).  Run ``post_optimizer_hook(model)`` after each step, or once
``register_post_optimizer_hook(optimizer, model)``: Megatron's mixed-precision/distributed
optimizers update params through ``.data``, which the cache's ``_version`` key cannot see.
Convert before wrapping in Megatron DDP; set ``gradient_accumulation_fusion=False``.

Expert layer classes: ``SequentialMLP`` (local spec; ColumnParallelLinear fc1 holding
[gate; up] and RowParallelLinear fc2), legacy ``GroupedMLP`` (``weight1``/``weight2``; weights
only), ``TEGroupedMLP`` (TE GroupedLinear ``weight{i}``; guarded, untested here: no TE).
"""

import fnmatch
import types

import torch

from quads_megatron.megatron.fake_quant import WeightFakeQuant, fake_quantize_activation
from quads_megatron.recipe import QuadsRecipe


class QuadsTarget:
    """One wrapped module: its fake-quantized weights, input quantization and parallel group."""

    def __init__(self, name, module, weights, group, quantize_input, act_scaling, k_sharded):
        self.name, self.module, self.weights, self.group = name, module, weights, group
        self.quantize_input, self.act_scaling, self.k_sharded = quantize_input, act_scaling, k_sharded
        self.inner_forward = module.forward

    def fake_quantized(self):
        """{param name: fake-quantized weight} as the forward pass sees it (cached)."""
        return {n: q.value(self.module._parameters[n]) for n, q in self.weights.items()}

    def invalidate(self):
        for q in self.weights.values():
            q.invalidate()


def _quads_forward(self, *args, **kwargs):
    """Forward of a wrapped module: NVFP4 weights (and inputs) for the duration of the call."""
    target = self._quads
    if target.quantize_input:
        if args:
            args = (fake_quantize_activation(args[0], target.act_scaling, target.group,
                                             target.k_sharded),) + tuple(args[1:])
        elif "input_" in kwargs:
            kwargs["input_"] = fake_quantize_activation(kwargs["input_"], target.act_scaling,
                                                        target.group, target.k_sharded)
    swapped = {n: q(self._parameters[n]) for n, q in target.weights.items()}
    # Instance attributes shadow nn.Module's parameter lookup; _parameters stays as it is.
    self.__dict__.update(swapped)
    try:
        return target.inner_forward(*args, **kwargs)
    finally:
        for n in swapped:
            self.__dict__.pop(n, None)


def unwrap_model(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, "decoder"):
        raise TypeError(f"apply_quads expects a Megatron-Core GPTModel (or a wrapper of one), "
                        f"got {type(model).__name__}")
    return model


def _group_of(module, is_expert):
    group = getattr(module, "tp_group", None)
    if group is not None:
        return group
    from megatron.core import parallel_state

    return (parallel_state.get_expert_tensor_parallel_group() if is_expert
            else parallel_state.get_tensor_model_parallel_group())


def _candidates(layer_name, layer):
    """(scope, name, module, kind, is_expert, k_sharded) for every quantizable module of one layer."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe import experts as moe_experts
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    SequentialMLP = moe_experts.SequentialMLP
    GroupedMLP = getattr(moe_experts, "GroupedMLP", ())  # legacy; gone in megatron-core 0.19

    out = []
    attn = getattr(layer, "self_attention", None)
    for sub, k_sharded in (("linear_qkv", False), ("linear_proj", True)):
        if attn is not None and hasattr(attn, sub):
            out.append(("attention", f"{layer_name}.self_attention.{sub}", getattr(attn, sub),
                        "linear", False, k_sharded))
    mlp = getattr(layer, "mlp", None)

    def mlp_pair(scope, prefix, m, is_expert):
        return [(scope, f"{prefix}.linear_fc1", m.linear_fc1, "linear", is_expert, False),
                (scope, f"{prefix}.linear_fc2", m.linear_fc2, "linear", is_expert, True)]

    if isinstance(mlp, BaseMoELayer):
        experts, prefix = mlp.experts, f"{layer_name}.mlp.experts"
        if isinstance(experts, SequentialMLP):
            for i, expert in enumerate(experts.local_experts):
                out += mlp_pair("routed_experts", f"{prefix}.local_experts.{i}", expert, True)
        elif isinstance(experts, GroupedMLP):
            out.append(("routed_experts", prefix, experts, "grouped", True, False))
        elif hasattr(experts, "linear_fc1") and hasattr(experts.linear_fc1, "weight0"):
            out.append(("routed_experts", f"{prefix}.linear_fc1", experts.linear_fc1, "te_grouped",
                        True, False))
            out.append(("routed_experts", f"{prefix}.linear_fc2", experts.linear_fc2, "te_grouped",
                        True, True))
        else:
            raise TypeError(f"{prefix}: expert class {type(experts).__name__} is not supported "
                            "(SequentialMLP, GroupedMLP, TEGroupedMLP are)")
        if getattr(mlp, "shared_experts", None) is not None:
            out += mlp_pair("shared_experts", f"{layer_name}.mlp.shared_experts",
                            mlp.shared_experts, False)
    elif isinstance(mlp, MLP):
        out += mlp_pair("dense_mlp", f"{layer_name}.mlp", mlp, False)
    return out


def _is_te_module(module):
    return type(module).__module__.startswith("megatron.core.extensions.transformer_engine")


class QuadsConverter:
    """torchtitan-style model converter: ``convert(model)`` once, ``post_optimizer_hook(model)`` per step."""

    def __init__(self, recipe: QuadsRecipe = None):
        recipe = QuadsRecipe() if recipe is None else recipe
        if isinstance(recipe, dict):
            recipe = QuadsRecipe.from_dict(recipe)
        if not isinstance(recipe, QuadsRecipe):
            raise TypeError(f"apply_quads: recipe must be a QuadsRecipe or dict, got "
                            f"{type(recipe).__name__}")
        if recipe.backend == "te":
            from quads_megatron.megatron.te_bridge import require_te_nvfp4

            require_te_nvfp4()
        self.recipe = recipe

    def convert(self, model):
        """Wrap the recipe's target modules of ``model`` (or of each model chunk) in place; returns it."""
        from megatron.core.transformer.transformer_layer import TransformerLayer

        if isinstance(model, (list, tuple)):
            return type(model)(self.convert(chunk) for chunk in model)

        recipe, gpt = self.recipe, unwrap_model(model)
        if getattr(gpt, "quads_targets", None):
            raise RuntimeError("apply_quads: this model is already converted")
        config, num_layers = gpt.config, gpt.config.num_layers
        names = [n for n, _ in gpt.named_modules()]
        for pattern in recipe.bf16_patterns:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise ValueError(f"QuadsRecipe.bf16_patterns: {pattern!r} matches no module of "
                                 f"this model (names look like 'decoder.layers.0.mlp.experts."
                                 f"local_experts.0.linear_fc1')")
        found, targets = set(), {}
        for layer_name, layer in gpt.named_modules():
            if not isinstance(layer, TransformerLayer):
                continue
            carved = (layer.layer_number <= recipe.bf16_first_layers
                      or layer.layer_number > num_layers - recipe.bf16_last_layers)
            for scope, name, module, kind, is_expert, k_sharded in _candidates(layer_name, layer):
                found.add(scope)
                if scope not in recipe.scope or carved:
                    continue
                if any(fnmatch.fnmatchcase(name, p) for p in recipe.bf16_patterns):
                    continue
                targets[name] = self._wrap(name, module, kind, is_expert, k_sharded, config)
        missing = [s for s in recipe.scope if s not in found]
        if missing:
            raise ValueError(f"QuadsRecipe.scope names {missing}, which this model does not have "
                             f"(it has {sorted(found)})")
        gpt.quads_targets = targets
        gpt.quads_recipe = recipe
        return model

    def _wrap(self, name, module, kind, is_expert, k_sharded, config):
        recipe = self.recipe
        if hasattr(module, "_quads"):
            raise RuntimeError(f"{name}: already wrapped by apply_quads")
        if getattr(module, "gradient_accumulation_fusion", False) or getattr(
                module, "fuse_wgrad_accumulation", False):
            raise ValueError(f"{name}: gradient_accumulation_fusion=True accumulates into the "
                             "weight's main_grad inside the GEMM, which the fake-quantized weight "
                             "does not own; set gradient_accumulation_fusion=False for AQAT")
        if recipe.quantize_activations and (kind == "grouped" or (
                _is_te_module(module) and "LayerNorm" in type(module).__name__)):
            raise ValueError(f"{name}: activation_mode='nvfp4' needs the GEMM input at the module "
                             f"boundary; {type(module).__name__} computes it inside its forward "
                             "(use SequentialMLP / the local spec, or activation_mode='bf16')")
        group = _group_of(module, is_expert)
        opts = dict(block_shape=recipe.block_shape, group=group, backend=recipe.backend,
                    cache=recipe.cache_weights)
        if kind == "linear":
            weights = {"weight": WeightFakeQuant(name, module.weight, **opts)}
        elif kind == "grouped":
            n = module.num_local_experts
            weights = {"weight1": WeightFakeQuant(f"{name}.weight1", module.weight1,
                                                  layout="grouped_fc1", num_experts=n, **opts),
                       "weight2": WeightFakeQuant(f"{name}.weight2", module.weight2,
                                                  layout="grouped_fc2", num_experts=n, **opts)}
        else:  # te_grouped: one weight{i} per local expert
            weights = {p: WeightFakeQuant(f"{name}.{p}", w, **opts)
                       for p, w in module.named_parameters(recurse=False) if p.startswith("weight")}
        target = QuadsTarget(name, module, weights, group, recipe.quantize_activations,
                             recipe.activation_scaling, k_sharded)
        module._quads = target
        module.forward = types.MethodType(_quads_forward, module)
        return target

    def post_optimizer_hook(self, model):
        """Drop every cached fake-quantized weight (call after optimizer.step())."""
        post_optimizer_hook(model)


def apply_quads(model, recipe: QuadsRecipe = None):
    """Make ``model``'s recipe targets (routed experts by default) train with NVFP4 fake-quantized weights."""
    return QuadsConverter(recipe).convert(model)


def post_optimizer_hook(model):
    """Invalidate the per-step fake-quant caches of one model or a list of model chunks."""
    for chunk in (model if isinstance(model, (list, tuple)) else [model]):
        for target in quads_targets(chunk).values():
            target.invalidate()


def _torch_optimizers(optimizer):
    """The torch.optim optimizers inside a Megatron (chained / mixed-precision) or torch optimizer."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    if hasattr(optimizer, "chained_optimizers"):
        return [o for sub in optimizer.chained_optimizers for o in _torch_optimizers(sub)]
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None:
        return _torch_optimizers(inner)
    raise TypeError(f"register_post_optimizer_hook: cannot find a torch optimizer in "
                    f"{type(optimizer).__name__}")


def register_post_optimizer_hook(optimizer, model):
    """Run ``post_optimizer_hook(model)`` after every ``optimizer.step()`` (torch or Megatron optimizer).

    Megatron copies the updated main params into the model after its inner torch step; the
    caches are only marked stale here and refilled at the next forward, so the order is safe.
    """
    return [o.register_step_post_hook(lambda *args, **kwargs: post_optimizer_hook(model))
            for o in _torch_optimizers(optimizer)]


def quads_targets(model) -> dict:
    """{module name: QuadsTarget} of a converted model chunk (empty if not converted)."""
    return getattr(unwrap_model(model), "quads_targets", None) or {}


def quads_recipe(model):
    """The QuadsRecipe a model was converted with, or None."""
    return getattr(unwrap_model(model), "quads_recipe", None)


@torch.no_grad()
def fake_quantized_state(model) -> dict:
    """{'<module>.<param>': fake-quantized weight} for every quantized weight (what forward uses)."""
    return {f"{name}.{p}": w for name, t in quads_targets(model).items()
            for p, w in t.fake_quantized().items()}
