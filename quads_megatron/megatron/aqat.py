"""Asymmetric NVFP4 QAT for a Megatron-Core GPTModel: ``apply_quads(model, recipe)`` + ``post_optimizer_hook(model)``.

A model converter in the shape of torchtitan's float8 one.  It finds the recipe's target
modules in a GPTModel built with Megatron's own layer specs and wraps their ``forward`` so
that, for the duration of the call, each weight attribute reads the NVFP4 fake-quantized
weight (straight-through gradient to the BF16/FP32 master Parameter).  The Parameters
themselves are untouched, so ``state_dict``/``sharded_state_dict`` names, optimizers and
dist_checkpointing see exactly the unquantized model.  Train precision ``w4a4`` also
fake-quantizes each target's input (the naive symmetric baseline).  Which modules, at which
block shape and precision, comes from the ``QuantPlan`` resolved from the recipe (the same plan
the export and weight sync read), so the trainer quantizes exactly what the rollout serves.

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

import types

import torch

from quads_megatron.megatron.fake_quant import ExpertsFakeQuant, WeightFakeQuant, fake_quantize_activation
from quads_megatron.plan import EXPERT_TENSOR_PARALLEL, QuantPlan
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


def _group_of(module, reduce_group):
    """The process group that reduces this module's global amax (the plan names its kind)."""
    group = getattr(module, "tp_group", None)
    if group is not None:
        return group
    from megatron.core import parallel_state

    if reduce_group == EXPERT_TENSOR_PARALLEL:
        return parallel_state.get_expert_tensor_parallel_group()
    return parallel_state.get_tensor_model_parallel_group()


def _candidates(layer, layer_name):
    """(name, module, kind, global Megatron weight names, k_sharded) of one layer's quantizable modules.

    The global names (global layer and expert indices) are how the plan is asked about them.
    """
    from megatron.core.transformer.moe import experts as moe_experts
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    SequentialMLP = moe_experts.SequentialMLP
    GroupedMLP = getattr(moe_experts, "GroupedMLP", ())  # legacy; gone in megatron-core 0.19
    L = f"decoder.layers.{layer.layer_number - 1}"
    out = []
    attn = getattr(layer, "self_attention", None)
    for sub, k_sharded in (("linear_qkv", False), ("linear_proj", True)):
        if attn is not None and hasattr(attn, sub):
            out.append((f"{layer_name}.self_attention.{sub}", getattr(attn, sub), "linear",
                        [f"{L}.self_attention.{sub}.weight"], k_sharded))
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, BaseMoELayer):
        return out
    experts, prefix = mlp.experts, f"{layer_name}.mlp.experts"
    ids = list(mlp.local_expert_indices)

    def names(fc):
        return [f"{L}.mlp.experts.local_experts.{e}.{fc}.weight" for e in ids]

    if isinstance(experts, SequentialMLP):
        siblings = {fc: [getattr(e, fc) for e in experts.local_experts] for fc in ("linear_fc1", "linear_fc2")}
        for i, expert in enumerate(experts.local_experts):
            for fc, k_sharded in (("linear_fc1", False), ("linear_fc2", True)):
                out.append((f"{prefix}.local_experts.{i}.{fc}", getattr(expert, fc),
                            ("expert", f"{prefix}.local_experts.*.{fc}", i, siblings[fc]), [names(fc)[i]], k_sharded))
    elif isinstance(experts, GroupedMLP):
        out.append((prefix, experts, "grouped", names("linear_fc1") + names("linear_fc2"), False))
    elif hasattr(experts, "linear_fc1") and hasattr(experts.linear_fc1, "weight0"):
        for fc, k_sharded in (("linear_fc1", False), ("linear_fc2", True)):
            out.append((f"{prefix}.{fc}", getattr(experts, fc), "te_grouped", names(fc), k_sharded))
    else:
        raise TypeError(f"{prefix}: expert class {type(experts).__name__} is not supported "
                        "(SequentialMLP, GroupedMLP, TEGroupedMLP are)")
    return out


def _is_te_module(module):
    return type(module).__module__.startswith("megatron.core.extensions.transformer_engine")


