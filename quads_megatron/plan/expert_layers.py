"""A layer's routed experts as ONE item of a weight stream, and its NVFP4 form built in two launches.

The per-expert HF stream (gate, up, down of every expert: 3E tensors per layer) costs Python per
tensor on the way to the rollout; a refit only needs the layer's stacked matrices. ``ExpertsLayer``
carries them as the trainer holds them (Megatron's fused ``[gate; up]`` fc1 ``[2F, H]`` and fc2
``[H, F]`` of each expert, separate tensors or an ``[E, N, K]`` stack, no copy), and
``quantize_experts_layer`` quantizes each projection of all experts in one grouped launch
(``nvfp4.quantize_grouped``; fc1 with one global scale per expert = gate+up's shared scale group),
optionally straight into a rollout engine's buffers. The HF / ModelOpt per-expert names (the SGLang
wire format, checkpoints) are views of the stacked results, bit-identical to the per-expert path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch

from quads_megatron import nvfp4
from quads_megatron.plan.layout import EXPERT_FC1, EXPERT_FC2, modelopt_names

Mats = Union[torch.Tensor, Sequence[torch.Tensor]]
Named = Tuple[str, torch.Tensor]


def experts_prefix(layer: int) -> str:
    """The HF module name of layer ``layer``'s routed experts."""
    return f"model.layers.{layer}.mlp.experts"


@dataclass
class ExpertsLayer:
    """The routed experts of one layer, in expert order: fc1 ``[gate; up]`` ``[2F, H]`` and fc2 ``[H, F]`` each.

    fc1 / fc2: an ``[E, N, K]`` tensor or a list of E ``[N, K]`` tensors; experts: their global indices
    (default ``0..E-1``); amax: optional ``((amax, nonfinite), (amax, nonfinite))`` of fc1 and fc2 (fp32 /
    int32 ``[E]`` each) already known to the producer (the trainer's AQAT cache of this optimizer step), so
    the build skips its amax pass (None: computed here, one more read of the weights); fake_quant: optional
    (fc1 sink, fc2 sink), callables taking the fake-quantized ``[E, N, K]`` values of the same weights and
    amax: the build then writes them too, from the same read (``nvfp4.refit_grouped``), and hands them over
    (the trainer's AQAT cache for the next step, whose refresh is then already done)."""

    layer: int
    fc1: Mats
    fc2: Mats
    experts: Optional[List[int]] = None
    amax: Optional[tuple] = field(default=None, repr=False)
    fake_quant: Optional[tuple] = field(default=None, repr=False)

    def __post_init__(self):
        if self.experts is None:
            self.experts = list(range(len(self.fc1)))
        if not (len(self.fc1) == len(self.fc2) == len(self.experts)):
            raise ValueError(f"{self.prefix}: {len(self.fc1)} fc1, {len(self.fc2)} fc2 matrices and "
                             f"{len(self.experts)} expert indices; expected one of each per expert")

    @property
    def prefix(self) -> str:
        return experts_prefix(self.layer)

    @property
    def ffn(self) -> int:
        return self.fc2[0].shape[-1]

    def names(self, projs: Sequence[str]) -> List[str]:
        """HF weight names of ``projs`` for every expert, expert-major (gate_0, up_0, gate_1, ...)."""
        return [f"{self.prefix}.{e}.{p}.weight" for e in self.experts for p in projs]

    @property
    def stackable(self) -> bool:
        """True when fc1 and fc2 are ``[E, N, K]`` tensors of experts ``0..E-1`` (whole-layer views, no copy)."""
        return (isinstance(self.fc1, torch.Tensor) and isinstance(self.fc2, torch.Tensor)
                and self.experts == list(range(len(self.experts))))

    def stacked_items(self) -> Iterator[Named]:
        """The layer as SGLang FusedMoE parameters (``{prefix}.w13_weight`` [E, 2F, H], ``.w2_weight`` [E, H, F]):
        the trainer's own tensors; requires ``stackable``."""
        if not self.stackable:
            raise ValueError(f"{self.prefix}: stacked items need [E, N, K] fc1/fc2 tensors of experts 0..E-1")
        yield f"{self.prefix}.w13_weight", self.fc1
        yield f"{self.prefix}.w2_weight", self.fc2

    def hf_items(self) -> Iterator[Named]:
        """The per-expert HF stream of this layer (views, no copy): gate, up, down of each expert."""
        F = self.ffn
        for e, w1, w2 in zip(self.experts, self.fc1, self.fc2):
            pre = f"{self.prefix}.{e}"
            yield f"{pre}.gate_proj.weight", w1[:F]
            yield f"{pre}.up_proj.weight", w1[F:]
            yield f"{pre}.down_proj.weight", w2


