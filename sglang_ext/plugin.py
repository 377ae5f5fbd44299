"""SGLang plugin entry point (`sglang.srt.plugins` group, name `quads`): registers `--quantization quads`.

SGLang's `load_plugins()` calls `register()` before parsing arguments and again in every
scheduler/detokenizer process it spawns; `SGLANG_PLUGINS=quads,...` allow-lists it.
"""

from __future__ import annotations

QUADS_LINEAR_METHOD = "QuadsLinearMethod"


def register() -> None:
    """Add `quads` to SGLang's quantization registry (first), CLI choices and v2 weight loaders.

    Idempotent. `quads` goes first in `QUANTIZATION_METHODS` because `ModelConfig` asks each
    method's `override_quantization_method` in order and ModelOpt's would otherwise turn
    `--quantization quads` over a ModelOpt NVFP4 checkpoint into `modelopt_fp4`.
    """
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES, add_quantization_method_choices
    from sglang.srt.layers import linear
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS

    from quads_megatron.plan.rollout_schema import QUANT_METHOD
    from .config import QuadsConfig

    others = [(k, v) for k, v in QUANTIZATION_METHODS.items() if k != QUANT_METHOD]
    QUANTIZATION_METHODS.clear()  # in place: model_config and loaders hold this very dict
    QUANTIZATION_METHODS[QUANT_METHOD] = QuadsConfig
    QUANTIZATION_METHODS.update(others)
    if QUANT_METHOD not in QUANTIZATION_CHOICES:
        add_quantization_method_choices([QUANT_METHOD])
    if QUADS_LINEAR_METHOD not in linear.WEIGHT_LOADER_V2_SUPPORTED:
        linear.WEIGHT_LOADER_V2_SUPPORTED.append(QUADS_LINEAR_METHOD)
