"""``quantize_named_params(named_tensors, plan)``: (HF name, tensor) pairs -> the rollout's tensors.

The one step that turns high-precision weights into what a rollout engine loads, used by the
checkpoint export, the SGLang weight sync and the local engine (as slime's
``quantize_params``): weights the plan marks NVFP4 become ModelOpt triples (``weight`` uint8,
``weight_scale`` e4m3, ``weight_scale_2`` fp32), every other tensor passes through as it is.
Weights of one scale group (gate+up of an expert, q+k+v of a layer) are buffered until all
of them arrived and quantized with one shared global scale, as the trainer's fake
quantization of the fused Megatron weight does, so ``dequantize`` of the output equals the
trainer's forward weight bit for bit.
"""

from __future__ import annotations

from typing import Iterable, Iterator, List, Tuple

import torch

from quads_megatron import nvfp4
from quads_megatron.plan.quant_plan import QuantPlan

Named = Tuple[str, torch.Tensor]


def _quantize_group(names: List[str], tensors: List[torch.Tensor], block_shape) -> list:
    try:
        if len(tensors) == 1:
            return [nvfp4.quantize(tensors[0], block_shape=block_shape)]
        return nvfp4.quantize_with_shared_scale(tensors, block_shape=block_shape)
    except ValueError as e:
        raise ValueError(f"{', '.join(names)}: cannot quantize to NVFP4: {e}") from None


def quantize_scale_groups(named_tensors: Iterable[Named], plan: QuantPlan
                          ) -> Iterator[Tuple[List[str], List[torch.Tensor], list]]:
    """Yield ``(names, tensors, NVFP4Tensors or None)`` in arrival order of each group's last member.

    ``None`` marks tensors the rollout keeps in high precision (one name per such entry).
    Raises ValueError naming the missing weights when the stream ends inside a scale group.
    """
    pending = {}
    for name, tensor in named_tensors:
        t = plan[name]
        if t is None or not t.quantized:
            yield [name], [tensor], None
            continue
        group = pending.setdefault(t.scale_group, {})
        if name in group:
            raise ValueError(f"{name}: received twice inside one scale group {list(t.scale_group)}")
        group[name] = tensor
        if len(group) == len(t.scale_group):
            del pending[t.scale_group]
            names = list(t.scale_group)
            tensors = [group[n] for n in names]
            yield names, tensors, _quantize_group(names, tensors, t.block_shape)
    if pending:
        missing = sorted(n for g, got in pending.items() for n in g if n not in got)
        raise ValueError(f"quantize_named_params: the stream ended without {missing[:6]} "
                         f"({len(missing)} weights), whose scale-group partners arrived")


def modelopt_names(weight_name: str) -> List[str]:
    """ModelOpt tensor names of the NVFP4 triple that replaces HF weight ``weight_name``."""
    base = weight_name[: -len(".weight")]
    return [f"{base}.weight", f"{base}.weight_scale", f"{base}.weight_scale_2"]


def quantize_named_params(named_tensors: Iterable[Named], plan: QuantPlan) -> Iterator[Named]:
    """Yield the rollout's ``(name, tensor)``: NVFP4 triples where the plan says so, the rest as given."""
    for names, tensors, quantized in quantize_scale_groups(named_tensors, plan):
        if quantized is None:
            yield names[0], tensors[0]
            continue
        for name, q in zip(names, quantized):
            triple = q.to_modelopt()
            for out_name, key in zip(modelopt_names(name), ("weight", "weight_scale", "weight_scale_2")):
                yield out_name, triple[key]
