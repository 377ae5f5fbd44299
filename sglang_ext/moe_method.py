"""`QuadsMoEMethod`: SGLang's FusedMoE over ModelOpt NVFP4 experts, computed by `w4a4_fused_moe`.

Parameters (ModelOpt names; checkpoint layout = compute layout, so RL reloads write in place):
  w13_weight / w2_weight               uint8 [E, 2F, H//2] / [E, H, F//2] (gate rows, then up)
  w13_weight_scale / w2_weight_scale   float8_e4m3fn [E, 2F, H//16] / [E, H, F//16]
  w13_weight_scale_2                   float32 [E, 2] (gate, up: must be equal, as QUADS and
                                       ModelOpt export them; the kernel shares one per expert)
  w2_weight_scale_2                    float32 [E]
  w13_input_scale / w2_input_scale     float32 [E_global, 2] / [E_global] (static scaling: max)
  w13_input_comp_index                 int32 [E, 2, k] (one set per layer, repeated per expert)
  w2_input_comp_index                  int32 [E, k] (one set per expert)
Derived after loading (same tensors refilled on every reload, so CUDA graphs stay valid):
  w13_global_scale [E], w13_comp_index [k], w13/w2_input_global_scale [],
  w13_comp_weight / w2_comp_weight     fp16 [E, 2F, k] / [E, H, k]: the RAC weight columns
                                       Wq[:, S] the GEMM's residual K-steps read
                                       (`quads_megatron.kernels.rac_columns`), w4a4_rac only.
Kernel layout (issue 25): where the local shapes fit (`plan.kernel_layout.kernel_layout_fits` of
w13 and w2), `layer.quads_weight_layout` is the v3 kernels' byte order: the loaders write ModelOpt
bytes, `layer.quads_fresh` (`plan.kernel_layout.PendingRows`, one per code and scale tensor) records the rows written since the last
`process_weights_after_loading`, which builds the RAC columns from ModelOpt codes and then converts
exactly those slices in place (a partial reload converts only what it wrote; CUDA graphs keep the
storage). Every update must end in `process_weights_after_loading` (SGLang's end_weight_update), as
the RAC columns and BF16 staging already require. `modelopt_bytes` reads codes and scales back.
A layer holding every expert unsharded (EP = 1, MoE TP = 1) also takes each parameter whole, under its own
name (`model.layers.0.mlp.experts.w13_weight`, SGLang's two-argument `weight_loader(param, tensor)`):
`sglang_ext.stacked_load` checks it once, copies it in place and marks every slice written (the RL tensor
sync: one call per layer parameter instead of one per expert, shard and tensor).
Every checkpoint tensor is checked as it is loaded (`sglang_ext.checkpoint_format`), named by its
HF name (`model.layers.0.mlp.experts.3.up_proj.weight_scale`), and `process_weights_after_loading`
names any expert slice the first load did not write; the forward skips the kernels' value checks.
On CUDA the forward sorts the routed rows with SGLang's own `moe_align_block_size` (its CUDA op, or its
one-launch Triton form at decode sizes: what SGLang's fused MoE runs) instead of the kernels' Triton
routing (docs/benchmarks.md section 7).
"""

from __future__ import annotations

import functools

import torch
from torch.nn import Parameter

from sglang.srt.layers.moe.fused_moe_triton import FusedMoeWeightScaleSupported
from sglang.srt.layers.moe.moe_runner.triton_utils import moe_align_block_size
from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase
from sglang.srt.layers.utils import copy_or_rebind_param
from sglang.srt.utils.common import set_weight_attrs

from sglang_ext.checkpoint_format import (SliceLog, as_block_scale, check_comp_index, check_packed_codes,
                                          check_tensor_scale, checked_loader)
from sglang_ext import bf16_sync, dummy_weights, stacked_load
from quads_megatron.kernels import w4a4_fused_moe
from quads_megatron.kernels.rac_columns import rac_weight_columns

from quads_megatron.errors import CheckpointError, ConfigError
from quads_megatron.nvfp4 import BLOCK_SIZE
from quads_megatron.plan.kernel_layout import KERNEL_WEIGHT_LAYOUT, PendingRows, kernel_layout_fits
from quads_megatron.plan.layout import (COMP_INDEX_DTYPE, EXPERT_FC1, EXPERT_FC2, WEIGHT, WEIGHT_SCALE,
                                        block_scale_cols, nvfp4_weight_specs, packed_cols)

