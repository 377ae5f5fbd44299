"""`QuadsLinearMethod`: SGLang linear layers over ModelOpt NVFP4 tensors, computed by `w4a4_linear`.

Parameters (ModelOpt names, checkpoint layout = compute layout, so nothing is repacked and
RL weight reloads write straight into the same tensors):
  weight            uint8 [N, K//2]         two E2M1 codes per byte (TP-sharded like BF16)
  weight_scale      float8_e4m3fn [N, K//16]
  weight_scale_2    float32 [shards]        one per logical matrix (q/k/v, gate/up)
  input_scale       float32 [shards]        static activation scale (used with activation_scaling=static)
  input_comp_index  int32 [shards * k]      RAC channels of each logical matrix (w4a4_rac only)
Derived after loading (refilled in place on every reload): comp_weight fp16 [N, k], the RAC
weight columns Wq[:, S] of each shard at its own channels (`quads_megatron.kernels.rac_columns`),
which the GEMM's residual K-steps read (w4a4_rac only).
Merged layers whose shards share `weight_scale_2` and RAC channels (ModelOpt and QUADS
exporters share them) run as one GEMM; otherwise each shard runs with its own scale, which
is exact where ModelOpt's `.max()` would not be. The first load fixes that plan (CUDA graphs
replay it); a weight update that would need a different one is refused with a clear error. Static activation scales take the max over
shards, as ModelOpt does (all shards read the same activation).
Kernel layout (issue 25): where every shard's rows and the local K fit (`plan.kernel_layout`),
`layer.quads_weight_layout` is the v3 kernels' byte order: loads write ModelOpt bytes, the shards
they wrote (`layer.quads_fresh`) are converted in place, once, by `process_weights_after_loading`
after the RAC columns are built from ModelOpt codes and scales; `modelopt_bytes` reads them back.
Every checkpoint tensor is checked as it is loaded (`sglang_ext.checkpoint_format`): dtype, shape,
finite positive scales, NaN E4M3 bytes, RAC indices; `process_weights_after_loading` names any
shard the first load did not write. So the forward runs without the kernels' value checks
(`check_inputs=False`: no host sync per call).
"""

from __future__ import annotations

import functools
import logging
from typing import List, Optional, Tuple

import torch

from sglang.srt.layers.parameter import (BasevLLMParameter, ModelWeightParameter,
                                         PerTensorScaleParameter)
from sglang.srt.layers.quantization.base_config import LinearMethodBase
from sglang.srt.layers.utils import copy_or_rebind_param
from sglang.srt.utils.common import set_weight_attrs

from sglang_ext import dummy_weights
from sglang_ext.checkpoint_format import (SliceLog, as_block_scale, check_comp_index, check_packed_codes,
                                          check_tensor_scale, checked_loader)
from quads_megatron.kernels import w4a4_linear
from quads_megatron.kernels.rac_columns import rac_weight_columns

from quads_megatron.errors import CheckpointError, ConfigError
from quads_megatron.nvfp4 import BLOCK_SIZE
from quads_megatron.plan.kernel_layout import KERNEL_WEIGHT_LAYOUT, PendingRows, kernel_layout_fits
from quads_megatron.plan.layout import (COMP_INDEX, COMP_INDEX_DTYPE, WEIGHT, WEIGHT_SCALE, block_scale_cols,
                                        nvfp4_weight_specs, packed_cols)

logger = logging.getLogger(__name__)

_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}
_UNSET_INDEX = -1
# checkpoint (HF) names of the matrices SGLang merges, used in error messages
_DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _shard_indices(layer: torch.nn.Module, shard_id) -> List[int]:
    """The logical matrices a load with `shard_id` writes (None: all of them)."""
    if shard_id is None:
        return list(range(len(layer.logical_widths)))
    if isinstance(shard_id, (tuple, list)):
        return [int(s) for s in shard_id]
    return [_QKV_SHARDS[shard_id] if isinstance(shard_id, str) else int(shard_id)]


