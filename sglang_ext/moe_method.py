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
  w13_global_scale [E], w13_comp_index [k], w13/w2_input_global_scale [].
"""

from __future__ import annotations

import torch
from torch.nn import Parameter

from sglang.srt.layers.moe.fused_moe_triton import FusedMoeWeightScaleSupported
from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase
from sglang.srt.layers.utils import copy_or_rebind_param
from sglang.srt.utils.common import set_weight_attrs

from sglang_ext.kernels import w4a4_fused_moe

from quads_megatron.plan.rollout_schema import GROUP_SIZE

_SHARD_COLUMN = {"w1": 0, "w3": 1}
_UNSET_INDEX = -1


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
            raise NotImplementedError(
                f"{name}: quads MoE runs SiLU(gate) * up experts without biases or clamps; got "
                f"activation={cfg.activation!r}, is_gated={cfg.is_gated}, with_bias={with_bias}, "
                f"apply_router_weight_on_input={cfg.apply_router_weight_on_input}")
        h, f = hidden_size, intermediate_size_per_partition
        if h % GROUP_SIZE or f % GROUP_SIZE:
            raise ValueError(f"{name}: NVFP4 needs hidden size ({h}) and intermediate size per "
                             f"partition ({f}) to be multiples of {GROUP_SIZE}")
        k = self.rollout.rac_channels
        if self.rollout.uses_rac:
            if layer.moe_tp_size > 1:
                raise NotImplementedError(
                    f"{name}: RAC with expert tensor parallelism (moe_tp_size = "
                    f"{layer.moe_tp_size}) needs per-rank fc2 channels; use expert parallelism "
                    f"(--ep-size equal to --tp-size) or QUADS_PRECISION=w4a4")
            if k > f or k > h:
                raise ValueError(f"{name}: rac_channels = {k} exceeds hidden ({h}) or "
                                 f"intermediate ({f}) size")
        e, e_global = num_experts, layer.num_experts
        loader = extra_weight_attrs["weight_loader"]
        layer.params_dtype = params_dtype

        def add(pname: str, data: torch.Tensor, weight_loader=loader, **attrs) -> None:
            p = Parameter(data, requires_grad=False)
            layer.register_parameter(pname, p)
            set_weight_attrs(p, {"weight_loader": weight_loader, **attrs})

        add("w13_weight", torch.empty(e, 2 * f, h // 2, dtype=torch.uint8))
        add("w2_weight", torch.empty(e, h, f // 2, dtype=torch.uint8))
        block = FusedMoeWeightScaleSupported.BLOCK.value
        add("w13_weight_scale", torch.empty(e, 2 * f, h // GROUP_SIZE, dtype=torch.float8_e4m3fn),
            quant_method=block)
        add("w2_weight_scale", torch.empty(e, h, f // GROUP_SIZE, dtype=torch.float8_e4m3fn),
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
                add(pname, torch.full(shape, _UNSET_INDEX, dtype=torch.int32), local_loader)

    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config) -> None:
        """No SGLang MoeRunner: `apply` calls the QUADS kernel on standard top-k output."""
        self.moe_runner_config = moe_runner_config
        self.runner = None

    # --- after loading (runs again at the end of every RL weight update) ---------------
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        name = self.prefix or "FusedMoE"
        ws13 = layer.w13_weight_scale_2.detach()
        ws2 = layer.w2_weight_scale_2.detach()
        for pname, t in (("w13_weight_scale_2", ws13), ("w2_weight_scale_2", ws2)):
            if bool(torch.isnan(t).any()) or bool((t <= 0).any()):
                bad = torch.nonzero(torch.isnan(t) | (t <= 0))[:, 0].unique().tolist()
                raise ValueError(f"{name}.{pname}: experts {bad[:8]} have no positive per-tensor "
                                 f"scale (not in the checkpoint?)")
        differ = (ws13[:, 0] != ws13[:, 1]).nonzero().flatten().tolist()
        if differ:
            raise ValueError(
                f"{name}.w13_weight_scale_2: gate and up of experts {differ[:8]} have different "
                f"global scales ({ws13[differ[0]].tolist()}); QUADS and ModelOpt export one shared "
                f"scale per expert (quads_megatron.nvfp4.quantize_with_shared_scale)")
        copy_or_rebind_param(layer, "w13_global_scale", ws13[:, 0].contiguous())
        if self.rollout.static_activation_scale:
            for src, dst in (("w13_input_scale", "w13_input_global_scale"),
                             ("w2_input_scale", "w2_input_global_scale")):
                s = getattr(layer, src).detach()
                if bool(torch.isnan(s).any()) or bool((s <= 0).any()):
                    raise ValueError(f"{name}.{src}: activation_scaling 'static' needs a positive "
                                     f"input_scale for every expert (NaN = not loaded)")
                copy_or_rebind_param(layer, dst, s.max().reshape(()))
        if self.rollout.uses_rac:
            c13 = layer.w13_input_comp_index.detach()
            c2 = layer.w2_input_comp_index.detach()
            if bool((c13 == _UNSET_INDEX).any()) or bool((c2 == _UNSET_INDEX).any()):
                raise ValueError(f"{name}: precision 'w4a4_rac' needs input_comp_index for "
                                 f"gate_proj, up_proj and down_proj of every expert")
            flat = c13.reshape(-1, c13.shape[-1])
            if not bool((flat == flat[0]).all()):
                raise ValueError(f"{name}.w13_input_comp_index: fc1 reads the same hidden states "
                                 f"for every expert, so gate_proj and up_proj of all experts must "
                                 f"carry one shared channel set")
            copy_or_rebind_param(layer, "w13_comp_index", flat[0].contiguous())

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
            w2_input_scale=layer.w2_input_global_scale if static else None)
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
            raise ValueError(f"{weight_name}: shard_id must be w1, w2 or w3, got {shard_id!r}")
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
            raise ValueError(f"{weight_name} (expert {expert_id}, {shard_id}): expected "
                             f"{tuple(slot.shape) or 'a scalar'} ({slot.dtype}), got "
                             f"{tuple(loaded_weight.shape)}")
        slot.copy_(loaded)