def plan_for_model(model, recipe: QuadsRecipe = None) -> QuantPlan:
    """The QuantPlan of ``recipe`` for this GPTModel and the initialized parallel layout."""
    from megatron.core import parallel_state as ps

    from quads_megatron.models import qwen3_moe

    gpt = unwrap_model(model)
    dims = qwen3_moe.dims_from_megatron_config(gpt.config, gpt.vocab_size,
                                               gpt.share_embeddings_and_output_weights)
    parallel = ps.model_parallel_is_initialized()
    tp = ps.get_tensor_model_parallel_world_size() if parallel else 1
    etp = ps.get_expert_tensor_parallel_world_size() if parallel else 1
    return QuantPlan.resolve(recipe, dims, tp=tp, etp=etp)


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
        """Wrap the plan's trainer-quantized modules of ``model`` (or of each chunk) in place; returns it."""
        from megatron.core.transformer.transformer_layer import TransformerLayer

        if isinstance(model, (list, tuple)):
            return type(model)(self.convert(chunk) for chunk in model)

        gpt = unwrap_model(model)
        if getattr(gpt, "quads_targets", None):
            raise RuntimeError("apply_quads: this model is already converted")
        plan = plan_for_model(gpt, self.recipe)
        targets = {}
        self._shared = {}  # one ExpertsFakeQuant per (layer, fc) of a SequentialMLP
        for layer_name, layer in gpt.named_modules():
            if not isinstance(layer, TransformerLayer):
                continue
            for name, module, kind, megatron_names, k_sharded in _candidates(layer, layer_name):
                plans = [t for n in megatron_names for t in plan.for_megatron(n)]
                if not plans:
                    raise ValueError(f"{name}: not a Qwen3-MoE weight the quantization plan knows "
                                     f"({megatron_names[0]})")
                precisions = {t.train for t in plans}
                if len(precisions) > 1:  # the plan keeps fused units uniform; this is a bug
                    raise RuntimeError(f"{name}: mixed trainer precisions {precisions}")
                (precision,) = precisions
                if precision.quantizes_weights:
                    targets[name] = self._wrap(name, module, kind, plans[0], k_sharded)
        gpt.quads_targets = targets
        gpt.quads_recipe = self.recipe
        gpt.quads_plan = plan
        return model

    def _wrap(self, name, module, kind, tensor_plan, k_sharded):
        recipe = self.recipe
        quantize_input = tensor_plan.train.quantizes_activations
        if hasattr(module, "_quads"):
            raise RuntimeError(f"{name}: already wrapped by apply_quads")
        if getattr(module, "gradient_accumulation_fusion", False) or getattr(
                module, "fuse_wgrad_accumulation", False):
            raise ValueError(f"{name}: gradient_accumulation_fusion=True accumulates into the "
                             "weight's main_grad inside the GEMM, which the fake-quantized weight "
                             "does not own; set gradient_accumulation_fusion=False for AQAT")
        if quantize_input and (kind == "grouped" or (
                _is_te_module(module) and "LayerNorm" in type(module).__name__)):
            raise ValueError(f"{name}: train_precision 'w4a4' needs the GEMM input at the module "
                             f"boundary; {type(module).__name__} computes it inside its forward "
                             "(use SequentialMLP / the local spec, or train_precision 'w4a16')")
        group = _group_of(module, tensor_plan.reduce_group)
        opts = dict(block_shape=tensor_plan.block_shape, group=group, backend=recipe.backend,
                    cache=recipe.cache_weights)
        # nvfp4's grouped kernel serves 1x16 blocks with a per-step cache (TE quantizes per weight)
        one_launch = tuple(tensor_plan.block_shape) == (1, 16) and recipe.cache_weights and recipe.backend != "te"
        if isinstance(kind, tuple) and one_launch:
            _, key, index, siblings = kind  # all local experts of this fc: one launch per refresh
            if key not in self._shared:
                self._shared[key] = ExpertsFakeQuant(key, [m.weight for m in siblings], group=group)
            weights = {"weight": self._shared[key].expert(index)}
        elif kind == "linear" or isinstance(kind, tuple):
            weights = {"weight": WeightFakeQuant(name, module.weight, **opts)}
        elif kind == "grouped":
            n = module.num_local_experts
            weights = {"weight1": WeightFakeQuant(f"{name}.weight1", module.weight1,
                                                  layout="grouped_fc1", num_experts=n, **opts),
                       "weight2": WeightFakeQuant(f"{name}.weight2", module.weight2,
                                                  layout="grouped_fc2", num_experts=n, **opts)}
        else:  # te_grouped: one weight{i} per local expert
            params = [(p, w) for p, w in module.named_parameters(recurse=False) if p.startswith("weight")]
            if one_launch:
                shared = ExpertsFakeQuant(name, [w for _, w in params], group=group)
                weights = {p: shared.expert(i) for i, (p, _) in enumerate(params)}
            else:
                weights = {p: WeightFakeQuant(f"{name}.{p}", w, **opts) for p, w in params}
        target = QuadsTarget(name, module, weights, group, quantize_input,
                             tensor_plan.activation_scaling.value, k_sharded)
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


def quads_plan(model):
    """The QuantPlan a model was converted with, or None."""
    return getattr(unwrap_model(model), "quads_plan", None)


@torch.no_grad()
def fake_quantized_state(model) -> dict:
    """{'<module>.<param>': fake-quantized weight} for every quantized weight (what forward uses)."""
    return {f"{name}.{p}": w for name, t in quads_targets(model).items()
            for p, w in t.fake_quantized().items()}
