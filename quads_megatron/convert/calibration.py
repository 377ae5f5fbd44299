"""Calibration prompts for the exporter: token ids from a prompt file (``load_prompts``) or seeded random tokens.

The calibration itself is the plan's (``quads_megatron.plan.calibration``), run on the rollout
model (``quads_megatron.rollout.RolloutModel``) by the exporter and the local engine alike.
"""

import json
from pathlib import Path

import torch

from quads_megatron.errors import CheckpointError, InputError


def load_prompts(path, tokenizer_dir, *, num_samples: int, seq_len: int, vocab_size: int | None = None) -> list:
    """Token id tensors from a .txt (one prompt per line) or .jsonl ("text"/"prompt" field) file, each cut to
    ``seq_len`` tokens.  InputError naming the file and line for an unreadable or binary file, no prompts,
    a prompt of no tokens, or a token id outside ``vocab_size`` (a tokenizer of another model)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"calibration data not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); expected .txt or .jsonl prompts") from None
    except OSError as e:
        raise InputError(f"{path}: unreadable ({e.strerror or e})") from None
    texts = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        if "\x00" in line:
            raise InputError(f"{path}:{i + 1}: holds NUL bytes (a binary file?); expected text prompts")
        if path.suffix == ".jsonl":
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{i + 1}: not JSON ({e})") from None
            text = row.get("text", row.get("prompt")) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise InputError(f"{path}:{i + 1}: expected a 'text' or 'prompt' string field")
            texts.append((i + 1, text))
        else:
            texts.append((i + 1, line))
        if len(texts) == num_samples:
            break
    if not texts:
        raise InputError(f"{path}: no calibration prompts (the file is empty or blank)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{tokenizer_dir}: cannot load a tokenizer for the calibration prompts ({e}); "
                              "pass --tokenizer-dir") from None
    prompts = []
    for lineno, text in texts:
        ids = torch.tensor(tok(text)["input_ids"][:seq_len], dtype=torch.long)
        if ids.numel() == 0:
            raise InputError(f"{path}:{lineno}: the prompt tokenizes to no tokens")
        if vocab_size is not None and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
            bad = int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())
            raise InputError(f"{path}:{lineno}: token id {bad} is outside the model's vocab_size={vocab_size} "
                             f"(the tokenizer in {tokenizer_dir} is not this model's)")
        prompts.append(ids)
    return prompts


def random_prompts(vocab_size: int, *, num_samples: int, seq_len: int, seed: int = 0) -> list:
    """Seeded random token sequences: the calibration set of tiny test models without a tokenizer."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (seq_len,), generator=g) for _ in range(num_samples)]