@dataclass
class QuantizedExperts:
    """NVFP4 of an ``ExpertsLayer``: fc1 ``[E, 2F, H]`` and fc2 ``[E, H, F]`` NVFP4Tensors (one global scale
    per expert and projection; fc1's is gate+up's shared one)."""

    source: ExpertsLayer
    fc1: nvfp4.NVFP4Tensor
    fc2: nvfp4.NVFP4Tensor

    @property
    def layer(self) -> int:
        return self.source.layer

    def rollout_items(self) -> Iterator[Named]:
        """The ModelOpt per-expert triples (the SGLang wire / checkpoint names): views of the stacked tensors,
        made by a few ``unbind`` calls (not one indexing op per tensor: a layer has 9E of them)."""
        E, F = len(self.source.experts), self.source.ffn
        halves = [t.reshape(2 * E, F, t.shape[-1]).unbind(0) for t in (self.fc1.data, self.fc1.scale)]
        s1, s2 = self.fc1.global_scale.reshape(-1).unbind(0), self.fc2.global_scale.reshape(-1).unbind(0)
        d2, sc2 = self.fc2.data.unbind(0), self.fc2.scale.unbind(0)
        for i, e in enumerate(self.source.experts):
            pre = f"{self.source.prefix}.{e}"
            for j, proj in enumerate(EXPERT_FC1):
                yield from zip(modelopt_names(f"{pre}.{proj}.weight"), (halves[0][2 * i + j], halves[1][2 * i + j], s1[i]))
            yield from zip(modelopt_names(f"{pre}.{EXPERT_FC2[0]}.weight"), (d2[i], sc2[i], s2[i]))

    @property
    def stackable(self) -> bool:
        """True when the layer holds experts ``0..E-1`` in order (the FusedMoE parameters' expert order)."""
        return self.source.experts == list(range(len(self.source.experts)))

    def stacked_items(self) -> Iterator[Named]:
        """The layer as SGLang FusedMoE parameters (``{prefix}.w13_weight`` [E, 2F, H/2], ``_weight_scale``,
        ``_weight_scale_2`` [E, 2] (gate and up share one), ``w2_*``): the grouped launches' own buffers (the
        [E, 2] scale pair is the only new tensor). Requires ``stackable``."""
        if not self.stackable:
            raise ValueError(f"{self.source.prefix}: stacked items need experts 0..E-1 in order, got "
                             f"{self.source.experts[:8]}")
        E, pre = len(self.source.experts), self.source.prefix
        yield f"{pre}.w13_weight", self.fc1.data
        yield f"{pre}.w13_weight_scale", self.fc1.scale
        yield f"{pre}.w13_weight_scale_2", self.fc1.global_scale.reshape(E, 1).expand(E, 2)
        yield f"{pre}.w2_weight", self.fc2.data
        yield f"{pre}.w2_weight_scale", self.fc2.scale
        yield f"{pre}.w2_weight_scale_2", self.fc2.global_scale.reshape(E)

    def scale_groups(self) -> Iterator[tuple]:
        """The per-expert ``quantize_scale_groups`` items ``(names, tensors, NVFP4Tensors)`` (views)."""
        F = self.source.ffn
        for i, (e, w1, w2) in enumerate(zip(self.source.experts, self.source.fc1, self.source.fc2)):
            pre = f"{self.source.prefix}.{e}"
            g = self.fc1.global_scale.reshape(-1)[i]
            halves = [_part(self.fc1.data[i, r], self.fc1.scale[i, r], g) for r in (slice(0, F), slice(F, 2 * F))]
            yield [f"{pre}.{p}.weight" for p in EXPERT_FC1], [w1[:F], w1[F:]], halves
            yield ([f"{pre}.{EXPERT_FC2[0]}.weight"], [w2],
                   [_part(self.fc2.data[i], self.fc2.scale[i], self.fc2.global_scale.reshape(-1)[i])])


def _part(data, scale, g) -> nvfp4.NVFP4Tensor:
    return nvfp4.NVFP4Tensor._trusted(data, scale, g, torch.Size((data.shape[0], data.shape[1] * 2)),
                                      (1, nvfp4.BLOCK_SIZE))


def _contiguous(mats: Mats) -> Mats:
    if isinstance(mats, torch.Tensor):
        return mats.contiguous()
    return [t if t.is_contiguous() else t.contiguous() for t in mats]


def quantize_experts_layer(item: ExpertsLayer, destination=None) -> QuantizedExperts:
    """Quantize a layer's experts: one grouped launch per projection (plus its amax launch unless
    ``item.amax`` gives it), written into ``destination``'s buffers when it gives them; with
    ``item.fake_quant`` the same launch also writes the fake-quantized values and hands them over.

    destination: ``named_params.Destination`` (``(layer, role, experts) -> (data, scale, S_dec)``, the
    per-expert groups' shapes: fc1 as [2E, F, H/2]); the buffers are viewed [E, 2F, H/2] here (the
    same bytes: gate rows then up rows of each expert, one S_dec per expert)."""
    E = len(item.experts)
    results = []
    for which, role, mats in (("fc1", EXPERT_FC1, item.fc1), ("fc2", EXPERT_FC2, item.fc2)):
        mats = _contiguous(mats)
        first = mats[0]
        n, k = first.shape
        out = destination(item.layer, role, list(item.experts)) if destination is not None else None
        if out is not None:
            data, scale, s_dec = out
            if data.device != first.device:
                out = None  # the engine's buffers live elsewhere: quantize here, the caller copies
            else:
                out = (data.view(E, n, k // 2), scale.view(E, n, k // nvfp4.BLOCK_SIZE), s_dec.view(E))
        i = 0 if which == "fc1" else 1
        amax, bad = (None, None) if item.amax is None else item.amax[i]
        name = f"{item.prefix} {which}"
        if item.fake_quant is None:
            results.append(nvfp4.quantize_grouped(mats, scale_group=1, amax=amax, nonfinite=bad, out=out, name=name))
            continue
        fake, q = nvfp4.refit_grouped(mats, scale_group=1, amax=amax, nonfinite=bad, out=out, name=name)
        item.fake_quant[i](fake)
        results.append(q)
    return QuantizedExperts(item, *results)
