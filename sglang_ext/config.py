"""`QuadsConfig`: SGLang's `--quantization quads` (NVFP4 weights, W4A4 + RAC activations).

Reads a QUADS checkpoint's `quantization_config` (or a plain ModelOpt NVFP4 one; schema in
`quads_megatron.plan.rollout_schema`) and hands out `QuadsLinearMethod` / `QuadsMoEMethod`.
Exclusion patterns follow ModelOpt's rules (it subclasses SGLang's `ModelOptQuantConfig`).

`from_config` is where SGLang hands the checkpoint to the method: a bad field is a
`CheckpointError` naming the file and field, and when SGLang passes the model's `hf_config`
(the config.json path, which QUADS exports use) and the model directory holds
`quads_manifest.json`, every file is verified against it once, before any layer is built; a
weight or index file it does not list, or one that resolves outside the directory, is refused,
and a checkpoint our exporter wrote (``producer``) whose manifest is missing is refused.
With metadata only in hf_quant_config.json SGLang passes no model path, so no manifest check.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional

import torch

from sglang.srt.layers.quantization.base_config import QuantizeMethodBase
from sglang.srt.layers.quantization.modelopt_quant import ModelOptQuantConfig
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.layers.quantization.utils import is_layer_skipped

from quads_megatron.integrity import MANIFEST, PRODUCER, check_loader_reads, require_manifest, verify_manifest
from quads_megatron.plan.rollout_schema import (QUANT_METHOD, RolloutQuantConfig, check_server_quantization,
                                                parse_quantization_config)

logger = logging.getLogger(__name__)


def _model_dir(hf_config) -> Optional[str]:
    """The local checkpoint directory SGLang read `hf_config` from (None for a hub id or no config)."""
    path = getattr(hf_config, "_name_or_path", None) or getattr(hf_config, "name_or_path", None)
    return path if isinstance(path, str) and os.path.isdir(path) else None


class QuadsConfig(ModelOptQuantConfig):
    """The `quads` quantization method: ModelOpt NVFP4 tensors served by QUADS' W4A4 kernels."""

    def __init__(self, rollout: RolloutQuantConfig,
                 packed_modules_mapping: Optional[Dict[str, List[str]]] = None):
        super().__init__(kv_cache_quant_algo=None, exclude_modules=list(rollout.exclude_modules),
                         packed_modules_mapping=packed_modules_mapping or {})
        self.rollout = rollout

    # --- identity --------------------------------------------------------------------
    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> List[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        """Hopper: the Triton W4A4 path dequantizes NVFP4 tiles to BF16 tensor-core MMA."""
        return 90

    # --- construction ----------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "QuadsConfig":
        """From config.json's `quantization_config` or hf_quant_config.json (SGLang adds keys)."""
        config = dict(config)
        packed = config.pop("packed_modules_mapping", None) or {}
        model_dir = _model_dir(config.pop("hf_config", None))
        config.pop("requantization_method", None)
        if model_dir is None:
            origin = "hf_quant_config.json"
        else:
            origin = f"{os.path.join(model_dir, 'config.json')} quantization_config"
        producer = config.get("producer")
        rollout = parse_quantization_config(config, origin=origin)
        if model_dir is not None:
            check_loader_reads(model_dir)
            if verify_manifest(model_dir):
                logger.info("quads: %s verified against %s", model_dir, MANIFEST)
            elif isinstance(producer, dict) and producer.get("name") == PRODUCER:
                require_manifest(model_dir, f"{origin}.producer")
        logger.info("quads: %s", rollout.to_dict())
        return cls(rollout, packed)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant) -> Optional[str]:
        """The checkpoint decides; `--quantization` may only agree with it (`check_server_quantization`).

        `quads` for a QUADS checkpoint, and for a ModelOpt NVFP4 one under `--quantization quads`;
        a flag that disagrees with the checkpoint is a ConfigError naming both. SGLang asks every
        registered config in order and the first answer wins; the plugin registers `quads` first so
        ModelOpt's override cannot turn `--quantization quads` into `modelopt_fp4`. Without
        `--quantization quads` a ModelOpt checkpoint stays ModelOpt.
        """
        if not hf_quant_cfg:
            return None
        return check_server_quantization(hf_quant_cfg, user_quant, origin="the checkpoint's quantization config")

    # --- per-layer methods -----------------------------------------------------------
    def is_excluded(self, prefix: str) -> bool:
        """True when the module at `prefix` stays in the model dtype (ModelOpt pattern rules)."""
        return (is_layer_skipped(prefix, self.exclude_modules, self.packed_modules_mapping)
                or self.is_layer_excluded(prefix))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str
                         ) -> Optional[QuantizeMethodBase]:
        from sglang.srt.layers.linear import LinearBase
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
        from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

        from .linear_method import QuadsLinearMethod
        from .moe_method import QuadsMoEMethod

        if isinstance(layer, (LinearBase, ParallelLMHead)):
            if self.is_excluded(prefix):
                return UnquantizedLinearMethod()
            return QuadsLinearMethod(self, prefix)
        if isinstance(layer, FusedMoE):
            if self.is_layer_excluded(prefix):
                return None
            return QuadsMoEMethod(self, prefix)
        return None
