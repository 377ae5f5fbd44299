"""Turn prompts/rollouts into padded token tensors aligned with the trainer's next-token log-probs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .engines.base import Rollout


@dataclass
class TrainBatch:
    """tokens [N, S]; mask/rollout_logp [N, S-1] where index t scores tokens[:, t+1]; advantages [N]."""

    tokens: torch.Tensor
    mask: torch.Tensor
    rollout_logp: torch.Tensor
    advantages: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def to(self, device) -> "TrainBatch":
        return TrainBatch(self.tokens.to(device), self.mask.to(device), self.rollout_logp.to(device),
                          self.advantages.to(device))

    def slice(self, i: int, j: int) -> "TrainBatch":
        return TrainBatch(self.tokens[i:j], self.mask[i:j], self.rollout_logp[i:j], self.advantages[i:j])


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
    """Right-padded [prompt; response] sequences with the response mask in log-prob index space."""
    S = max(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
    N = len(rollouts)
    tokens = torch.full((N, S), pad_id, dtype=torch.long)
    mask = torch.zeros((N, S - 1), dtype=torch.float32)
    rlp = torch.zeros((N, S - 1), dtype=torch.float32)
    for i, r in enumerate(rollouts):
        if len(r.logprobs) != len(r.response_ids):
            raise ValueError(f"rollout {i}: {len(r.response_ids)} response tokens but {len(r.logprobs)} log-probs")
        p, n = len(r.prompt_ids), len(r.response_ids)
        tokens[i, :p] = torch.tensor(r.prompt_ids)
        if n:
            tokens[i, p:p + n] = torch.tensor(r.response_ids)
            mask[i, p - 1:p - 1 + n] = 1.0
            rlp[i, p - 1:p - 1 + n] = torch.tensor(r.logprobs, dtype=torch.float32)
    return TrainBatch(tokens, mask, rlp, advantages.float())


def build_sft_batch(prompts: list[list[int]], targets: list[list[int]], pad_id: int):
    """(tokens [N, S], mask [N, S-1]) for teacher forcing: loss on the target tokens only."""
    S = max(len(p) + len(t) for p, t in zip(prompts, targets))
    tokens = torch.full((len(prompts), S), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), S - 1))
    for i, (p, t) in enumerate(zip(prompts, targets)):
        tokens[i, :len(p) + len(t)] = torch.tensor(p + t)
        mask[i, len(p) - 1:len(p) - 1 + len(t)] = 1.0
    return tokens, mask
