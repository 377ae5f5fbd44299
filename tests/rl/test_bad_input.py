"""Bad input fails before training starts, with an error naming what is wrong."""

import json

import pytest

from quads_megatron.rl.engines.sglang_http import SGLangEngine, SGLangError, parse_urls
from quads_megatron.rl.loop import main


def test_jsonl_missing_field(tiny_args, tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"prompt": "1+1="}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: missing field\(s\) \['answer'\]"):
        main(tiny_args("--task", str(p), "--train-iters", "1"))


def test_empty_dataset(tiny_args, tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl is empty"):
        main(tiny_args("--task", str(p), "--train-iters", "1"))


def test_prompt_longer_than_max_length(tiny_args):
    with pytest.raises(ValueError, match="exceeds --seq-length 8"):
        main(tiny_args("--train-iters", "1", "--seq-length", "8"))


def test_unreachable_sglang_url():
    with pytest.raises(SGLangError, match="http://127.0.0.1:9 is unreachable"):
        SGLangEngine(parse_urls(["http://127.0.0.1:9"]), max_seq_len=32)
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        parse_urls(["localhost:30000"])
