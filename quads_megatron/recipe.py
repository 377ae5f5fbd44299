"""QuadsRecipe: the one description of what QUADS quantizes, read by the trainer, converters and rollout side."""

import dataclasses
import json
from dataclasses import dataclass
from typing import Tuple

WEIGHT_FORMATS = ("nvfp4",)
BLOCK_SHAPES = ((1, 16), (16, 16))
# bf16: QUADS asymmetric QAT (weights fake-quantized, activations BF16);
# nvfp4: symmetric fake quant of the expert inputs too (the naive baseline the paper ablates).
ACTIVATION_MODES = ("bf16", "nvfp4")
# How the rollout side scales activations for W4A4 (per-token dynamic, or a static per-tensor
# input_scale from calibration); the trainer's nvfp4 activation mode mirrors it.
ACTIVATION_SCALINGS = ("per_token", "per_tensor")
SCOPES = ("routed_experts", "shared_experts", "dense_mlp", "attention")
BACKENDS = ("torch", "te")
RECIPE_VERSION = 1


def _choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"QuadsRecipe.{name}={value!r} is not one of {list(allowed)}")


@dataclass(frozen=True)
class QuadsRecipe:
    """Which modules are fake-quantized to NVFP4 and how (serialisable to JSON / checkpoints)."""

    weight_format: str = "nvfp4"
    # (1, 16): per-row 16-element blocks, the rollout checkpoint layout (ModelOpt / SGLang);
    # (16, 16): TE-style 2D weight tiles.
    block_shape: Tuple[int, int] = (1, 16)
    activation_mode: str = "bf16"
    activation_scaling: str = "per_token"
    scope: Tuple[str, ...] = ("routed_experts",)
    # BF16 carve-outs: the first / last N transformer layers, and fnmatch patterns on module
    # names relative to the GPTModel (e.g. "decoder.layers.3.mlp.*").
    bf16_first_layers: int = 0
    bf16_last_layers: int = 0
    bf16_patterns: Tuple[str, ...] = ()
    # torch: quads_megatron.nvfp4; te: Transformer Engine's NVFP4 quantizer (1D/2D, no RHT, no SR).
    backend: str = "torch"
    # Keep the fake-quantized weight until the master weight changes (optimizer step).
    cache_weights: bool = True
    version: int = RECIPE_VERSION

    def __post_init__(self):
        object.__setattr__(self, "block_shape", tuple(int(b) for b in self.block_shape))
        for name in ("scope", "bf16_patterns"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise ValueError(f"QuadsRecipe.{name} must be a list of strings, got the string "
                                 f"{value!r}")
            object.__setattr__(self, name, tuple(value))
        _choice("weight_format", self.weight_format, WEIGHT_FORMATS)
        _choice("block_shape", self.block_shape, BLOCK_SHAPES)
        _choice("activation_mode", self.activation_mode, ACTIVATION_MODES)
        _choice("activation_scaling", self.activation_scaling, ACTIVATION_SCALINGS)
        _choice("backend", self.backend, BACKENDS)
        if not self.scope:
            raise ValueError(f"QuadsRecipe.scope is empty; expected some of {list(SCOPES)}")
        for s in self.scope:
            _choice("scope", s, SCOPES)
        for name in ("bf16_first_layers", "bf16_last_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"QuadsRecipe.{name} must be an int >= 0, got {value!r}")
        for p in self.bf16_patterns:
            if not isinstance(p, str) or not p:
                raise ValueError(f"QuadsRecipe.bf16_patterns entries must be non-empty strings, "
                                 f"got {p!r}")
        if self.version != RECIPE_VERSION:
            raise ValueError(f"QuadsRecipe.version={self.version!r}; this code reads version "
                             f"{RECIPE_VERSION}")

    def to_dict(self) -> dict:
        """Plain JSON-able dict (tuples as lists)."""
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "QuadsRecipe":
        """Inverse of to_dict; unknown keys are an error (a typo must not pass silently)."""
        if not isinstance(d, dict):
            raise ValueError(f"QuadsRecipe.from_dict expects a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"QuadsRecipe: unknown keys {unknown}; known keys are {sorted(known)}")
        return cls(**d)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, **kwargs)

    @classmethod
    def from_json(cls, text: str) -> "QuadsRecipe":
        return cls.from_dict(json.loads(text))

    @property
    def quantize_activations(self) -> bool:
        return self.activation_mode == "nvfp4"
