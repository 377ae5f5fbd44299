"""The rollout tensor layout: what every NVFP4 rollout unit holds, and which tensors share what.

One declaration read by every writer and reader of rollout tensors: the exporter, the local
engine's modules (``quads_megatron.rollout``), the calibration (``plan.calibration``), the SGLang
methods and their load checks.

* An NVFP4 weight of shape [N, K] is the ModelOpt triple ``weight`` uint8 [N, K/2] (two E2M1
  codes per byte), ``weight_scale`` float8_e4m3fn [N, K/BLOCK_SIZE] and ``weight_scale_2``
  float32 [] (``nvfp4_weight_specs``); a linear whose activations are quantized adds
  ``input_scale`` float32 [] and, with RAC, ``input_comp_index`` int32 [k] (``activation_specs``).
* ``weight_scale_2`` is shared by a plan scale group (gate+up of one expert, q+k+v of a layer).
* ``input_scale`` and the RAC channel set are shared by an ``ActivationGroup``: the weights that
  read one activation.  fc1 (gate+up of every expert of a layer) reads the layer's hidden states:
  one input scale, one channel set.  fc2 (down of every expert) has one input scale (the fused
  kernel takes one static scale per layer) and one channel set per expert (their inputs differ).
  q/k/v read one input: one scale, one set; o_proj has its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Tuple

import torch

from quads_megatron.nvfp4 import BLOCK_SIZE
from quads_megatron.vocab import ActivationScaling, Precision

if TYPE_CHECKING:
    from quads_megatron.plan.quant_plan import QuantPlan

WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2 = "weight", "weight_scale", "weight_scale_2"
INPUT_SCALE, COMP_INDEX = "input_scale", "input_comp_index"
NVFP4_WEIGHT_KEYS = (WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2)
COMP_INDEX_DTYPE = torch.int32
SCALE_DTYPE = torch.float32

# The HF projections of one rollout unit that share a weight_scale_2 / an input.
EXPERT_FC1 = ("gate_proj", "up_proj")
EXPERT_FC2 = ("down_proj",)
ATTN_QKV = ("q_proj", "k_proj", "v_proj")
ATTN_O = ("o_proj",)

Spec = Tuple[Tuple[int, ...], torch.dtype]


def packed_cols(k: int) -> int:
    """Columns of the packed ``weight`` of a K-input matrix (two E2M1 codes per byte)."""
    return k // 2


def block_scale_cols(k: int) -> int:
    """Columns of ``weight_scale`` of a K-input matrix (one E4M3 scale per BLOCK_SIZE inputs)."""
    return k // BLOCK_SIZE


def nvfp4_weight_specs(n: int, k: int, lead: Tuple[int, ...] = ()) -> Dict[str, Spec]:
    """``{ModelOpt suffix: (shape, dtype)}`` of an NVFP4 [*lead, N, K] weight (one scale_2 per leading index)."""
    lead = tuple(lead)
    return {WEIGHT: ((*lead, n, packed_cols(k)), torch.uint8),
            WEIGHT_SCALE: ((*lead, n, block_scale_cols(k)), torch.float8_e4m3fn),
            WEIGHT_SCALE_2: (lead, SCALE_DTYPE)}


def activation_specs(precision: Precision, rac_channels: int) -> Dict[str, Spec]:
    """``{suffix: (shape, dtype)}`` of the activation-side tensors of one quantized linear."""
    out = {}
    if precision.quantizes_activations:
        out[INPUT_SCALE] = ((), SCALE_DTYPE)
    if precision.uses_rac:
        out[COMP_INDEX] = ((rac_channels,), COMP_INDEX_DTYPE)
    return out


def experts_group_names(prefix: str) -> Tuple[str, str]:
    """The activation groups of the experts unit ``prefix`` (``model.layers.{i}.mlp.experts``): (fc1, fc2)."""
    return f"{prefix}.gate_up_proj", f"{prefix}.down_proj"


def modelopt_names(weight_name: str) -> List[str]:
    """ModelOpt tensor names of the NVFP4 triple that replaces HF weight ``weight_name``."""
    base = weight_name[: -len(".weight")]
    return [f"{base}.{key}" for key in NVFP4_WEIGHT_KEYS]


@dataclass(frozen=True)
class ActivationGroup:
    """Rollout weights that read one activation: one ``input_scale``, one RAC set (or one per member)."""

    name: str                   # the fused unit: model.layers.{i}.mlp.experts.gate_up_proj, ...self_attn.qkv_proj
    layer: int
    members: Tuple[str, ...]    # HF weight names, experts in order
    in_features: int
    precision: Precision
    static: bool                # the rollout uses the calibrated input_scale
    rac_channels: int           # k, 0 without RAC
    per_member_rac: bool        # fc2: one channel set per expert, else one shared set
    experts: bool               # a routed-experts unit (members are per expert)

    @property
    def uses_rac(self) -> bool:
        return self.rac_channels > 0

    def member_index(self, weight_name: str) -> int:
        return self.members.index(weight_name)


class RolloutLayout:
    """The rollout tensors of a ``QuantPlan``: checkpoint tensor specs and the activation groups."""

    def __init__(self, plan: "QuantPlan"):
        self.plan = plan
        self.groups: List[ActivationGroup] = list(self._groups())
        self._by_member = {m: g for g in self.groups for m in g.members}
        self._by_name = {g.name: g for g in self.groups}

    def _group(self, name, layer, members, experts, per_member_rac) -> Optional[ActivationGroup]:
        plans = [self.plan[m] for m in members]
        if not plans[0].rollout.quantizes_activations:
            return None
        prec = {t.rollout for t in plans}
        if len(prec) > 1:
            raise ValueError(f"RolloutLayout: {name} reads one input but its weights have rollout precisions "
                             f"{sorted(p.value for p in prec)}; a carve-out must cover all of {list(members)}")
        p = plans[0].rollout
        static = self.plan.activation_scaling is ActivationScaling.STATIC
        return ActivationGroup(name=name, layer=layer, members=tuple(members), in_features=plans[0].shape[1],
                               precision=p, static=static, rac_channels=plans[0].rac_channels,
                               per_member_rac=per_member_rac, experts=experts)

    def _groups(self) -> Iterator[ActivationGroup]:
        d = self.plan.dims
        for i in range(d.num_layers):
            at = f"model.layers.{i}.self_attn"
            for fused, projs in (("qkv_proj", ATTN_QKV), ("o_proj", ATTN_O)):
                g = self._group(f"{at}.{fused}", i, [f"{at}.{p}.weight" for p in projs], False, False)
                if g is not None:
                    yield g
            ex = f"model.layers.{i}.mlp.experts"
            for gname, projs, per_member in zip(experts_group_names(ex), (EXPERT_FC1, EXPERT_FC2), (False, True)):
                members = [f"{ex}.{e}.{p}.weight" for e in range(d.num_experts) for p in projs]
                g = self._group(gname, i, members, True, per_member)
                if g is not None:
                    yield g

    # ------------------------------------------------------------------ queries
    def group_of(self, weight_name: str) -> Optional[ActivationGroup]:
        """The activation group of HF weight ``weight_name`` (None: activations stay high precision)."""
        return self._by_member.get(weight_name)

    def __getitem__(self, group_name: str) -> ActivationGroup:
        return self._by_name[group_name]

    def __iter__(self) -> Iterator[ActivationGroup]:
        return iter(self.groups)

    def tensor_specs(self, shapes: Dict[str, Tuple[int, ...]]) -> Tuple[Dict[str, tuple], Dict[str, torch.dtype]]:
        """``({name: shape}, {name: dtype})`` of every rollout checkpoint tensor, given the HF shapes
        (``qwen3_moe.hf_shapes``); tensors absent from the dtype map keep the HF checkpoint's dtype."""
        out_shapes, dtypes = {}, {}
        for name, shape in shapes.items():
            t = self.plan[name]
            if t is None or not t.quantized:
                out_shapes[name] = tuple(shape)
                continue
            n, k = shape
            entries = {**nvfp4_weight_specs(n, k), **activation_specs(t.rollout, t.rac_channels)}
            for suffix, (shp, dtype) in entries.items():
                out_shapes[f"{t.module}.{suffix}"], dtypes[f"{t.module}.{suffix}"] = shp, dtype
        return out_shapes, dtypes
