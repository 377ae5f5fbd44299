"""`QuadsLinearMethod`: SGLang linear layers over ModelOpt NVFP4 tensors, computed by `w4a4_linear`.

Parameters (ModelOpt names, checkpoint layout = compute layout, so nothing is repacked and
RL weight reloads write straight into the same tensors):
  weight            uint8 [N, K//2]         two E2M1 codes per byte (TP-sharded like BF16)
  weight_scale      float8_e4m3fn [N, K//16]
  weight_scale_2    float32 [shards]        one per logical matrix (q/k/v, gate/up)
  input_scale       float32 [shards]        static activation scale (used with activation_scaling=static)
  input_comp_index  int32 [shards * k]      RAC channels of each logical matrix (w4a4_rac only)
Merged layers whose shards share `weight_scale_2` and RAC channels (ModelOpt and QUADS
exporters share them) run as one GEMM; otherwise each shard runs with its own scale, which
is exact where ModelOpt's `.max()` would not be. The first load fixes that plan (CUDA graphs
replay it); a weight update that would need a different one is refused with a clear error. Static activation scales take the max over
shards, as ModelOpt does (all shards read the same activation).
"""

from __future__ import annotations

import logging
from typing import List, Optional, Tuple

import torch

from sglang.srt.layers.parameter import (BasevLLMParameter, ModelWeightParameter,
                                         PerTensorScaleParameter)
from sglang.srt.layers.quantization.base_config import LinearMethodBase
from sglang.srt.layers.utils import copy_or_rebind_param
from sglang.srt.utils.common import set_weight_attrs

from sglang_ext.kernels import w4a4_linear

from quads_megatron.plan.rollout_schema import GROUP_SIZE

logger = logging.getLogger(__name__)

_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}
_UNSET_INDEX = -1


class PerShardIndexParameter(BasevLLMParameter):
    """int32 [shards * k]: one RAC channel set per logical matrix, loaded by shard id.

    The channels index the layer's input (K), which column-parallel layers do not shard,
    so every rank loads the full set.
    """

    def __init__(self, data: torch.Tensor, weight_loader, num_shards: int, name: str):
        super().__init__(data=data, weight_loader=weight_loader)
        self.num_shards = num_shards
        self.k = data.numel() // num_shards
        self.param_name = name

    def _load_shard(self, loaded_weight: torch.Tensor, shard: int) -> None:
        if loaded_weight.dtype not in (torch.int32, torch.int64) or loaded_weight.ndim != 1 \
                or loaded_weight.numel() != self.k:
            raise ValueError(f"{self.param_name}: expected int32 [{self.k}] compensation channel "
                             f"indices (rac_channels), got {loaded_weight.dtype} "
                             f"{tuple(loaded_weight.shape)}")
        self.data[shard * self.k:(shard + 1) * self.k].copy_(loaded_weight)

    def load_column_parallel_weight(self, loaded_weight: torch.Tensor, **kwargs) -> None:
        self._load_shard(loaded_weight, 0)

    def load_row_parallel_weight(self, loaded_weight: torch.Tensor, **kwargs) -> None:
        self._load_shard(loaded_weight, 0)

    def load_merged_column_weight(self, loaded_weight: torch.Tensor, shard_id=0, **kwargs) -> None:
        self._load_shard(loaded_weight, int(shard_id))

    def load_qkv_weight(self, loaded_weight: torch.Tensor, shard_id="q", **kwargs) -> None:
        self._load_shard(loaded_weight, _QKV_SHARDS[shard_id])


