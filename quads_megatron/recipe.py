"""QuadsRecipe: what the user asks QUADS to quantize and how (one serialisable dataclass).

The recipe is the request; ``quads_megatron.plan.QuantPlan`` resolves it against one model's
dimensions and parallel layout, and every consumer (trainer, export, weight sync, rollout
engines, SGLang) reads the plan, never the recipe's fields directly.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Tuple

from quads_megatron import vocab
from quads_megatron.vocab import ActivationScaling, Precision, Scope

WEIGHT_FORMATS = ("nvfp4",)
BLOCK_SHAPES = ((1, 16), (16, 16))
BACKENDS = ("torch", "te")
RECIPE_VERSION = 2


@dataclass(frozen=True)
class QuadsRecipe:
    """Which weights are NVFP4, in the trainer and in the rollout engine, and how."""

    weight_format: str = "nvfp4"
    # (1, 16): per-row 16-element blocks, the rollout checkpoint layout (ModelOpt / SGLang);
    # (16, 16): TE-style 2D weight tiles (stored with the same per-row scale layout).
    block_shape: Tuple[int, int] = (1, 16)
    # Trainer GEMMs of the quantized weights: w4a16 is Asymmetric QAT (the QUADS trainer),
    # w4a4 the symmetric baseline, bf16 no quantization (a plain BF16 trainer).
    train_precision: Precision = Precision.W4A16
    # Rollout GEMMs of the quantized weights (w4a4_rac is the QUADS rollout).
    rollout_precision: Precision = Precision.W4A4_RAC
    activation_scaling: ActivationScaling = ActivationScaling.PER_TOKEN
    # RAC compensation channels per GEMM (a multiple of 16; used by w4a4_rac).
    rac_channels: int = 16
    scope: Tuple[Scope, ...] = (Scope.ROUTED_EXPERTS,)
    # BF16 carve-outs: the first / last N transformer layers, and fnmatch patterns on HF
    # module names (e.g. "model.layers.3.mlp.experts.*", "model.layers.*.self_attn.o_proj").
    bf16_first_layers: int = 0
    bf16_last_layers: int = 0
    bf16_patterns: Tuple[str, ...] = ()
    # torch: quads_megatron.nvfp4; te: Transformer Engine's NVFP4 quantizer (1D/2D, no RHT, no SR).
    backend: str = "torch"
    # Keep the fake-quantized weight until the master weight changes (optimizer step).
    cache_weights: bool = True
    version: int = RECIPE_VERSION

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if self.version != RECIPE_VERSION:
            raise ValueError(f"QuadsRecipe.version={self.version!r}; this code reads version "
                             f"{RECIPE_VERSION} (re-create the recipe with its current fields)")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"QuadsRecipe.weight_format={self.weight_format!r} is not one of "
                             f"{list(WEIGHT_FORMATS)}")
        try:
            set_("block_shape", tuple(int(b) for b in self.block_shape))
        except (TypeError, ValueError):
            raise ValueError(f"QuadsRecipe.block_shape={self.block_shape!r}: expected two ints") from None
        if self.block_shape not in BLOCK_SHAPES:
            raise ValueError(f"QuadsRecipe.block_shape={self.block_shape!r} is not one of "
                             f"{list(BLOCK_SHAPES)}")
        train = vocab.parse_precision(self.train_precision, "QuadsRecipe.train_precision")
        if train not in vocab.TRAIN_PRECISIONS:
            raise ValueError(f"QuadsRecipe.train_precision={train.value!r}: the trainer runs one of "
                             f"{[p.value for p in vocab.TRAIN_PRECISIONS]} (RAC is rollout-only)")
        set_("train_precision", train)
        set_("rollout_precision", vocab.parse_precision(self.rollout_precision,
                                                        "QuadsRecipe.rollout_precision"))
        set_("activation_scaling", vocab.parse_scaling(self.activation_scaling,
                                                       "QuadsRecipe.activation_scaling"))
        k = self.rac_channels
        if not isinstance(k, int) or isinstance(k, bool) or k < 0 or k % 16:
            raise ValueError(f"QuadsRecipe.rac_channels={k!r}: expected a multiple of 16 >= 0")
        if self.rollout_precision.uses_rac and k == 0:
            raise ValueError("QuadsRecipe: rollout_precision 'w4a4_rac' needs rac_channels > 0")
        for name in ("scope", "bf16_patterns"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise ValueError(f"QuadsRecipe.{name} must be a list of strings, got the string "
                                 f"{value!r}")
        if not self.scope:
            raise ValueError(f"QuadsRecipe.scope is empty; expected some of {[s.value for s in Scope]}")
        set_("scope", tuple(vocab.parse_scope(s, "QuadsRecipe.scope") for s in self.scope))
        set_("bf16_patterns", tuple(self.bf16_patterns))
        for name in ("bf16_first_layers", "bf16_last_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"QuadsRecipe.{name} must be an int >= 0, got {value!r}")
        for p in self.bf16_patterns:
            if not isinstance(p, str) or not p:
                raise ValueError(f"QuadsRecipe.bf16_patterns entries must be non-empty strings, "
                                 f"got {p!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"QuadsRecipe.backend={self.backend!r} is not one of {list(BACKENDS)}")

    def replace(self, **changes) -> "QuadsRecipe":
        """A copy with some fields changed (how CLI flags override a recipe file)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict:
        """Plain JSON-able dict (tuples as lists, enums as their values)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, tuple):
                v = [x.value if isinstance(x, Scope) else x for x in v]
            elif isinstance(v, (Precision, ActivationScaling)):
                v = v.value
            out[f.name] = v
        return out

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

    @classmethod
    def from_file(cls, path) -> "QuadsRecipe":
        """Read a recipe JSON file; ConfigError naming the file for a missing, unreadable or invalid one."""
        from quads_megatron.errors import ConfigError

        try:
            text = open(path, encoding="utf-8").read()
        except FileNotFoundError:
            raise ConfigError(f"recipe file {path}: does not exist") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"recipe file {path}: unreadable ({e})") from None
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"recipe file {path}:{e.lineno}: not valid JSON ({e.msg})") from None
        try:
            return cls.from_dict(doc)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"recipe file {path}: {e}") from None


# ---------------------------------------------------------------- the one CLI spelling of a recipe

def add_recipe_args(parser, *, train: bool = True, rollout_choices=None, scope: bool = True,
                    recipe_help: str = "QuadsRecipe JSON file (default recipe otherwise)") -> None:
    """``--quads-recipe FILE`` and the flags that override its fields, each spelled as its field:
    ``--train-precision`` (``train=True``), ``--rollout-precision``, ``--activation-scaling``,
    ``--rac-channels`` and ``--quads-scope`` (``scope=True``); every default None = the recipe's."""
    parser.add_argument("--quads-recipe", default=None, help=recipe_help)
    if train:
        parser.add_argument("--train-precision", choices=vocab.precision_choices(train=True), default=None,
                            help="trainer precision of the quantized weights: bf16, aqat (= w4a16: NVFP4 "
                                 "fake-quantized weights, BF16 activations; the default) or the symmetric w4a4 baseline")
    parser.add_argument("--rollout-precision", choices=rollout_choices or vocab.precision_choices(), default=None,
                        help="rollout GEMMs: bf16, w4a16 (NVFP4 weights only), w4a4, w4a4_rac (= quads: W4A4 + RAC; "
                             "the default)")
    parser.add_argument("--activation-scaling", choices=[s.value for s in ActivationScaling], default=None,
                        help="W4A4 activation scales (default: the recipe's, per_token)")
    parser.add_argument("--rac-channels", type=int, default=None,
                        help="RAC compensation channels per GEMM (multiple of 16; default: the recipe's, 16)")
    if scope:
        parser.add_argument("--quads-scope", nargs="+", choices=[s.value for s in Scope], default=None,
                            help="weights to quantize in trainer and rollout alike (default: the recipe's, "
                                 "routed_experts)")


