"""The names QUADS uses for precisions, activation scalings and quantization scopes (one vocabulary).

Every CLI flag, the recipe, the quantization plan and the rollout checkpoint's
``quantization_config`` spell these values; nothing else names them.  A precision describes
one GEMM, weights x activations: the trainer runs ``w4a16`` (AQAT: NVFP4 weights, BF16
activations) or the symmetric ``w4a4`` baseline, the rollout engine any of them, and
``w4a4_rac`` adds Residual Activation Compensation (the QUADS rollout); ``w16a4`` isolates the
activation error for the paper's ablation (local engine only).
"""

from __future__ import annotations

import enum


class Precision(str, enum.Enum):
    """Weight format x activation treatment of one GEMM."""

    BF16 = "bf16"          # high precision (the model dtype), nothing quantized
    W4A16 = "w4a16"        # NVFP4 weights, high-precision activations (AQAT trainer, weight-only rollout)
    W4A4 = "w4a4"          # NVFP4 weights and NVFP4 activations
    W4A4_RAC = "w4a4_rac"  # W4A4 + residual compensation of the k highest-error input channels
    # BF16 weights, NVFP4 activations: the activation error alone. A study precision of the local
    # engine (the paper's ablation); no checkpoint format or SGLang kernel exists for it.
    W16A4 = "w16a4"

    @property
    def quantizes_weights(self) -> bool:
        return self not in (Precision.BF16, Precision.W16A4)

    @property
    def quantizes_activations(self) -> bool:
        return self in (Precision.W4A4, Precision.W4A4_RAC, Precision.W16A4)

    @property
    def local_only(self) -> bool:
        """No checkpoint format or SGLang kernel exists: only the in-process local engine runs it."""
        return self is Precision.W16A4

    @property
    def uses_rac(self) -> bool:
        return self is Precision.W4A4_RAC

    def __str__(self) -> str:
        return self.value


# Other spellings accepted on command lines: the paper's names for the trainer and the rollout.
PRECISION_ALIASES = {"quads": Precision.W4A4_RAC, "aqat": Precision.W4A16}
# RAC compensates the rollout's online activation quantization; the trainer has no such GEMM.
TRAIN_PRECISIONS = (Precision.BF16, Precision.W4A16, Precision.W4A4)


class ActivationScaling(str, enum.Enum):
    """How a W4A4 GEMM scales its NVFP4 activations."""

    PER_TOKEN = "per_token"  # dynamic: one FP32 global scale per token (row)
    STATIC = "static"        # one calibrated per-tensor scale (ModelOpt's ``input_scale``)

    def __str__(self) -> str:
        return self.value


class Scope(str, enum.Enum):
    """Which weights of a Qwen3-MoE a recipe may quantize."""

    ROUTED_EXPERTS = "routed_experts"  # gate_proj / up_proj / down_proj of every routed expert
    ATTENTION = "attention"            # q_proj / k_proj / v_proj / o_proj

    def __str__(self) -> str:
        return self.value


def _parse(enum_cls, value, what: str, aliases=None):
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str):
        if aliases and value in aliases:
            return aliases[value]
        try:
            return enum_cls(value)
        except ValueError:
            pass
    names = [m.value for m in enum_cls] + sorted(aliases or ())
    raise ValueError(f"{what}: {value!r} is not one of {names}")


def parse_precision(value, what: str = "precision") -> Precision:
    """A Precision from its value or an alias (``quads``, ``aqat``); the error names ``what``."""
    return _parse(Precision, value, what, PRECISION_ALIASES)


def parse_scaling(value, what: str = "activation_scaling") -> ActivationScaling:
    return _parse(ActivationScaling, value, what)


def parse_scope(value, what: str = "scope") -> Scope:
    return _parse(Scope, value, what)


def precision_choices(train: bool = False) -> list:
    """argparse ``choices`` for a precision flag: the values plus their aliases."""
    values = [p.value for p in (TRAIN_PRECISIONS if train else Precision)]
    aliases = [a for a, p in PRECISION_ALIASES.items() if not train or p in TRAIN_PRECISIONS]
    return values + aliases