class QuadsLinearMethod(LinearMethodBase):
    """NVFP4 linear for `--quantization quads`: `w4a4_linear` (Triton on CUDA, torch on CPU)."""

    def __init__(self, quant_config, prefix: str = ""):
        self.quant_config = quant_config
        self.rollout = quant_config.rollout
        self.prefix = prefix

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: List[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        name = self.prefix or type(layer).__name__
        if input_size_per_partition % GROUP_SIZE:
            raise ValueError(f"{name}: NVFP4 needs the input size per partition to be a multiple "
                             f"of {GROUP_SIZE}, got {input_size_per_partition}")
        rac = self.rollout.uses_rac
        k = self.rollout.rac_channels
        if rac and input_size_per_partition != input_size:
            raise NotImplementedError(
                f"{name}: RAC on a row-parallel layer with TP > 1 needs per-rank compensation "
                f"channels; serve with precision w4a4 (QUADS_PRECISION=w4a4) or "
                f"without tensor parallelism for this layer")
        if rac and k > input_size_per_partition:
            raise ValueError(f"{name}: rac_channels = {k} exceeds the {input_size_per_partition} "
                             f"input channels")
        weight_loader = extra_weight_attrs.get("weight_loader")
        n = sum(output_partition_sizes)
        shards = len(output_partition_sizes)
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = n
        layer.params_dtype = params_dtype

        layer.register_parameter("weight", ModelWeightParameter(
            data=torch.empty(n, input_size_per_partition // 2, dtype=torch.uint8),
            input_dim=1, output_dim=0, weight_loader=weight_loader))
        layer.register_parameter("weight_scale", ModelWeightParameter(
            data=torch.empty(n, input_size_per_partition // GROUP_SIZE, dtype=torch.float8_e4m3fn),
            input_dim=1, output_dim=0, weight_loader=weight_loader))
        # NaN marks "not loaded": process_weights_after_loading names the missing tensor.
        for pname in ("weight_scale_2", "input_scale"):
            p = PerTensorScaleParameter(data=torch.full((shards,), float("nan"), dtype=torch.float32),
                                        weight_loader=weight_loader)
            set_weight_attrs(p, {"needs_scalar_to_array": True})
            layer.register_parameter(pname, p)
        if rac:
            layer.register_parameter("input_comp_index", PerShardIndexParameter(
                data=torch.full((shards * k,), _UNSET_INDEX, dtype=torch.int32),
                weight_loader=weight_loader, num_shards=shards, name=f"{name}.input_comp_index"))

    # --- after loading (runs again at the end of every RL weight update) ---------------
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        name = self.prefix or type(layer).__name__
        shards = len(layer.logical_widths)
        ws2 = layer.weight_scale_2.detach()
        if bool(torch.isnan(ws2).any()) or bool((ws2 <= 0).any()):
            raise ValueError(f"{name}.weight_scale_2: expected {shards} positive float32 per-tensor "
                             f"scales from the checkpoint, got {ws2.tolist()} (NaN = not loaded)")
        if self.rollout.static_activation_scale:
            ins = layer.input_scale.detach()
            if bool(torch.isnan(ins).any()) or bool((ins <= 0).any()):
                raise ValueError(f"{name}.input_scale: activation_scaling 'static' needs positive "
                                 f"per-tensor input scales, got {ins.tolist()} (NaN = not loaded)")
            copy_or_rebind_param(layer, "input_global_scale", ins.max().reshape(()))
        comp = None
        if self.rollout.uses_rac:
            comp = layer.input_comp_index.detach().view(shards, -1)
            if bool((comp == _UNSET_INDEX).any()):
                raise ValueError(f"{name}.input_comp_index: precision 'w4a4_rac' needs the "
                                 f"checkpoint's compensation channels for every shard")
        shared = bool((ws2 == ws2[0]).all()) and (comp is None or bool((comp == comp[0]).all()))
        # The plan is fixed by the first load: a captured CUDA graph replays it, so a reload
        # may not switch a fused layer to per-shard GEMMs (per-shard stays valid for any data).
        first_load = not hasattr(layer, "quads_shard_rows")
        if first_load and shared:
            layer.quads_shard_rows = None
        elif first_load:
            bounds = torch.tensor([0] + list(layer.logical_widths)).cumsum(0).tolist()
            layer.quads_shard_rows = [(bounds[i], bounds[i + 1]) for i in range(shards)]
            logger.info("%s: shards carry different weight_scale_2 / RAC channels; running one "
                        "GEMM per shard", name)
        elif layer.quads_shard_rows is None and not shared:
            raise ValueError(
                f"{name}: the updated weights give the merged shards different weight_scale_2 / "
                f"RAC channels, but the layer was loaded with shared ones and runs as one GEMM "
                f"(possibly inside captured CUDA graphs); export the update with shared global "
                f"scales (as the first checkpoint had) or restart the server")

    # --- forward -----------------------------------------------------------------------
    def _shard_args(self, layer: torch.nn.Module, i: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(weight_scale_2, comp_index) views of shard i."""
        comp = None
        if self.rollout.uses_rac:
            comp = layer.input_comp_index.view(len(layer.logical_widths), -1)[i]
        return layer.weight_scale_2[i:i + 1], comp

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        mode = self.rollout.precision.value
        input_scale = layer.input_global_scale if self.rollout.static_activation_scale else None
        rows = layer.quads_shard_rows
        if rows is None:
            ws2, comp = self._shard_args(layer, 0)
            return w4a4_linear(x, layer.weight, layer.weight_scale, ws2, act_mode=mode,
                               comp_index=comp, input_scale=input_scale, bias=bias)
        outs = []
        for i, (lo, hi) in enumerate(rows):
            ws2, comp = self._shard_args(layer, i)
            outs.append(w4a4_linear(x, layer.weight[lo:hi], layer.weight_scale[lo:hi], ws2,
                                    act_mode=mode, comp_index=comp, input_scale=input_scale,
                                    bias=None if bias is None else bias[lo:hi]))
        return torch.cat(outs, dim=-1)