_SHARD_COLUMN = {"w1": 0, "w3": 1}
_UNSET_INDEX = -1
# HF names of SGLang's expert shards (w1, w3: the layout's fc1 pair, sharing a scale and an input; w2: fc2)
_PROJ = {"w1": EXPERT_FC1[0], "w3": EXPERT_FC1[1], "w2": EXPERT_FC2[0]}
FC1_SHARDS = tuple(sid for proj in EXPERT_FC1 for sid, p in _PROJ.items() if p == proj)
_TRACKED = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")


def _modelopt_name(pname: str) -> str:
    """`w13_weight_scale_2` -> `weight_scale_2`: the name of the per-expert tensor in the checkpoint."""
    return pname.split("_", 1)[1]


def _local_slots(layer: torch.nn.Module, expert_id: int) -> list:
    """This rank's expert slots a checkpoint expert is written to (none when it lives on another rank)."""
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    meta = get_global_expert_location_metadata() if getattr(layer, "uses_expert_location", False) else None
    ids = [expert_id] if meta is None else meta.logical_to_all_physical(layer.layer_id, expert_id, False)
    out = []
    for i in ids:
        local = layer._map_global_expert_id_to_local_expert_id(i)
        if 0 <= local < layer.num_local_experts:
            out.append(local)
    return out


