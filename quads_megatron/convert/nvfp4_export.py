"""Which HF tensors become NVFP4 (``QuantScope``) and how one expert linear is packed under ModelOpt names."""

import dataclasses

import torch

from quads_megatron import nvfp4
from quads_megatron.convert import qwen3_moe
from quads_megatron.convert.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class QuantScope:
    """Routed-expert projections of every layer except ``bf16_layers`` are NVFP4; the rest stays BF16.

    ``block_shape`` is the recipe's weight block ((1, 16) or (16, 16); both store ModelOpt's
    per-row scale layout).
    """

    block_shape: tuple = (1, nvfp4.BLOCK_SIZE)
    bf16_layers: frozenset = frozenset()

    def quantizes(self, rule: qwen3_moe.Rule, layer) -> bool:
        return rule.expert and layer not in self.bf16_layers

    def quantized_layers(self, dims: qwen3_moe.Dims) -> list:
        return [layer for layer in range(dims.num_layers) if layer not in self.bf16_layers]

    def exclude_modules(self, dims: qwen3_moe.Dims) -> list:
        """HF module patterns left unquantized, as ModelOpt's ``exclude_modules`` lists them."""
        excluded = ["lm_head", "model.embed_tokens", "model.layers.*.self_attn*", "model.layers.*.mlp.gate"]
        excluded += [f"model.layers.{layer}.mlp.experts*" for layer in sorted(self.bf16_layers)]
        return excluded


def scope_from_recipe(recipe, dims: qwen3_moe.Dims) -> QuantScope:
    """The export scope of a ``QuadsRecipe`` for this model.

    Qwen3-MoE has only routed experts to quantize ("shared_experts"/"dense_mlp" match nothing);
    "attention" is not exported in NVFP4 yet.  BF16 carve-outs: the first/last N layers, and
    ``bf16_patterns`` (fnmatch on Megatron module names with global layer and expert indices,
    e.g. ``decoder.layers.3.mlp.*``) -- a fused MoE layer is NVFP4 or BF16 as a whole, so a
    pattern must cover all experts of a layer or none.
    """
    import fnmatch

    if "attention" in recipe.scope:
        raise CheckpointError("QuadsRecipe.scope 'attention': the rollout exporter quantizes routed experts "
                              "only; drop 'attention' from the scope")
    if "routed_experts" not in recipe.scope:
        return QuantScope(tuple(recipe.block_shape), frozenset(range(dims.num_layers)))
    bf16 = set(range(recipe.bf16_first_layers))
    bf16 |= set(range(max(0, dims.num_layers - recipe.bf16_last_layers), dims.num_layers))
    for layer in range(dims.num_layers):
        modules = [f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{fc}"
                   for e in range(dims.num_experts) for fc in ("linear_fc1", "linear_fc2")]
        hits = [m for m in modules if any(fnmatch.fnmatchcase(m, p) for p in recipe.bf16_patterns)]
        if hits and len(hits) != len(modules):
            raise CheckpointError(f"QuadsRecipe.bf16_patterns keep {hits[0]} BF16 but not all experts of layer "
                                  f"{layer}; a fused MoE layer must be all NVFP4 or all BF16")
        if hits:
            bf16.add(layer)
    return QuantScope(tuple(recipe.block_shape), frozenset(bf16))


def _base(name: str) -> str:
    if not name.endswith(".weight"):
        raise ValueError(f"{name}: expected a '.weight' tensor name")
    return name[: -len(".weight")]


def quantize_linears(tensors, block_shape=(1, nvfp4.BLOCK_SIZE)) -> list:
    """NVFP4Tensors of one expert's gate+up (two tensors, one shared global scale) or down (one)."""
    if len(tensors) == 2:
        return nvfp4.quantize_with_shared_scale(list(tensors), block_shape=tuple(block_shape))
    if len(tensors) == 1:
        return [nvfp4.quantize(tensors[0], block_shape=tuple(block_shape))]
    raise ValueError(f"quantize_linears: expected 1 or 2 tensors, got {len(tensors)}")


def modelopt_tensors(name: str, q: nvfp4.NVFP4Tensor):
    """Yield ``(name, tensor)`` of ModelOpt's NVFP4 triple for the HF ``*.weight`` tensor ``name``."""
    base = _base(name)
    for suffix, t in q.to_modelopt().items():
        yield f"{base}.{suffix}", t


def quantize_expert_linear(names, tensors, block_shape=(1, nvfp4.BLOCK_SIZE)):
    """Yield ModelOpt NVFP4 ``(name, tensor)`` triples for one expert's gate+up (shared global scale)
    or down projection; ``names`` are the HF ``*.weight`` names of ``tensors``."""
    for name, q in zip(names, quantize_linears(tensors, block_shape)):
        yield from modelopt_tensors(name, q)


def expert_input_scale(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt ``input_scale`` (static per-tensor activation decode scale) from a calibrated amax."""
    return nvfp4.global_decode_scale(amax.to(torch.float32)).reshape(())