def _full_rows(layer: torch.nn.Module, shards: List[int]) -> Optional[int]:
    """Output rows of the checkpoint tensor(s) of `shards` before TP sharding (None: not known)."""
    if getattr(layer, "use_presharded_weights", False):
        return None
    if hasattr(layer, "total_num_kv_heads"):  # QKVParallelLinear: the checkpoint has every head once
        sizes = [layer.total_num_heads * layer.head_size, layer.total_num_kv_heads * layer.head_size,
                 layer.total_num_kv_heads * layer.v_head_size]
    elif hasattr(layer, "output_sizes"):
        sizes = list(layer.output_sizes)
    else:
        sizes = [layer.output_size]
    if len(sizes) != len(layer.logical_widths):
        return None
    return sum(sizes[i] for i in shards)


def _shard_bounds(layer: torch.nn.Module) -> List[int]:
    return torch.tensor([0] + list(layer.logical_widths)).cumsum(0).tolist()


def modelopt_bytes(layer: torch.nn.Module, pname: str = WEIGHT) -> torch.Tensor:
    """`weight` / `weight_scale` in ModelOpt order (the parameter itself in the v2 layout, else as
    `PendingRows.modelopt` reads it): RAC columns, checks and any read-back for a re-send."""
    t = getattr(layer, pname).detach()
    return t if layer.quads_weight_layout == "modelopt" else layer.quads_fresh[pname].modelopt(t, pname)


