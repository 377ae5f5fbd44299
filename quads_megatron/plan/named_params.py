"""``quantize_named_params(named_tensors, plan)``: (HF name, tensor) pairs -> the rollout's tensors.

The one step that turns high-precision weights into what a rollout engine loads, used by the
checkpoint export, the SGLang weight sync and the local engine (as slime's
``quantize_params``): weights the plan marks NVFP4 become ModelOpt triples (``weight`` uint8,
``weight_scale`` e4m3, ``weight_scale_2`` fp32), every other tensor passes through as it is.
Weights of one scale group (gate+up of an expert, q+k+v of a layer) are buffered until all
of them arrived and quantized with one shared global scale, as the trainer's fake
quantization of the fused Megatron weight does, so ``dequantize`` of the output equals the
trainer's forward weight bit for bit. A layer's routed experts are quantized together, in one
grouped launch per projection (``nvfp4.quantize_grouped``), optionally straight into a rollout
engine's weight buffers.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, List, Optional, Tuple

import torch

from quads_megatron import nvfp4
from quads_megatron.errors import NonFiniteError
from quads_megatron.plan.expert_layers import ExpertsLayer, QuantizedExperts, quantize_experts_layer
from quads_megatron.plan.layout import NVFP4_WEIGHT_KEYS, modelopt_names
from quads_megatron.plan.quant_plan import QuantPlan

Named = Tuple[str, torch.Tensor]


def _quantize_group(names: List[str], tensors: List[torch.Tensor], block_shape) -> list:
    try:
        if len(tensors) == 1:
            return [nvfp4.quantize(tensors[0], block_shape=block_shape)]
        return nvfp4.quantize_with_shared_scale(tensors, block_shape=block_shape)
    except ValueError as e:
        raise ValueError(f"{', '.join(names)}: cannot quantize to NVFP4: {e}") from None


Destination = Callable[[int, Tuple[str, ...], List[int]], Optional[tuple]]
"""``destination(layer, role, experts)``: where a layer's grouped expert weights go, or None.

