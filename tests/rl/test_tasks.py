"""Tasks and rewards: seeded synthetic sets, GSM8K-style answer matching, JSONL errors, char tokenizer."""

import json

import pytest

from quads_megatron.errors import InputError
from quads_megatron.rl.tasks import ArithmeticTask, JsonlTask, SortTask, answers_match, build_task
from quads_megatron.rl.tokenizer import build_char_tokenizer


def test_synthetic_seeded_and_eval_disjoint():
    t = ArithmeticTask(seed=3, digits=2)
    assert t.train_batch(8, seed=5) == ArithmeticTask(seed=3, digits=2).train_batch(8, seed=5)
    assert t.train_batch(8, seed=5) != t.train_batch(8, seed=6)
    evals = {s.prompt for s in t.eval_set()}
    assert len(evals) == 64 and not evals & {s.prompt for s in t.train_batch(2000, seed=1)}
    s = t.train_batch(1, seed=0)[0]
    a, b = map(int, s.prompt[:-1].split("+"))
    assert s.answer == str(a + b) and t.reward(f" {a + b} ", s) == 1.0 and t.reward(str(a + b + 1), s) == 0.0


def test_sort_task():
    s = SortTask(length=5).train_batch(1, seed=0)[0]
    assert s.answer == "".join(sorted(s.prompt[5:-1]))


@pytest.mark.parametrize("response,answer,ok", [
    ("so the total is 42.", "42", True), ("#### 1,234", "1234", True), ("\\boxed{7} then 9", "7", True),
    ("answer 41", "Natalia sold 48/2 = 24 clips.\n#### 42", False), ("it is 42", "steps...\n#### 42", True),
    ("no number", "3", False), ("3.50", "3.5", True),
])
def test_gsm8k_matching(response, answer, ok):
    assert answers_match(response, answer) is ok


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_loader(tmp_path):
    p = _write(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "answer": f"#### {i}"} for i in range(8)])
    t = JsonlTask(p)
    assert len(t.eval_set()) == 2 and len(t.samples) == 6
    assert t.reward("it is 7", t.eval_set()[-1]) == 1.0
    assert isinstance(build_task(str(p)), JsonlTask)


def test_jsonl_errors(tmp_path):
    with pytest.raises(ValueError, match=r"d.jsonl:2: missing field\(s\) \['answer'\]"):
        JsonlTask(_write(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}]))
    with pytest.raises(ValueError, match="is empty"):
        JsonlTask(_write(tmp_path / "e.jsonl", []))
    with pytest.raises(ValueError, match="e2.jsonl:1: not valid JSON"):
        JsonlTask(_write(tmp_path / "e2.jsonl", ["{nope"]))
    with pytest.raises(InputError, match="missing.jsonl"):
        JsonlTask(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="--task 'nonsense'"):
        build_task("nonsense")


def test_char_tokenizer_roundtrip(tmp_path):
    tok = build_char_tokenizer()
    ids = tok.encode("sort:3142=1234", add_special_tokens=False)
    assert len(ids) == 14 and tok.decode(ids) == "sort:3142=1234"
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.encode("12+3=", add_special_tokens=False) == tok.encode("12+3=", add_special_tokens=False)
    assert again.eos_token_id == tok.eos_token_id and again.pad_token_id == tok.pad_token_id