def _weight_rows(layer: torch.nn.Module, pname: str, shard_id: str) -> tuple:
    """The rows of one expert's `pname` slot a shard fills: gate (w1) / up (w3) halves of w13, all of w2."""
    n = getattr(layer, pname).shape[1]
    return (0, n) if shard_id == "w2" else ((0, n // 2) if _SHARD_COLUMN[shard_id] == 0 else (n // 2, n))


def every_slot(layer: torch.nn.Module, pname: str) -> list:
    """All (local expert, shard) slots of `pname`: gate (w1) and up (w3) of w13, w2 of w2."""
    sids = FC1_SHARDS if pname.startswith("w13") else ("w2",)
    return [(e, sid) for e in range(layer.num_local_experts) for sid in sids]


def mark_written(layer: torch.nn.Module, pname: str, slots) -> None:
    """Record (local expert, shard) slices of `pname` a load wrote: for the check of what the first load
    missed (`quads_slices`) and, for codes and scales in the kernel layout, the rows to convert once (`quads_fresh`)."""
    layer.quads_slices.mark(pname, slots)
    if pname in layer.quads_fresh:
        for e, sid in slots:
            layer.quads_fresh[pname].mark([e], *_weight_rows(layer, pname, sid))


def modelopt_bytes(layer: torch.nn.Module, pname: str) -> torch.Tensor:
    """`w13_weight` / `w2_weight` codes or `w13_weight_scale` / `w2_weight_scale` block scales in ModelOpt order
    (the parameter itself in the v2 layout, else as `PendingRows.modelopt` reads them): what the RAC columns,
    checks and any re-send read."""
    t = getattr(layer, pname).detach()
    if layer.quads_weight_layout == "modelopt":
        return t
    return layer.quads_fresh[pname].modelopt(t, pname)


def _nan(*shape: int) -> torch.Tensor:
    """float32 filled with NaN: marks a per-tensor scale the checkpoint has not provided yet."""
    return torch.full(shape, float("nan"), dtype=torch.float32)


class QuadsMoEMethod(FusedMoEMethodBase):
    """NVFP4 fused MoE for `--quantization quads` (SiLU-gated experts, standard top-k routing)."""

    # the top-k op multiplies routed_scaling_factor into the routing weights
    fuse_routed_scaling_factor_in_topk = True

    def __init__(self, quant_config, prefix: str = ""):
        self.quant_config = quant_config
        self.rollout = quant_config.rollout
        self.prefix = prefix

    # --- weights -----------------------------------------------------------------------
    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       with_bias: bool = False, **extra_weight_attrs) -> None:
        name = self.prefix or "FusedMoE"
        cfg = layer.moe_runner_config
        if not cfg.is_gated or cfg.activation != "silu" or with_bias or \
                cfg.apply_router_weight_on_input or cfg.gemm1_alpha is not None or \
                cfg.swiglu_limit is not None or cfg.gemm1_clamp_limit is not None:
            raise ConfigError(
                f"{name}: quads MoE runs SiLU(gate) * up experts without biases or clamps; got "
                f"activation={cfg.activation!r}, is_gated={cfg.is_gated}, with_bias={with_bias}, "
                f"apply_router_weight_on_input={cfg.apply_router_weight_on_input}")
        h, f = hidden_size, intermediate_size_per_partition
        if h % BLOCK_SIZE or f % BLOCK_SIZE:
            raise CheckpointError(f"{name}: NVFP4 needs hidden size ({h}) and intermediate size per "
                                  f"partition ({f}) to be multiples of {BLOCK_SIZE}")
        k = self.rollout.rac_channels
        if self.rollout.uses_rac:
            if layer.moe_tp_size > 1:
                raise ConfigError(
                    f"{name}: RAC with expert tensor parallelism (moe_tp_size = "
                    f"{layer.moe_tp_size}) needs per-rank fc2 channels; use expert parallelism "
                    f"(--ep-size equal to --tp-size) or export the checkpoint with --rollout-precision w4a4")
            self.rollout.check_input_size(h, f"{name} (gate_proj / up_proj)")
            self.rollout.check_input_size(f, f"{name} (down_proj)")
        e, e_global = num_experts, layer.num_experts
        loader = extra_weight_attrs["weight_loader"]
        layer.params_dtype = params_dtype
        layer.quads_dims = (h, f * layer.moe_tp_size)  # the checkpoint's hidden and full intermediate size
        layer.quads_slices = SliceLog()
        layer.quads_weight_layout = (KERNEL_WEIGHT_LAYOUT if kernel_layout_fits(2 * f, h) and kernel_layout_fits(h, f)
                                     else "modelopt")  # by the local shapes, fixed for the layer's life
        # the rows of the codes and block scales written in ModelOpt order since the last conversion (kernel layout only)
        layer.quads_fresh = ({p: PendingRows(scales=p.endswith("_scale")) for p in _TRACKED}
                             if layer.quads_weight_layout != "modelopt" else {})

        def add(pname: str, data: torch.Tensor, weight_loader=loader, **attrs) -> None:
            p = Parameter(data, requires_grad=False)
            layer.register_parameter(pname, p)
            checked = checked_loader(weight_loader, functools.partial(self._check_loaded, layer, pname))
            if pname in ("w13_weight", "w2_weight"):  # a BF16 weight sync sends these unquantized
                checked = functools.partial(self._load_weight, layer, checked)
            set_weight_attrs(p, {"weight_loader": self._layer_or_expert_loader(layer, pname, checked), **attrs})

        block = FusedMoeWeightScaleSupported.BLOCK.value
        for which, (n, k_in) in (("w13", (2 * f, h)), ("w2", (h, f))):  # the rollout layout (plan.layout)
            specs = nvfp4_weight_specs(n, k_in, lead=(e,))
            add(f"{which}_weight", torch.empty(specs[WEIGHT][0], dtype=specs[WEIGHT][1]))
            add(f"{which}_weight_scale", torch.empty(specs[WEIGHT_SCALE][0], dtype=specs[WEIGHT_SCALE][1]),
                quant_method=block)
        tensor = FusedMoeWeightScaleSupported.TENSOR.value
        add("w13_weight_scale_2", _nan(e, 2), quant_method=tensor)
        add("w2_weight_scale_2", _nan(e), quant_method=tensor)
        # Per-shard and per-index tensors get their own loader: FusedMoE's generic path writes
        # one value per expert for input scales and ignores unknown names.
        scalar_loader = _ExpertSlotLoader(layer, global_experts=True)
        local_loader = _ExpertSlotLoader(layer, global_experts=False)
        add("w13_input_scale", _nan(e_global, 2), scalar_loader)
        add("w2_input_scale", _nan(e_global), scalar_loader)
        if self.rollout.uses_rac:
            for pname, shape in (("w13_input_comp_index", (e, 2, k)), ("w2_input_comp_index", (e, k))):
                add(pname, torch.full(shape, _UNSET_INDEX, dtype=COMP_INDEX_DTYPE), local_loader)

    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config) -> None:
        """No SGLang MoeRunner: `apply` calls the QUADS kernel on standard top-k output."""
        self.moe_runner_config = moe_runner_config
        self.runner = None

    # --- after loading (runs again at the end of every RL weight update) ---------------
    def tensor_name(self, layer: torch.nn.Module, expert_id: int, shard_id: str, pname: str) -> str:
        """Checkpoint name of one expert's tensor: `model.layers.0.mlp.experts.3.up_proj.weight_scale`."""
        return f"{self.prefix or 'experts'}.{expert_id}.{_PROJ[shard_id]}.{_modelopt_name(pname)}"

    def _check_loaded(self, layer: torch.nn.Module, pname: str, param, loaded: torch.Tensor,
                      weight_name: str = "", shard_id: str = "", expert_id: int = -1, *args, **kwargs
                      ) -> torch.Tensor:
        """Check one expert tensor before SGLang copies it; record the local slots it writes."""
        if shard_id not in _PROJ:
            raise CheckpointError(f"{weight_name or pname}: expert shard must be w1, w2 or w3, got {shard_id!r}")
        name = self.tensor_name(layer, expert_id, shard_id, pname)
        h, f = layer.quads_dims
        fc1 = shard_id != "w2"
        rows, k_in = (f, h) if fc1 else (h, f)
        if pname.endswith("_weight"):
            loaded = check_packed_codes(name, loaded, (rows, packed_cols(k_in)))
        elif pname.endswith("_weight_scale"):
            loaded = as_block_scale(name, loaded, (rows, block_scale_cols(k_in)))
        elif pname.endswith("_comp_index"):
            loaded = check_comp_index(name, loaded, self.rollout.rac_channels, k_in)
        else:
            loaded = check_tensor_scale(name, loaded, "scale")
        if pname in _TRACKED:
            mark_written(layer, pname, [(e, shard_id) for e in _local_slots(layer, expert_id)])
        return loaded

    def _load_weight(self, layer, checked, param, loaded_weight, weight_name: str = "", shard_id: str = "",
                     expert_id: int = -1, *args, **kwargs):
        """Packed NVFP4 codes load as they are; a high-precision expert weight (a BF16 RL weight sync) is
        staged and quantized at the end of the update (`sglang_ext.bf16_sync`)."""
        if loaded_weight.is_floating_point():
            if shard_id not in _PROJ:
                raise CheckpointError(f"{weight_name}: expert shard must be w1, w2 or w3, got {shard_id!r}")
            name = f"{self.prefix or 'experts'}.{expert_id}.{_PROJ[shard_id]}.weight"
            return bf16_sync.stage(layer, name, loaded_weight, shard_id, expert_id)
        return checked(param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)

    def _layer_or_expert_loader(self, layer: torch.nn.Module, pname: str, per_expert):
        """`(param, tensor)`: the whole layer's `pname` (`stacked_load`); with SGLang's expert arguments
        (`name, shard_id=, expert_id=`): one expert's slice, through `per_expert`."""
        def load(param, loaded_weight, *args, **kwargs):
            if args or kwargs:
                return per_expert(param, loaded_weight, *args, **kwargs)
            return self._load_stacked(layer, pname, param, loaded_weight)

        return load

    def _load_stacked(self, layer: torch.nn.Module, pname: str, param, loaded: torch.Tensor) -> None:
        """One whole-layer tensor under the FusedMoE parameter's name: checked once, copied in place, marked."""
        name = f"{self.prefix or 'experts'}.{pname}"
        if not stacked_load.holds_every_expert(layer):
            raise CheckpointError(
                f"{name}: a whole-layer tensor needs every expert of the layer unsharded on this rank (EP size 1, "
                f"MoE TP size 1); this rank has EP {layer.moe_ep_size}, MoE TP {layer.moe_tp_size}, "
                f"{layer.num_local_experts} of {layer.num_experts} experts: send the per-expert names "
                f"(experts.<e>.gate_proj.weight, ...)")
        if pname in ("w13_weight", "w2_weight") and loaded.is_floating_point():
            return stacked_load.stage_bf16(layer, self.prefix or "experts", pname, loaded, FC1_SHARDS)
        h, f = layer.quads_dims
        loaded = stacked_load.checked_stacked(name, pname, param, loaded, h if pname.startswith("w13") else f)
        param.data.copy_(loaded)
        if pname in _TRACKED:
            mark_written(layer, pname, every_slot(layer, pname))

    def _global_id(self, layer: torch.nn.Module, local: int) -> int:
        return local + layer.moe_ep_rank * layer.num_local_experts

    def _names(self, layer, slots, pname: str, local: bool = True) -> str:
        """Names of (expert, shard) slots, at most 4 (then a count)."""
        names = [self.tensor_name(layer, self._global_id(layer, e) if local else e, sid, pname)
                 for e, sid in slots[:4]]
        more = f" and {len(slots) - 4} more" if len(slots) > 4 else ""
        return ", ".join(names) + more

    def _check_complete(self, layer: torch.nn.Module) -> None:
        """Every local expert's tensors were written by some load (else: uninitialized memory)."""
        e = layer.num_local_experts
        for pname in _TRACKED:
            missing = layer.quads_slices.missing(pname, every_slot(layer, pname))
            if missing:
                raise CheckpointError(f"{self._names(layer, missing, pname)}: missing from the checkpoint")
        for pname, sids in (("w13_weight_scale_2", FC1_SHARDS), ("w2_weight_scale_2", ("w2",))):
            t = getattr(layer, pname).detach().reshape(e, -1)
            missing = [(int(i), sids[int(j)]) for i, j in torch.nonzero(torch.isnan(t)).tolist()]
            if missing:
                raise CheckpointError(f"{self._names(layer, missing, pname)}: missing from the checkpoint "
                                      f"(expected one positive float32 per-tensor scale)")
        if self.rollout.static_activation_scale:
            for pname, sids in (("w13_input_scale", FC1_SHARDS), ("w2_input_scale", ("w2",))):
                t = getattr(layer, pname).detach().reshape(layer.num_experts, -1)
                missing = [(int(i), sids[int(j)]) for i, j in torch.nonzero(torch.isnan(t)).tolist()]
                if missing:
                    raise CheckpointError(f"{self._names(layer, missing, pname, local=False)}: missing from the "
                                          f"checkpoint (activation_scaling 'static' needs every input_scale)")
        if self.rollout.uses_rac:
            for pname, sids in (("w13_input_comp_index", FC1_SHARDS), ("w2_input_comp_index", ("w2",))):
                t = getattr(layer, pname).detach()
                unset = (t == _UNSET_INDEX).any(-1).reshape(e, -1)
                missing = [(int(i), sids[int(j)]) for i, j in torch.nonzero(unset).tolist()]
                if missing:
                    raise CheckpointError(f"{self._names(layer, missing, pname)}: missing from the checkpoint "
                                          f"(precision 'w4a4_rac' needs RAC channels for gate_proj, up_proj "
                                          f"and down_proj of every expert)")

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        name = self.prefix or "FusedMoE"
        if not layer.quads_slices.written and dummy_weights.requested():  # --load-format dummy: nothing read
            dummy_weights.fill_moe(layer, self.rollout, name)
            for pname in _TRACKED:
                mark_written(layer, pname, every_slot(layer, pname))
        bf16_sync.quantize_staged(layer, _local_slots, self.tensor_name, FC1_SHARDS)
        self._check_complete(layer)
        ws13 = layer.w13_weight_scale_2.detach()
        differ = (ws13[:, 0] != ws13[:, 1]).nonzero().flatten().tolist()
        if differ:
            raise CheckpointError(
                f"{name}.w13_weight_scale_2: gate and up of experts {differ[:8]} have different "
                f"global scales ({ws13[differ[0]].tolist()}); QUADS and ModelOpt export one shared "
                f"scale per expert (quads_megatron.nvfp4.quantize_with_shared_scale)")
        copy_or_rebind_param(layer, "w13_global_scale", ws13[:, 0].contiguous())
        if self.rollout.static_activation_scale:
            for src, dst in (("w13_input_scale", "w13_input_global_scale"),
                             ("w2_input_scale", "w2_input_global_scale")):
                copy_or_rebind_param(layer, dst, getattr(layer, src).detach().max().reshape(()))
        if self.rollout.uses_rac:
            flat = layer.w13_input_comp_index.detach().reshape(-1, self.rollout.rac_channels)
            if not bool((flat == flat[0]).all()):
                raise CheckpointError(f"{name}.w13_input_comp_index: fc1 reads the same hidden states "
                                      f"for every expert, so gate_proj and up_proj of all experts must "
                                      f"carry one shared channel set (input_comp_index)")
            copy_or_rebind_param(layer, "w13_comp_index", flat[0].contiguous())
            # the weights are final here (first load and every weight update): store Wq[:, S]
            copy_or_rebind_param(layer, "w13_comp_weight", rac_weight_columns(
                modelopt_bytes(layer, "w13_weight"), modelopt_bytes(layer, "w13_weight_scale"),
                layer.w13_comp_index.detach()))
            copy_or_rebind_param(layer, "w2_comp_weight", rac_weight_columns(
                modelopt_bytes(layer, "w2_weight"), modelopt_bytes(layer, "w2_weight_scale"),
                layer.w2_input_comp_index.detach()))
        for pname, pending in layer.quads_fresh.items():  # last: what this update wrote, into the kernel layout
            pending.settle(getattr(layer, pname).data, pname)

    # --- forward -----------------------------------------------------------------------
    def apply(self, layer: torch.nn.Module, dispatch_output) -> StandardCombineInput:
        x = dispatch_output.hidden_states
        topk = dispatch_output.topk_output
        topk_weights, topk_ids = topk.topk_weights, topk.topk_ids
        if layer.moe_ep_size > 1:
            # the standard dispatcher marks other ranks' experts with -1: route them to
            # expert 0 with weight 0 (the kernel takes ids in [0, E_local))
            keep = topk_ids >= 0
            topk_weights = topk_weights * keep
            topk_ids = topk_ids.clamp(min=0)
        static = self.rollout.static_activation_scale
        rac = self.rollout.uses_rac
        out = w4a4_fused_moe(
            x, layer.w13_weight, layer.w13_weight_scale, layer.w13_global_scale,
            layer.w2_weight, layer.w2_weight_scale, layer.w2_weight_scale_2,
            topk_weights, topk_ids, act_mode=self.rollout.precision.value,
            w13_comp_index=layer.w13_comp_index if rac else None,
            w2_comp_index=layer.w2_input_comp_index if rac else None,
            w13_input_scale=layer.w13_input_global_scale if static else None,
            w2_input_scale=layer.w2_input_global_scale if static else None, check_inputs=False,
            w13_comp_weight=layer.w13_comp_weight if rac else None,
            w2_comp_weight=layer.w2_comp_weight if rac else None,
            weight_layout=layer.quads_weight_layout,
            align_block_size=moe_align_block_size if x.is_cuda else None)
        return StandardCombineInput(hidden_states=out)


