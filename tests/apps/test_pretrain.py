"""quads-pretrain: the preset learns the text, and the HF checkpoint it writes scores that text the same in transformers."""

import json
import math

import pytest
import torch

from quads_megatron.errors import ConfigError, InputError
from quads_megatron.apps import pretrain


def _corpus(tmp_path):
    lines = [f"def f{i}(x):\n    return x * {i % 7} + {i % 5}\n" for i in range(400)]
    p = tmp_path / "corpus.txt"
    p.write_text("".join(lines))
    return p


def test_pretrain_learns_and_saves_an_hf_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    save = tmp_path / "hf"
    out = pretrain.main(["--preset", "tiny", "--data-path", str(_corpus(tmp_path)), "--train-iters", "80",
                         "--micro-batch-size", "16", "--seq-length", "48", "--lr", "3e-3", "--lr-warmup-iters", "5",
                         "--save", str(save), "--no-progress"])
    assert out["val_loss"] < 0.6 * math.log(100), out  # far below a uniform guess over the 100 characters
    cfg = json.loads((save / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["vocab_size"] == 256  # the tiny preset's rows
    tok = AutoTokenizer.from_pretrained(save)
    model = AutoModelForCausalLM.from_pretrained(save, dtype=torch.float32).eval()
    text = "def f3(x):\n    return x * 3 + 3\n" * 2
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        hf_loss = model(input_ids=ids, labels=ids).loss.item()  # transformers' own loss
    assert hf_loss < 0.6 * math.log(100), hf_loss


def test_corpus_is_read_and_encoded_by_character(tmp_path):
    from quads_megatron.rl.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    ids = pretrain.encode_corpus("ab\u00e9c\n", tok)  # é is outside the alphabet: dropped
    assert ids.tolist() == tok.encode("abc\n", add_special_tokens=False)
    assert len(pretrain.read_corpus(None, 200_000)) == 200_000  # the stdlib is always there


@pytest.mark.parametrize("argv, err, match", [
    (["--train-iters", "0"], ConfigError, "--train-iters"),
    (["--lr", "1e-3", "--min-lr", "1e-2"], ConfigError, "--min-lr"),
])
def test_bad_flags_are_named(tmp_path, argv, err, match):
    with pytest.raises(err, match=match):
        pretrain.parse_args(argv + ["--save", str(tmp_path / "x")])


def test_tiny_corpus_is_refused(tmp_path):
    p = tmp_path / "small.txt"
    p.write_text("x = 1\n")
    with pytest.raises(InputError, match="small.txt"):
        pretrain.read_corpus(p)