def recipe_from_args(args, *, base: "QuadsRecipe | None" = None, default_file=None) -> "QuadsRecipe":
    """The recipe a command line asks for: ``--quads-recipe`` (else ``base``, else ``default_file`` when it
    exists, else ``QuadsRecipe()``) with the flags of ``add_recipe_args`` that were given applied.
    A missing or invalid file or a flag the recipe refuses is a ConfigError naming it."""
    import os

    from quads_megatron.errors import ConfigError

    path = getattr(args, "quads_recipe", None)
    if path is None and base is None and default_file is not None and os.path.isfile(default_file):
        path = default_file
    recipe = QuadsRecipe.from_file(path) if path is not None else (base if base is not None else QuadsRecipe())
    flags = {"train_precision": "--train-precision", "rollout_precision": "--rollout-precision"}
    changes = {}
    try:
        for field, flag in flags.items():
            value = getattr(args, field, None)
            changes[field] = value and vocab.parse_precision(value, flag)
        scope = getattr(args, "quads_scope", None)
        return recipe.replace(**changes, activation_scaling=getattr(args, "activation_scaling", None),
                              rac_channels=getattr(args, "rac_channels", None),
                              scope=tuple(scope) if scope else None)
    except ValueError as e:
        where = f"{path} with the precision flags" if path is not None else "precision flags"
        raise ConfigError(f"{where}: {e}") from None
