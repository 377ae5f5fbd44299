"""QuantPlan: the one answer to "is this weight NVFP4, and how?" for a model and its parallel layout.

``QuantPlan.resolve(recipe, dims, tp=..., etp=...)`` applies the recipe's scope and BF16
carve-outs to every linear weight of a Qwen3-MoE (by HF name) once, checks that the result
can be served and trained consistently, and answers per weight: NVFP4 in the trainer and/or
the rollout, block shape, which weights share one global scale, which parallel group reduces
that scale's amax, activation precision and scaling, and the RAC channel count.  The trainer
(AQAT), the exporter, the weight sync, the local engine and (through the checkpoint schema
written from it) the SGLang methods all read it; nobody re-derives a carve-out.
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

from quads_megatron.models import qwen3_moe
from quads_megatron.nvfp4 import BLOCK_SIZE
from quads_megatron.plan.rollout_schema import RolloutQuantConfig
from quads_megatron.recipe import QuadsRecipe
from quads_megatron.vocab import ActivationScaling, Precision, Scope

# The parallel group over which a sharded weight's amax is MAX-reduced (Megatron's names).
TENSOR_PARALLEL = "tensor_model_parallel"
EXPERT_TENSOR_PARALLEL = "expert_tensor_parallel"
# HF modules that never hold NVFP4 weights in a Qwen3-MoE (ModelOpt exclude patterns).
_ALWAYS_BF16 = ["lm_head", "model.embed_tokens", "model.layers.*.mlp.gate"]


@dataclass(frozen=True)
class TensorPlan:
    """How one linear weight (HF name ``...weight``) is treated by the trainer and the rollout."""

    name: str
    scope: Scope
    layer: int
    expert: Optional[int]
    train: Precision                  # bf16: the trainer uses the master weight as it is
    rollout: Precision                # bf16: the rollout engine gets the high-precision weight
    block_shape: Tuple[int, int]
    scale_group: Tuple[str, ...]      # HF names sharing one global scale (gate+up, q+k+v)
    reduce_group: str                 # TENSOR_PARALLEL or EXPERT_TENSOR_PARALLEL
    activation_scaling: ActivationScaling
    rac_channels: int                 # k for a w4a4_rac rollout GEMM, else 0
    shape: Tuple[int, int]            # [N, K] of the full (unsharded) weight

    @property
    def module(self) -> str:
        """The HF module name (ModelOpt tensor names hang off it)."""
        return self.name[: -len(".weight")]

    @property
    def quantized(self) -> bool:
        """True when the rollout checkpoint / weight sync carries this weight as NVFP4."""
        return self.rollout.quantizes_weights


def _linear_rules():
    """(rule, scope) of the Qwen3-MoE linears a recipe can quantize."""
    for rule in qwen3_moe.RULES:
        if rule.expert:
            yield rule, Scope.ROUTED_EXPERTS
        elif rule.layout == "qkv" or rule.megatron.endswith("linear_proj.weight"):
            yield rule, Scope.ATTENTION


class QuantPlan:
    """The recipe resolved against one model (``qwen3_moe.Dims``) and its TP / expert-TP sizes."""

    def __init__(self, recipe: QuadsRecipe, dims: qwen3_moe.Dims, tensors: Dict[str, TensorPlan],
                 tp: int, etp: int):
        self.recipe, self.dims, self.tp, self.etp = recipe, dims, tp, etp
        self._tensors = tensors

    # ------------------------------------------------------------------ construction
    @classmethod
    def resolve(cls, recipe: Optional[QuadsRecipe], dims: qwen3_moe.Dims, *, tp: int = 1,
                etp: int = 1) -> "QuantPlan":
        """Decide every weight; raise ValueError naming the weight for anything inconsistent."""
        recipe = QuadsRecipe() if recipe is None else recipe
        for flag, size in (("tensor-model-parallel-size", tp), ("expert-tensor-parallel-size", etp)):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"QuantPlan: --{flag} must be an int >= 1, got {size!r}")
        shapes = qwen3_moe.hf_shapes(dims)
        first = set(range(min(recipe.bf16_first_layers, dims.num_layers)))
        last = set(range(max(0, dims.num_layers - recipe.bf16_last_layers), dims.num_layers))
        carved_layers = first | last
        matched = {p: False for p in recipe.bf16_patterns}
        tensors = {}
        for rule, scope in _linear_rules():
            for layer in range(dims.num_layers):
                experts = range(dims.num_experts) if rule.expert else [None]
                for expert in experts:
                    names = qwen3_moe.hf_names(rule, layer, expert)
                    for name in names:
                        hits = [p for p in recipe.bf16_patterns
                                if fnmatch.fnmatchcase(name[: -len(".weight")], p)]
                        for p in hits:
                            matched[p] = True
                        on = scope in recipe.scope and layer not in carved_layers and not hits
                        tensors[name] = cls._tensor(recipe, rule, scope, layer, expert, name,
                                                    names, shapes[name], on)
        unused = [p for p, hit in matched.items() if not hit]
        if unused:
            raise ValueError(f"QuadsRecipe.bf16_patterns {unused} match no weight of this model "
                             f"(patterns are fnmatch on HF module names, e.g. "
                             f"'model.layers.0.mlp.experts.*' or 'model.layers.*.self_attn.o_proj')")
        plan = cls(recipe, dims, tensors, tp, etp)
        plan._check()
        return plan

    @staticmethod
    def _tensor(recipe, rule, scope, layer, expert, name, group, shape, on) -> TensorPlan:
        train = recipe.train_precision if on else Precision.BF16
        rollout = recipe.rollout_precision if on else Precision.BF16
        # gate+up (one Megatron linear_fc1) and q+k+v (one linear_qkv) share one global scale
        share = rule.layout in ("gate_up", "qkv")
        return TensorPlan(
            name=name, scope=scope, layer=layer, expert=expert, train=train, rollout=rollout,
            block_shape=tuple(recipe.block_shape),
            scale_group=tuple(group) if share else (name,),
            reduce_group=EXPERT_TENSOR_PARALLEL if rule.expert else TENSOR_PARALLEL,
            activation_scaling=recipe.activation_scaling,
            rac_channels=recipe.rac_channels if rollout.uses_rac else 0,
            shape=tuple(shape))

    def _check(self) -> None:
        """Refuse what the trainer, the kernels or SGLang's fused layers cannot run."""
        d = self.dims
        for t in self._tensors.values():
            for member in t.scale_group:
                other = self._tensors[member]
                if (other.train, other.rollout) != (t.train, t.rollout):
                    raise ValueError(f"QuantPlan: {t.name} and {member} share one global scale "
                                     f"(one Megatron weight), so a carve-out must cover both")
            if not (t.train.quantizes_weights or t.rollout.quantizes_weights):
                continue
            n, k = t.shape
            # the trainer quantizes its shards; the rollout side gets full (gathered) weights
            size = (self.etp if t.scope is Scope.ROUTED_EXPERTS else self.tp) if t.train.quantizes_weights else 1
            row_parallel = t.name.endswith(("down_proj.weight", "o_proj.weight"))
            k_rank, n_rank = (k // size, n) if row_parallel else (k, n // size)
            if k % size or k_rank % BLOCK_SIZE:
                raise ValueError(f"QuantPlan: {t.name} has K={k}, {k_rank} per rank over {size} "
                                 f"rank(s); NVFP4 needs K per rank to be a multiple of {BLOCK_SIZE} "
                                 f"so that no block straddles a shard boundary")
            if t.block_shape == (16, 16) and (n_rank % BLOCK_SIZE or (t.scope is Scope.ATTENTION
                                                                 and d.head_dim % BLOCK_SIZE)):
                raise ValueError(f"QuantPlan: {t.name}: 16x16 tiles need N per rank ({n_rank}) "
                                 f"and head_dim ({d.head_dim}) to be multiples of {BLOCK_SIZE}")
            if t.rac_channels > k:
                raise ValueError(f"QuantPlan: rac_channels={t.rac_channels} exceeds the "
                                 f"{k} input channels of {t.name}")
        for layer in range(d.num_layers):
            mods = {(t.train, t.rollout) for t in self.layer_tensors(layer, Scope.ROUTED_EXPERTS)}
            if len(mods) > 1:
                raise ValueError(f"QuantPlan: the carve-outs keep some experts of layer {layer} "
                                 f"BF16 but not all; a fused MoE layer is NVFP4 or BF16 as a whole")

    # ------------------------------------------------------------------ queries
    def __getitem__(self, name: str) -> Optional[TensorPlan]:
        """The plan of the HF weight ``name``; None for weights no scope covers (norms, router, ...)."""
        return self._tensors.get(name)

    def __iter__(self) -> Iterator[TensorPlan]:
        return iter(self._tensors.values())

    def layer_tensors(self, layer: int, scope: Scope) -> List[TensorPlan]:
        return [t for t in self._tensors.values() if t.layer == layer and t.scope is scope]

    def layer_precision(self, layer: int, scope: Scope, side: str = "rollout") -> Precision:
        """One precision for a whole fused unit: a layer's experts, or its attention q/k/v (o_proj may differ)."""
        (value,) = {getattr(t, side) for t in self.layer_tensors(layer, scope)
                    if not t.name.endswith("o_proj.weight")}
        return value

    def for_megatron(self, megatron_name: str) -> List[TensorPlan]:
        """The plans of the HF weights one Megatron parameter (global layer/expert indices) is made of."""
        hit = qwen3_moe.match_megatron(megatron_name)
        if hit is None:
            return []
        rule, layer, expert = hit
        return [p for p in (self._tensors.get(n) for n in qwen3_moe.hf_names(rule, layer, expert))
                if p is not None]

    @functools.cached_property
    def train_quantizes(self) -> bool:
        return any(t.train.quantizes_weights for t in self)

    @property
    def rollout_precision(self) -> Precision:
        return self.recipe.rollout_precision

    @functools.cached_property
    def rollout_quantizes(self) -> bool:
        return any(t.rollout.quantizes_weights for t in self)

    @property
    def activation_scaling(self) -> ActivationScaling:
        return self.recipe.activation_scaling

    @property
    def rac_channels(self) -> int:
        return self.recipe.rac_channels if self.rollout_precision.uses_rac else 0

    @property
    def block_shape(self) -> Tuple[int, int]:
        return tuple(self.recipe.block_shape)

    # ------------------------------------------------------------------ the rollout checkpoint
    def exclude_modules(self) -> List[str]:
        """HF module patterns whose weights stay BF16 in the rollout (ModelOpt ``exclude_modules``)."""
        out = list(_ALWAYS_BF16)
        for layer in range(self.dims.num_layers):
            experts = self.layer_tensors(layer, Scope.ROUTED_EXPERTS)
            if experts and not experts[0].rollout.quantizes_weights:
                out.append(f"model.layers.{layer}.mlp.experts*")
            attn = self.layer_tensors(layer, Scope.ATTENTION)
            if attn and not any(t.rollout.quantizes_weights for t in attn):
                out.append(f"model.layers.{layer}.self_attn*")
            else:
                out += [t.module for t in attn if not t.rollout.quantizes_weights]
        return out

    def rollout_config(self, **overrides) -> RolloutQuantConfig:
        """The checkpoint's ``quantization_config`` content (the SGLang methods read this back)."""
        if not self.rollout_quantizes:
            raise ValueError("QuantPlan: the rollout precision is bf16 (or every weight is carved "
                             "out); there is no NVFP4 rollout checkpoint to describe")
        fields = dict(precision=self.rollout_precision, activation_scaling=self.activation_scaling,
                      rac_channels=self.rac_channels, exclude_modules=self.exclude_modules())
        fields.update(overrides)
        return RolloutQuantConfig(**fields)

    def describe(self) -> str:
        """A short human summary (logs, --dry-run)."""
        q = [t for t in self if t.rollout.quantizes_weights]
        tr = [t for t in self if t.train.quantizes_weights]
        return (f"QuantPlan: {len(tr)} trainer / {len(q)} rollout NVFP4 weights of {len(self._tensors)} "
                f"linears; train {self.recipe.train_precision.value}, rollout "
                f"{self.rollout_precision.value} ({self.activation_scaling.value}, k={self.rac_channels}), "
                f"block {self.block_shape}, TP={self.tp}, ETP={self.etp}")