class _ExpertSlotLoader:
    """FusedMoE-style loader `(param, tensor, name, shard_id, expert_id)` writing one expert's slot.

    Shard w1/w3 go to column 0/1 of a `[E, 2, ...]` tensor, w2 to `[E, ...]`; expert ids are
    global (input scales, like ModelOpt's) or mapped to this rank's local experts.
    """

    def __init__(self, layer: torch.nn.Module, global_experts: bool):
        self.layer = layer
        self.global_experts = global_experts

    def __call__(self, param: Parameter, loaded_weight: torch.Tensor, weight_name: str,
                 shard_id: str, expert_id: int) -> None:
        if shard_id not in ("w1", "w2", "w3"):
            raise CheckpointError(f"{weight_name}: shard_id must be w1, w2 or w3, got {shard_id!r}")
        if not self.global_experts:
            expert_id = self.layer._map_global_expert_id_to_local_expert_id(expert_id)
            if expert_id < 0:
                return
        slot = param.data[expert_id]
        if shard_id != "w2":
            slot = slot[_SHARD_COLUMN[shard_id]]
        loaded = loaded_weight.reshape(slot.shape) if loaded_weight.numel() == slot.numel() \
            else None
        if loaded is None:
            raise CheckpointError(f"{weight_name} (expert {expert_id}, {shard_id}): expected "
                             f"{tuple(slot.shape) or 'a scalar'} ({slot.dtype}), got "
                             f"{tuple(loaded_weight.shape)}")
        slot.copy_(loaded)
