"""Turn prompts/rollouts into padded token tensors aligned with the trainer's next-token log-probs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .engines.base import Rollout


@dataclass
class TrainBatch:
    """tokens [N, S]; mask/rollout_logp [N, S-1] where index t scores tokens[:, t+1]; advantages [N].

    routes: the rollout's top-k expert ids int32 [N, S, L, K] (row t: token t), or None when the engine
    returned none. Rows the rollout never fed (the last response token, padding) hold experts 0..K-1;
    they influence no scored position (causal attention). They stay on the host; the policy moves each
    micro-batch's.
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    rollout_logp: torch.Tensor
    advantages: torch.Tensor
    routes: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def to(self, device) -> "TrainBatch":
        return TrainBatch(self.tokens.to(device), self.mask.to(device), self.rollout_logp.to(device),
                          self.advantages.to(device), self.routes)

    def slice(self, i: int, j: int) -> "TrainBatch":
        return TrainBatch(self.tokens[i:j], self.mask[i:j], self.rollout_logp[i:j], self.advantages[i:j],
                          None if self.routes is None else self.routes[i:j])


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompt token ids, prefixed with BOS when the tokenizer has one."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    return ids


def decode_response(tokenizer, ids: list[int]) -> str:
    """Response text without special tokens; ids outside the tokenizer (padded vocab) are dropped."""
    n = len(tokenizer)
    return tokenizer.decode([i for i in ids if 0 <= i < n], skip_special_tokens=True)


def build_train_batch(rollouts: list[Rollout], advantages: torch.Tensor, pad_id: int) -> TrainBatch:
    """Right-padded [prompt; response] sequences with the response mask in log-prob index space, and the
    rollout's routed experts when every rollout carries them."""
    S = max(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
    N = len(rollouts)
    tokens = torch.full((N, S), pad_id, dtype=torch.long)
    mask = torch.zeros((N, S - 1), dtype=torch.float32)
    rlp = torch.zeros((N, S - 1), dtype=torch.float32)
    routes = _routes(rollouts, S)
    for i, r in enumerate(rollouts):
        if len(r.logprobs) != len(r.response_ids):
            raise ValueError(f"rollout {i}: {len(r.response_ids)} response tokens but {len(r.logprobs)} log-probs")
        p, n = len(r.prompt_ids), len(r.response_ids)
        tokens[i, :p] = torch.tensor(r.prompt_ids)
        if n:
            tokens[i, p:p + n] = torch.tensor(r.response_ids)
            mask[i, p - 1:p - 1 + n] = 1.0
            rlp[i, p - 1:p - 1 + n] = torch.tensor(r.logprobs, dtype=torch.float32)
    return TrainBatch(tokens, mask, rlp, advantages.float(), routes)


def _routes(rollouts: list[Rollout], S: int) -> torch.Tensor | None:
    """[N, S, L, K] int32 of the rollouts' routed_experts, filler 0..K-1 where none was fed; None if any lacks them."""
    if not rollouts or any(r.routed_experts is None for r in rollouts):
        return None
    _, L, K = rollouts[0].routed_experts.shape
    routes = torch.arange(K, dtype=torch.int32).expand(len(rollouts), S, L, K).clone()
    for i, r in enumerate(rollouts):
        rows = len(r.prompt_ids) + len(r.response_ids) - 1
        if tuple(r.routed_experts.shape) != (rows, L, K):
            raise ValueError(f"rollout {i}: routed_experts of shape {tuple(r.routed_experts.shape)}, expected "
                             f"({rows}, {L}, {K}) (prompt + response - 1 fed tokens, layers, top-k)")
        routes[i, :rows] = r.routed_experts
    return routes


def build_sft_batch(prompts: list[list[int]], targets: list[list[int]], pad_id: int):
    """(tokens [N, S], mask [N, S-1]) for teacher forcing: loss on the target tokens only."""
    S = max(len(p) + len(t) for p, t in zip(prompts, targets))
    tokens = torch.full((len(prompts), S), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), S - 1))
    for i, (p, t) in enumerate(zip(prompts, targets)):
        tokens[i, :len(p) + len(t)] = torch.tensor(p + t)
        mask[i, len(p) - 1:len(p) - 1 + len(t)] = 1.0
    return tokens, mask