role is the projections of one scale group (``("gate_proj", "up_proj")`` or ``("down_proj",)``),
experts the expert indices in order; the answer is ``quantize_grouped``'s ``out`` (data, scale,
S_dec buffers of a rollout engine, written in place)."""


class _ExpertBatch:
    """The complete expert scale groups of one layer and role, waiting to be quantized in one launch."""

    def __init__(self, layer: int, role: Tuple[str, ...]):
        self.layer, self.role, self.groups = layer, role, []   # [(expert, names, tensors)]

    def quantize(self, destination: Optional[Destination]) -> list:
        self.groups.sort(key=lambda g: g[0])
        mats = [t for _, _, ts in self.groups for t in ts]   # shapes, dtypes, devices: checked by quantize_grouped
        first = mats[0]
        experts = [e for e, _, _ in self.groups]
        out = destination(self.layer, self.role, experts) if destination is not None else None
        if out is not None and out[0].device != first.device:
            out = None  # the engine's buffers live elsewhere: quantize here, the caller copies
        names = [n for _, ns, _ in self.groups for n in ns]
        mats = [t if t.is_contiguous() else t.contiguous() for t in mats]
        q = nvfp4.quantize_grouped(mats, scale_group=len(self.role), out=out,
                                   name=f"model.layers.{self.layer} experts {'+'.join(self.role)}")
        n = len(self.role)
        parts = q.unbind()
        result = [(ns, ts, parts[i * n:(i + 1) * n]) for i, (_, ns, ts) in enumerate(self.groups)]
        self.scales, self.names = q.global_scale.view(-1), names
        return result


def _layer_of(name: str) -> Optional[int]:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 3 and parts[:2] == ["model", "layers"] else None


class _LayerScales:
    """The global scales of one ``QuantizedExperts`` and the weight names they belong to (the finite check)."""

    def __init__(self, q: QuantizedExperts):
        self.scales = torch.cat([q.fc1.global_scale.reshape(-1), q.fc2.global_scale.reshape(-1)])
        self.names = q.source.names(["gate_proj"]) + q.source.names(["down_proj"])


def _layer_fast_path(item: ExpertsLayer, plan: QuantPlan) -> bool:
    """True when the plan quantizes the layer's experts to NVFP4 with 1x16 blocks (the grouped kernels' case)."""
    e = item.experts[0] if item.experts else 0
    plans = [plan[f"{item.prefix}.{e}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")]
    return all(t is not None and t.quantized and tuple(t.block_shape) == (1, 16) for t in plans)


def quantize_scale_groups(named_tensors: Iterable, plan: QuantPlan, *,
                          destination: Optional[Destination] = None, check_finite: bool = True) -> Iterator:
    """Yield ``(names, tensors, NVFP4Tensors or None)`` for every scale group of the stream.

    The stream may also carry ``ExpertsLayer`` items (a layer's experts in one piece, ``iter_hf_weights(
    ..., stacked_experts=True)``): each comes out as one ``QuantizedExperts`` (two grouped launches, into
    ``destination``'s buffers when it gives them) where the plan quantizes those experts to 1x16 NVFP4,
    else as its per-expert items.

    ``None`` marks tensors the rollout keeps in high precision (one name per such entry). Routed
    experts (1x16 blocks) are collected per layer and projection and quantized in one grouped launch
    when the stream leaves that layer (into ``destination``'s buffers when it gives them); everything
    else comes out in arrival order of each group's last member. check_finite: NaN/Inf in a weight is a
    NonFiniteError naming it; for the experts that is checked once, from their scales, at the end of
    the stream (one host sync, not one per tensor). Raises ValueError naming the missing weights when
    the stream ends inside a scale group.
    """
    pending, batches, done = {}, {}, []
    batch_layer = None

    def flush():
        for b in batches.values():
            yield from b.quantize(destination)
            done.append(b)
        batches.clear()

    for entry in named_tensors:
        if isinstance(entry, ExpertsLayer):
            yield from flush()
            if _layer_fast_path(entry, plan):
                q = quantize_experts_layer(entry, destination)
                done.append(_LayerScales(q))
                yield q
                continue
            # another precision / block shape: the per-expert path (a layer boundary on both sides)
            yield from quantize_scale_groups(entry.hf_items(), plan, destination=destination,
                                             check_finite=check_finite)
            continue
        name, tensor = entry
        if batches and _layer_of(name) != batch_layer:
            yield from flush()
        t = plan[name]
        if t is None or not t.quantized:
            yield [name], [tensor], None
            continue
        group = pending.setdefault(t.scale_group, {})
        if name in group:
            raise ValueError(f"{name}: received twice inside one scale group {list(t.scale_group)}")
        group[name] = tensor
        if len(group) < len(t.scale_group):
            continue
        del pending[t.scale_group]
        names = list(t.scale_group)
        tensors = [group[n] for n in names]
        if t.expert is not None and tuple(t.block_shape) == (1, 16):
            role = tuple(n.split(".")[-2] for n in names)
            batch = batches.get(role)
            if batch is None:
                batch = batches[role] = _ExpertBatch(t.layer, role)
            batch.groups.append((t.expert, names, tensors))
            batch_layer = t.layer
            continue
        yield names, tensors, _quantize_group(names, tensors, t.block_shape)
    yield from flush()
    if pending:
        missing = sorted(n for g, got in pending.items() for n in g if n not in got)
        raise ValueError(f"quantize_named_params: the stream ended without {missing[:6]} "
                         f"({len(missing)} weights), whose scale-group partners arrived")
    if check_finite and done:
        _check_scales(done)


def _check_scales(batches) -> None:
    """NonFiniteError naming the first weight whose grouped quantization found NaN/Inf (one sync)."""
    bad = torch.isnan(torch.cat([b.scales for b in batches])).cpu()  # one device-to-host copy
    if bool(bad.any()):
        names = [n for b in batches for n in b.names]
        first = names[int(torch.nonzero(bad)[0])]
        raise NonFiniteError(f"{first}: contains NaN or Inf ({int(bad.sum())} expert weights affected); "
                             f"NVFP4 can only encode finite values")


def quantize_named_params(named_tensors: Iterable, plan: QuantPlan, keep_layers: bool = False) -> Iterator:
    """Yield the rollout's ``(name, tensor)``: NVFP4 triples where the plan says so, the rest as given
    (``ExpertsLayer`` items of the stream come out under their per-expert names, or with keep_layers as
    one ``QuantizedExperts`` item each, for a consumer that sends whole layers: ``fused_moe_names``)."""
    for item in quantize_scale_groups(named_tensors, plan):
        if keep_layers and isinstance(item, QuantizedExperts):
            yield item
        else:
            yield from rollout_items(item)


def flat_named(stream: Iterable) -> Iterator[Named]:
    """A weight stream with its ``ExpertsLayer`` / ``QuantizedExperts`` items spelled out as per-expert HF /
    ModelOpt ``(name, tensor)`` views."""
    for entry in stream:
        if isinstance(entry, ExpertsLayer):
            yield from entry.hf_items()
        elif isinstance(entry, QuantizedExperts):
            yield from entry.rollout_items()
        else:
            yield entry


def rollout_items(item, quantized: bool = True) -> Iterator[Named]:
    """One ``quantize_scale_groups`` item as the rollout's ``(name, tensor)`` pairs (ModelOpt NVFP4 triples).

    quantized=False: the item's high-precision tensors under their HF names instead (a BF16 sync)."""
    if isinstance(item, QuantizedExperts):
        yield from (item.rollout_items() if quantized else item.source.hf_items())
        return
    names, tensors, quantized_tensors = item
    if quantized_tensors is None or not quantized:
        yield from zip(names, tensors)
        return
    quantized = quantized_tensors
    for name, q in zip(names, quantized):
        triple = q.to_modelopt()
        for out_name, key in zip(modelopt_names(name), NVFP4_WEIGHT_KEYS):
            yield out_name, triple[key]
