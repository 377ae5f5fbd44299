"""The rollout engine interface the RL loop talks to (local in-process engine or SGLang over HTTP)."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Iterable

import torch


@dataclass
class SamplingParams:
    """Sampling settings of one generate call; log-probs are of softmax(logits / temperature).

    temperature 0 means greedy decoding (log-probs then of softmax(logits)), as in SGLang.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)

    def validate(self) -> None:
        """Raise ValueError on settings no engine can honour."""
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Rollout:
    """One generated response: token ids, the engine's log-prob of each, and whether a stop token ended it.

    routed_experts: the engine's own top-k expert ids, int32 [len(prompt_ids) + len(response_ids) - 1,
    num_layers, top_k] (row t: the token at position t as it was fed; SGLang's ``return_routed_experts``
    layout), or None when the engine cannot return them.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finished: bool
    routed_experts: torch.Tensor | None = None


class RolloutEngine(abc.ABC):
    """Generates responses with per-token log-probs and receives weights from the trainer."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Rollout]:
        """Return one Rollout per prompt (prompts repeated by the caller for G samples)."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], measure_error: bool = False) -> None:
        """Replace the served weights with (HF name, tensor) pairs from the trainer.

        measure_error: an engine that quantizes the weights itself also measures the NVFP4 error
        (an extra pass over them, so only when ``quant_error_report`` will be read).
        """

    def quant_error_report(self) -> dict[str, float]:
        """Per-layer NVFP4 relative errors of weights/activations, where the engine can measure them."""
        return {}

    def close(self) -> None:
        """Release resources (servers, threads)."""


def check_prompt_lengths(prompts: list[list[int]], max_new_tokens: int, max_seq_len: int) -> None:
    """Raise ValueError before any work if a prompt plus max_new_tokens cannot fit in max_seq_len."""
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty after tokenization")
        if len(p) + max_new_tokens > max_seq_len:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with --max-new-tokens {max_new_tokens} it exceeds "
                f"--seq-length {max_seq_len}: shorten the prompt or raise --seq-length")