class PerShardIndexParameter(BasevLLMParameter):
    """int32 [shards * k]: one RAC channel set per logical matrix, loaded by shard id.

    The channels index the layer's input (K), which column-parallel layers do not shard,
    so every rank loads the full set. Each set is checked when it is loaded (count, range,
    sorted, unique), so the forward does not have to.
    """

    def __init__(self, data: torch.Tensor, weight_loader, num_shards: int, k_in: int, shard_name):
        super().__init__(data=data, weight_loader=weight_loader)
        self.num_shards = num_shards
        self.k = data.numel() // num_shards
        self.k_in = k_in
        self.shard_name = shard_name

    def _load_shard(self, loaded_weight: torch.Tensor, shard: int) -> None:
        checked = check_comp_index(self.shard_name(shard), loaded_weight, self.k, self.k_in)
        self.data[shard * self.k:(shard + 1) * self.k].copy_(checked)

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

    # --- names -------------------------------------------------------------------------
    def tensor_name(self, layer: torch.nn.Module, shard: Optional[int], pname: str) -> str:
        """Checkpoint name of one shard's tensor: `model.layers.0.self_attn.k_proj.weight_scale`."""
        name = self.prefix or type(layer).__name__
        if shard is None or len(layer.logical_widths) == 1:
            return f"{name}.{pname}"
        head, _, last = name.rpartition(".")
        packed = {**_DEFAULT_PACKED, **(getattr(self.quant_config, "packed_modules_mapping", None) or {})}
        parts = packed.get(last)
        if parts and len(parts) == len(layer.logical_widths):
            return f"{head + '.' if head else ''}{parts[shard]}.{pname}"
        return f"{name}.{pname} (shard {shard})"

    def _names(self, layer: torch.nn.Module, shards: List[int], pname: str) -> str:
        return ", ".join(self.tensor_name(layer, s, pname) for s in shards)

    # --- weights -----------------------------------------------------------------------
    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: List[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        name = self.prefix or type(layer).__name__
        if input_size_per_partition % BLOCK_SIZE:
            raise CheckpointError(f"{name}: NVFP4 needs the input size per partition to be a multiple "
                                  f"of {BLOCK_SIZE}, got {input_size_per_partition}")
        rac = self.rollout.uses_rac
        k = self.rollout.rac_channels
        if rac and input_size_per_partition != input_size:
            raise ConfigError(
                f"{name}: RAC on a row-parallel layer with TP > 1 needs per-rank compensation "
                f"channels; export the checkpoint with --rollout-precision w4a4, or serve "
                f"without tensor parallelism for this layer")
        if rac:
            self.rollout.check_input_size(input_size_per_partition, name)
        weight_loader = extra_weight_attrs.get("weight_loader")
        n = sum(output_partition_sizes)
        shards = len(output_partition_sizes)
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = n
        layer.params_dtype = params_dtype
        layer.quads_input_size = input_size
        layer.quads_slices = SliceLog()
        # rows of the codes and of the block scales written in ModelOpt order since the last conversion
        layer.quads_fresh = {WEIGHT: PendingRows(), WEIGHT_SCALE: PendingRows(scales=True)}
        fits = kernel_layout_fits(n, input_size_per_partition) and all(
            kernel_layout_fits(w, input_size_per_partition) for w in output_partition_sizes)
        layer.quads_weight_layout = KERNEL_WEIGHT_LAYOUT if fits else "modelopt"  # by shape, for the layer's life

        def loader(pname: str):
            return checked_loader(weight_loader, functools.partial(self._check_loaded, layer, pname))

        specs = nvfp4_weight_specs(n, input_size_per_partition)  # the rollout layout (plan.layout)
        for pname in (WEIGHT, WEIGHT_SCALE):
            shape, dtype = specs[pname]
            layer.register_parameter(pname, ModelWeightParameter(
                data=torch.empty(shape, dtype=dtype), input_dim=1, output_dim=0, weight_loader=loader(pname)))
        # NaN marks "not loaded": process_weights_after_loading names the missing tensor.
        for pname in ("weight_scale_2", "input_scale"):
            p = PerTensorScaleParameter(data=torch.full((shards,), float("nan"), dtype=torch.float32),
                                        weight_loader=loader(pname))
            set_weight_attrs(p, {"needs_scalar_to_array": True})
            layer.register_parameter(pname, p)
        if rac:
            layer.register_parameter(COMP_INDEX, PerShardIndexParameter(
                data=torch.full((shards * k,), _UNSET_INDEX, dtype=COMP_INDEX_DTYPE),
                weight_loader=weight_loader, num_shards=shards, k_in=input_size_per_partition,
                shard_name=lambda s: self.tensor_name(layer, s, "input_comp_index")))

    def _check_loaded(self, layer: torch.nn.Module, pname: str, param, loaded: torch.Tensor,
                      shard_id=None, *args, **kwargs) -> torch.Tensor:
        """Check one checkpoint tensor before SGLang copies it; record the shards it writes."""
        shards = _shard_indices(layer, shard_id)
        name = self._names(layer, shards, pname) if shard_id is not None else self.tensor_name(layer, None, pname)
        k = layer.quads_input_size
        rows = _full_rows(layer, shards)
        if pname == "weight":
            loaded = check_packed_codes(name, loaded, (rows, packed_cols(k)))
        elif pname == "weight_scale":
            loaded = as_block_scale(name, loaded, (rows, block_scale_cols(k)))
        elif shard_id is None and loaded.numel() == len(shards) > 1:  # a pre-fused per-shard scale vector
            for i, s in enumerate(shards):
                check_tensor_scale(self.tensor_name(layer, s, pname), loaded.reshape(-1)[i], "scale")
            loaded = loaded.to(torch.float32)
        else:
            loaded = check_tensor_scale(name, loaded, "scale")
        layer.quads_slices.mark(pname, shards)
        if pname in layer.quads_fresh and layer.quads_weight_layout != "modelopt":
            b = _shard_bounds(layer)
            for i in shards:
                layer.quads_fresh[pname].mark([0], b[i], b[i + 1])
        return loaded

    # --- after loading (runs again at the end of every RL weight update) ---------------
    def _check_complete(self, layer: torch.nn.Module) -> None:
        """Every shard's tensors were written by some load (a missing one would be uninitialized memory)."""
        shards = list(range(len(layer.logical_widths)))
        for pname in ("weight", "weight_scale"):
            missing = layer.quads_slices.missing(pname, shards)
            if missing:
                raise CheckpointError(f"{self._names(layer, missing, pname)}: missing from the checkpoint "
                                      f"(expected for every shard of {self.prefix or type(layer).__name__})")
        ws2 = layer.weight_scale_2.detach()
        missing = torch.nonzero(torch.isnan(ws2)).flatten().tolist()
        if missing:
            raise CheckpointError(f"{self._names(layer, missing, 'weight_scale_2')}: missing from the checkpoint "
                                  f"(expected one positive float32 per-tensor scale)")
        if self.rollout.static_activation_scale:
            missing = torch.nonzero(torch.isnan(layer.input_scale.detach())).flatten().tolist()
            if missing:
                raise CheckpointError(f"{self._names(layer, missing, 'input_scale')}: missing from the checkpoint "
                                      f"(activation_scaling 'static' needs a per-tensor input scale)")
        if self.rollout.uses_rac:
            comp = layer.input_comp_index.detach().view(len(shards), -1)
            missing = torch.nonzero((comp == _UNSET_INDEX).any(-1)).flatten().tolist()
            if missing:
                raise CheckpointError(f"{self._names(layer, missing, 'input_comp_index')}: missing from the "
                                      f"checkpoint (precision 'w4a4_rac' needs RAC channels for every shard)")

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        name = self.prefix or type(layer).__name__
        shards = len(layer.logical_widths)
        if not layer.quads_slices.written and dummy_weights.requested():  # --load-format dummy: nothing read
            dummy_weights.fill_linear(layer, self.rollout, name)
            for pname in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
                layer.quads_slices.mark(pname, range(shards))
            if layer.quads_weight_layout != "modelopt":
                for pending in layer.quads_fresh.values():
                    pending.mark([0], 0, layer.weight.shape[0])
        self._check_complete(layer)
        ws2 = layer.weight_scale_2.detach()
        if self.rollout.static_activation_scale:
            copy_or_rebind_param(layer, "input_global_scale", layer.input_scale.detach().max().reshape(()))
        comp = layer.input_comp_index.detach().view(shards, -1) if self.rollout.uses_rac else None
        if comp is not None:  # the weights are final here (first load and every weight update)
            bounds = _shard_bounds(layer)
            w, ws = modelopt_bytes(layer, WEIGHT), modelopt_bytes(layer, WEIGHT_SCALE)
            copy_or_rebind_param(layer, "comp_weight", torch.cat([
                rac_weight_columns(w[lo:hi], ws[lo:hi], comp[i])
                for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))]))
        for pname, pending in layer.quads_fresh.items():  # last: what this update wrote, into the kernel layout
            pending.settle(getattr(layer, pname).data, pname)
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
            raise CheckpointError(
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

    def _comp_weight(self, layer: torch.nn.Module, rows=None) -> Optional[torch.Tensor]:
        """The stored RAC weight columns (of output rows lo:hi), None without RAC."""
        if not self.rollout.uses_rac:
            return None
        return layer.comp_weight if rows is None else layer.comp_weight[rows[0]:rows[1]]

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        mode = self.rollout.precision.value
        input_scale = layer.input_global_scale if self.rollout.static_activation_scale else None
        rows = layer.quads_shard_rows
        if rows is None:
            ws2, comp = self._shard_args(layer, 0)
            return w4a4_linear(x, layer.weight, layer.weight_scale, ws2, act_mode=mode,
                               comp_index=comp, input_scale=input_scale, bias=bias,
                               check_inputs=False, comp_weight=self._comp_weight(layer),
                               weight_layout=layer.quads_weight_layout)
        outs = []
        for i, (lo, hi) in enumerate(rows):
            ws2, comp = self._shard_args(layer, i)
            outs.append(w4a4_linear(x, layer.weight[lo:hi], layer.weight_scale[lo:hi], ws2,
                                    act_mode=mode, comp_index=comp, input_scale=input_scale,
                                    bias=None if bias is None else bias[lo:hi], check_inputs=False,
                                    comp_weight=self._comp_weight(layer, (lo, hi)),
                                    weight_layout=layer.quads_weight_layout))
        return torch.cat(outs, dim=-1)
