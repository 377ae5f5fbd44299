"""Character-level tokenizer for the tiny default model, built with `tokenizers`, saved like any HF tokenizer."""

from __future__ import annotations

import string
from pathlib import Path

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIALS = [PAD, EOS, BOS, UNK]
CHARS = [c for c in string.printable if c not in "\x0b\x0c\r\t"]  # printable ASCII + space + newline


def build_char_tokenizer():
    """Return a PreTrainedTokenizerFast with one token per printable character plus pad/eos/bos/unk."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=BOS, unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(path: str | Path | None):
    """Load an HF tokenizer from path (a checkpoint or tokenizer dir), or build the char tokenizer if None."""
    if path is None:
        return build_char_tokenizer()
    from transformers import AutoTokenizer

    from quads_megatron.errors import ConfigError

    path = Path(path)
    if not path.exists():
        raise ConfigError(f"tokenizer {path}: no such directory")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError, KeyError) as e:   # no tokenizer files, unreadable or malformed ones
        text = str(e).strip().splitlines()
        raise ConfigError(f"tokenizer {path}: cannot be loaded ({type(e).__name__}: {text[0][:200] if text else ''})") \
            from None
    if tok.eos_token_id is None:
        raise ConfigError(f"tokenizer {path}: has no eos_token (generation needs a stop token)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
