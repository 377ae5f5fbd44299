"""The GRPO job as a user meets it: every bad flag, file or checkpoint is one line and exit code 2, before any
model is built; NaN/Inf stops the loop before it saves over the last good checkpoint; signals end with one
line and no half-written iteration; killing the launcher's process group leaves no trainer behind."""

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quads_megatron.errors import CheckpointError, ConfigError, NonFiniteError, run_cli
from quads_megatron.integrity import verify_manifest
from quads_megatron.megatron import checkpoint as mckpt
from quads_megatron.rl.arguments import parse_args
from quads_megatron.rl.loop import PROG, GRPOTrainer, run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rl"))
from tiny_flags import TINY  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
           PYTHONWARNINGS="ignore", TORCHDYNAMO_DISABLE="1")


def _flags(tmp_path, *extra):
    return TINY + ["--tensorboard-dir", str(tmp_path / "tb")] + list(extra)


def _prog_line(capsys) -> str:
    """The one line of this program on stderr (libraries may log their own warnings there), no traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"{PROG}:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"{PROG}: error: "), err
    return err


# ------------------------------------------------------------------ flags: refused in parse_args, before any model

def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


FLAG_CASES = {
    # name: (argv extra, words the one line must contain); the values are the issue's
    "kl-coef-nan": (["--kl-coef", "nan"], ["--kl-coef", "nan", "finite"]),
    "kl-coef-inf": (["--kl-coef", "inf"], ["--kl-coef", "inf", "finite"]),
    "eps-clip-negative": (["--eps-clip", "-1"], ["--eps-clip", "-1", "> 0"]),
    "eps-clip-1": (["--eps-clip", "1"], ["--eps-clip", "< 1"]),
    "eps-clip-high-negative": (["--eps-clip-high", "-1"], ["--eps-clip-high", "-1"]),
    "mis-inverted": (["--mis-low", "2", "--mis-high", "0.5"], ["--mis-low 2.0", "--mis-high 0.5", "below"]),
    "group-size-1": (["--n-samples-per-prompt", "1"], ["--n-samples-per-prompt 1", ">= 2", "group"]),
    "sglang-url-without-engine": (["--sglang-url", "http://127.0.0.1:9"], ["--sglang-url", "--rollout-engine sglang"]),
    "w16a4-with-sglang": (["--rollout-engine", "sglang", "--sglang-url", "http://127.0.0.1:9", "--rollout-precision",
                           "w16a4"], ["--rollout-precision w16a4", "local engine only"]),
    "sglang-router-without-engine": (["--sglang-router-url", "http://127.0.0.1:9"], ["--sglang-router-url"]),
    "rac-channels-above-K": (["--rac-channels", "128"], ["rac_channels=128", "exceeds the 64 input channels"]),
    "rac-channels-not-16x": (["--rac-channels", "24"], ["rac_channels=24", "multiple of 16"]),
    "log-interval-0": (["--log-interval", "0"], ["--log-interval 0", ">= 1"]),
    "num-layers-0": (["--num-layers", "0"], ["--num-layers 0", ">= 1"]),
    "topk-above-preset-experts": (["--moe-router-topk", "10"], ["--moe-router-topk 10", "4", "--preset tiny"]),
    "topk-above-num-experts": (["--moe-router-topk", "3", "--num-experts", "2"], ["--moe-router-topk 3", "(2"]),
    "lr-negative": (["--lr", "-1"], ["--lr -1", ">= 0"]),
    "lr-not-a-number": (["--lr", "abc"], ["--lr", "'abc'"]),
    "top-p-2": (["--top-p", "2"], ["--top-p 2", "<= 1"]),
    "top-p-0": (["--top-p", "0"], ["--top-p 0", "(0, 1]"]),
    "temperature-negative": (["--temperature", "-1"], ["--temperature -1", ">= 0"]),
    "adam-beta-1": (["--adam-beta1", "1"], ["--adam-beta1 1", "< 1"]),
    "tp-0": (["--tensor-model-parallel-size", "0"], ["--tensor-model-parallel-size 0", ">= 1"]),
    "ep-not-dividing-experts": (["--expert-model-parallel-size", "3"], ["--expert-model-parallel-size 3", "4 experts"]),
    "unknown-preset": (["--preset", "nope"], ["--preset nope", "tiny"]),
    "recipe-missing": (["--quads-recipe", "{tmp}/nonexistent.json"], ["nonexistent.json", "does not exist"]),
    "recipe-not-json": (["--quads-recipe", "{tmp}/bad.json"], ["bad.json:1", "not valid JSON"]),
    "recipe-unknown-key": (["--quads-recipe", "{tmp}/typo.json"], ["typo.json", "unknown keys", "rac_chanels"]),
    "hf-checkpoint-missing": (["--hf-checkpoint", "{tmp}/nonexistent"], ["--hf-checkpoint", "no such checkpoint"]),
    "hf-checkpoint-without-config": (["--hf-checkpoint", "{tmp}"], ["--hf-checkpoint", "no config.json"]),
    "tokenizer-missing": (["--tokenizer", "{tmp}/nonexistent"], ["--tokenizer", "no such tokenizer"]),
    "save-interval-without-save": (["--save-interval", "2"], ["--save-interval needs --save"]),
    "save-interval-negative": (["--save", "{tmp}/ck", "--save-interval", "-1"], ["--save-interval -1", ">= 0"]),
    "resume-without-save": (["--resume"], ["--resume needs --save"]),
    "force-without-save": (["--force"], ["--force needs --save"]),
    "load-missing": (["--load", "{tmp}/mistyped", "--save", "{tmp}/ck"], ["--load", "mistyped", "no such checkpoint"]),
    "load-without-checkpoint": (["--load", "{tmp}", "--save", "{tmp}/ck"], ["--load", "holds no checkpoint"]),
    "resume-with-mistyped-load": (["--resume", "--save", "{tmp}/ck", "--load", "{tmp}/mistyped"], ["mistyped"]),
    "save-is-a-file": (["--save", "{tmp}/bad.json"], ["--save", "not a directory"]),
    "task-bad-spec": (["--task", "sort:abc"], ["--task 'sort:abc'", "integer"]),
    "task-unknown": (["--task", "nonsense"], ["--task 'nonsense'"]),
    "task-jsonl-missing": (["--task", "{tmp}/missing.jsonl"], ["missing.jsonl", "does not exist"]),
    "eval-data-with-synthetic-task": (["--eval-data", "{tmp}/typo.json"], ["--eval-data", "JSONL tasks"]),
}


@pytest.mark.parametrize("case", list(FLAG_CASES))
def test_bad_flag_is_one_line_exit_2_before_any_model(case, tmp_path, capsys):
    _write(tmp_path / "bad.json", "{nope")
    _write(tmp_path / "typo.json", json.dumps({"rac_chanels": 32}))
    extra, words = FLAG_CASES[case]
    argv = _flags(tmp_path, *[a.replace("{tmp}", str(tmp_path)) for a in extra])
    before = sorted(p.name for p in tmp_path.iterdir())
    t0 = time.perf_counter()
    assert run_cli(parse_args, argv, prog=PROG) == 2  # parse_args alone refuses it: nothing was built
    assert time.perf_counter() - t0 < 15
    err = _one_line(capsys)
    for w in words:
        assert w in err, (w, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written (no tb/, no ck/)


def test_rac_channels_refused_by_training_and_export_with_the_plans_message(tmp_path):
    """The GRPO flags and the rollout exporter resolve the same QuantPlan, so they refuse with the same words."""
    from quads_megatron.models import qwen3_moe
    from quads_megatron.plan import QuantPlan
    from quads_megatron.recipe import QuadsRecipe

    with pytest.raises(ConfigError) as e:
        parse_args(_flags(tmp_path, "--rac-channels", "128"))
    t = dict(__import__("quads_megatron.megatron.presets", fromlist=["PRESETS"]).PRESETS["tiny"]["transformer"])
    dims = qwen3_moe.Dims(vocab_size=256, hidden_size=t["hidden_size"], num_layers=t["num_layers"],
                          num_heads=t["num_attention_heads"], num_kv_heads=t["num_query_groups"],
                          head_dim=t["kv_channels"], num_experts=t["num_moe_experts"], moe_ffn=t["moe_ffn_hidden_size"],
                          tie_word_embeddings=False)
    with pytest.raises(ValueError) as plan_error:  # what quads-export-rollout raises it from, for the same model
        QuantPlan.resolve(QuadsRecipe(rac_channels=128), dims)
    assert str(plan_error.value) in str(e.value)


def test_cli_entry_points_exit_2_with_one_line(tmp_path):
    """`python -m quads_megatron.rl` and the example script (through torchrun, 2 ranks: one line per rank that got
    to print it; torchrun stops the other rank as soon as the first exits, so that is one or two lines)."""
    cmd = [sys.executable, "-m", "quads_megatron.rl", "--top-p", "2"]
    p = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip() == f"{PROG}: error: --top-p 2.0: must be <= 1.0", p.stderr
    env = dict(ENV, NPROC_PER_NODE="2", PYTHON=sys.executable)
    p = subprocess.run(["bash", str(ROOT / "examples" / "train_grpo_moe.sh"), "--lr", "-1"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=180)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) in (1, 2), p.stderr
    assert set(lines) == {f"{PROG}: error: --lr -1.0: must be >= 0.0"}, p.stderr
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------ prompts / eval files (JSONL tasks)

JSONL_CASES = {
    "empty": ("\n\n", "is empty"),
    "malformed-line": ('{"prompt": "1+1=", "answer": "2"}\n{nope\n', "{path}:2: not valid JSON"),
    "missing-field": ('{"prompt": "1+1="}\n', "{path}:1: missing field(s) ['answer']"),
    "not-an-object": ('[1, 2]\n', "{path}:1: expected a JSON object"),
    "empty-prompt": ('{"prompt": "", "answer": "2"}\n', "{path}:1: field 'prompt' must be a non-empty string"),
    "binary": (None, "unreadable"),
}


@pytest.mark.parametrize("which", ["task", "eval-data"])
@pytest.mark.parametrize("case", list(JSONL_CASES))
def test_bad_prompts_file_is_named_with_line_and_field(case, which, tmp_path, capsys):
    text, phrase = JSONL_CASES[case]
    bad = tmp_path / "bad.jsonl"
    if text is None:
        bad.write_bytes(b"\xff\xfe\x00\x81" * 64)
    else:
        bad.write_text(text)
    good = _write(tmp_path / "good.jsonl", "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                                   for i in range(8)))
    flags = ["--task", str(bad)] if which == "task" else ["--task", good, "--eval-data", str(bad)]
    t0 = time.perf_counter()
    assert run(_flags(tmp_path, "--train-iters", "1", *flags)) == 2
    assert time.perf_counter() - t0 < 10  # fails while reading the file, before the model is built
    err = _one_line(capsys)
    assert phrase.format(path=bad) in err and str(bad) in err, err
    assert not (tmp_path / "tb").exists()


def test_jsonl_directory_is_not_a_file(tmp_path, capsys):
    (tmp_path / "dir.jsonl").mkdir()
    assert run(_flags(tmp_path, "--task", str(tmp_path / "dir.jsonl"))) == 2
    assert "dir.jsonl" in _one_line(capsys)


def test_prompt_longer_than_seq_length_before_the_model(tmp_path, capsys):
    t0 = time.perf_counter()
    assert run(_flags(tmp_path, "--seq-length", "8")) == 2
    assert time.perf_counter() - t0 < 10
    err = _one_line(capsys)
    assert "--seq-length 8" in err and "--task sort:3" in err


# ------------------------------------------------------------------ sizes: estimated before anything is allocated

MEMORY_CASES = {
    "seq-length-1e9": (["--seq-length", "1000000000"], ["--seq-length 1000000000", "rollout KV cache", "GiB"]),
    "num-experts-1e9": (["--num-experts", "1000000000"], ["--num-experts 1000000000", "trainer weights", "GiB"]),
    "num-layers-1e6": (["--num-layers", "1000000"], ["--num-layers 1000000", "GiB"]),
}


@pytest.mark.parametrize("case", list(MEMORY_CASES))
def test_run_that_cannot_fit_in_memory_is_refused_before_any_model(case, tmp_path, capsys):
    extra, words = MEMORY_CASES[case]
    assert run_cli(parse_args, _flags(tmp_path, *extra), prog=PROG) == 2
    err = _one_line(capsys)
    for w in words:
        assert w in err, (w, err)


def test_seq_length_1e6_is_refused_where_its_kv_cache_cannot_fit(tmp_path, capsys):
    """The issue's case: 16 rollout + 64 pass@1 sequences x 10^6 positions x (2 layers x K,V x 2 KV heads x 16
    dims x 4 bytes) is 38 GiB of KV cache alone (by hand); refused wherever that exceeds the memory."""
    import torch

    kv = (16 + 64) * 10**6 * (2 * 2 * 2 * 16 * 4)
    if torch.cuda.is_available():
        pytest.skip("compares against host memory")
    avail = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable:"))
    if avail >= kv:
        pytest.skip(f"this machine has {avail / 2**30:.0f} GiB available")
    assert run_cli(parse_args, _flags(tmp_path, "--seq-length", "1000000"), prog=PROG) == 2
    err = _one_line(capsys)
    assert "--seq-length 1000000:" in err and "available host memory" in err, err


# ------------------------------------------------------------------ faults the environment causes

ENV_FLAG_CASES = {
    # name: (argv extra, words); "{tmp}/bad.json" is a file
    "tensorboard-dir-is-a-file": (["--tensorboard-dir", "{tmp}/bad.json"], ["--tensorboard-dir", "not a directory"]),
    "tensorboard-dir-under-a-file": (["--tensorboard-dir", "{tmp}/bad.json/tb"],
                                     ["--tensorboard-dir", "bad.json is a file"]),
    "summary-json-in-missing-dir": (["--summary-json", "{tmp}/nope/s.json"], ["--summary-json", "does not exist"]),
    "summary-json-is-a-dir": (["--summary-json", "{tmp}"], ["--summary-json", "is a directory"]),
    "sglang-port-out-of-range": (["--rollout-engine", "sglang", "--sglang-url", "http://127.0.0.1:99999"],
                                 ["--sglang-url http://127.0.0.1:99999", "1-65535"]),
    "sglang-port-not-a-number": (["--rollout-engine", "sglang", "--sglang-url", "http://127.0.0.1:abc"],
                                 ["--sglang-url http://127.0.0.1:abc", "1-65535"]),
    "sglang-url-without-host": (["--rollout-engine", "sglang", "--sglang-url", "http://:30000"],
                                ["--sglang-url http://:30000", "no host"]),
}


@pytest.mark.parametrize("case", list(ENV_FLAG_CASES))
def test_unusable_output_path_or_url_is_one_line_before_any_model(case, tmp_path, capsys):
    _write(tmp_path / "bad.json", "{nope")
    extra, words = ENV_FLAG_CASES[case]
    argv = [a.replace("{tmp}", str(tmp_path)) for a in _flags(tmp_path, *extra)]
    assert run_cli(parse_args, argv, prog=PROG) == 2
    err = _one_line(capsys)
    for w in words:
        assert w.replace("{tmp}", str(tmp_path)) in err, (w, err)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]   # closed again: nothing listens there


def test_sglang_url_where_nothing_listens_is_one_line(tmp_path, capsys):
    url = f"http://127.0.0.1:{_free_port()}"
    assert run(_flags(tmp_path, "--rollout-engine", "sglang", "--sglang-url", url, "--train-iters", "1")) == 2
    err = _prog_line(capsys)
    assert f"SGLang server {url} is unreachable" in err, err


def _big_vocab_tokenizer(path: Path) -> Path:
    """A character tokenizer whose ids start at 300: outside the tiny model's 256-row vocabulary."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from quads_megatron.rl.tokenizer import CHARS, SPECIALS

    vocab = {tok: 300 + i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                            unk_token="<unk>").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    from tests.convert.convert_fixtures import save_tiny_hf

    return save_tiny_hf(tmp_path_factory.mktemp("grpo_hf") / "hf")


def test_tokenizer_whose_ids_exceed_the_vocabulary_is_named_before_training(tiny_hf_dir, tmp_path, capsys):
    tok = _big_vocab_tokenizer(tmp_path / "tok")
    assert run(_flags(tmp_path, "--hf-checkpoint", str(tiny_hf_dir), "--tokenizer", str(tok), "--sft-iters", "0",
                      "--train-iters", "1")) == 2
    err = _one_line(capsys)
    assert f"the tokenizer of {tok}" in err and "outside the model's vocabulary of 256" in err, err


def test_tokenizer_dir_without_a_tokenizer_is_named(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert run(_flags(tmp_path, "--tokenizer", str(tmp_path / "empty"), "--train-iters", "1")) == 2
    err = _one_line(capsys)
    assert f"tokenizer {tmp_path / 'empty'}: cannot be loaded" in err, err


@pytest.mark.parametrize("flag", ["--lr", "--sft-lr"])
def test_learning_rate_beyond_float32_is_refused_before_any_model(flag, tmp_path, capsys):
    assert run_cli(parse_args, _flags(tmp_path, flag, "1e38"), prog=PROG) == 2
    err = _one_line(capsys)
    assert f"{flag} 1e+38: too large" in err and "float32" in err, err


def test_learning_rate_that_blows_up_the_weights_names_the_step_and_the_weight(tmp_path, capsys):
    """--lr 3e37 fits float32, but its updates leave weights near float32's limit: the first non-finite
    quantity is reported with its step and the largest weight, and that step is not saved."""
    save = tmp_path / "ck"
    assert run(_flags(tmp_path, "--lr", "3e37", "--clip-grad", "0", "--sft-iters", "0", "--train-iters", "6",
                      "--save", str(save), "--save-interval", "1")) == 2
    err = _prog_line(capsys)
    m = re.search(r"step (\d+): .* is NaN or Inf \(largest weight: (\S+) (\|w\|max=\S+|holds NaN or Inf); "
                  r"--lr 3e\+37\)", err)
    assert m, err
    assert "NaN or Inf" in err and m.group(2).endswith(("weight", "bias")), err
    assert mckpt.latest_iteration(save) in (None, int(m.group(1)) - 1)   # the bad step was not saved


def _run_with_file_size_limit(tmp_path, limit: int, *flags) -> subprocess.CompletedProcess:
    """The GRPO job in a child whose files the kernel refuses to grow past ``limit`` bytes (RLIMIT_FSIZE: a
    real EFBIG write failure, as on a full disk), SIGXFSZ ignored so the write fails instead of the process."""
    import resource

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd = [sys.executable, "-m", "quads_megatron.rl", *_flags(tmp_path, *flags)]
    return subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300,
                          preexec_fn=limit_file_size)


def _the_line(p: subprocess.CompletedProcess) -> str:
    lines = [line for line in p.stderr.strip().splitlines() if line.startswith(PROG)]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    return lines[0]


def test_disk_full_during_a_save_is_named_and_leaves_no_partial_iteration(tmp_path):
    """The shards of the tiny model are larger than 200 kB, the event file and the small outputs are not."""
    save = tmp_path / "ck"
    line = _the_line(_run_with_file_size_limit(tmp_path, 200_000, "--train-iters", "1", "--save", str(save)))
    assert f"{save}: saving iteration 1 failed (" in line, line
    assert not (save / mckpt.TRACKER).exists()
    assert not [d.name for d in save.glob("iter_*")]


def test_disk_full_during_a_tensorboard_write_is_named(tmp_path):
    line = _the_line(_run_with_file_size_limit(tmp_path, 3_000, "--train-iters", "3"))
    assert line == f"{PROG}: error: --tensorboard-dir {tmp_path / 'tb'}: writing TensorBoard events failed: " \
                   "File too large", line


# ------------------------------------------------------------------ checkpoints of the GRPO loop

@pytest.fixture(scope="module")
def grpo_save(tmp_path_factory):
    """A --save directory holding iterations 1 and 2 of a tiny run (saved once per module)."""
    tmp = tmp_path_factory.mktemp("grpo_ck")
    save = tmp / "ck"
    summary_json = tmp / "s.json"
    assert run(TINY + ["--tensorboard-dir", str(tmp / "tb"), "--train-iters", "2", "--save", str(save),
                       "--save-interval", "1", "--sft-iters", "0", "--summary-json", str(summary_json)]) == 0
    assert summary_json.is_file()
    return save


def _hashes(root: Path) -> dict:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def ck(grpo_save, tmp_path):
    import shutil

    shutil.copytree(grpo_save, tmp_path / "ck")
    return tmp_path / "ck"


def test_save_writes_a_verified_manifest_per_iteration(grpo_save):
    assert mckpt.latest_iteration(grpo_save) == 2
    for it in ("iter_0000001", "iter_0000002"):
        assert verify_manifest(grpo_save / it) is True
    state = mckpt.load_common_state(grpo_save)["grpo_loop"]
    assert state["task"] == "sort:3" and json.loads(state["args"])["task"] == "sort:3"


RESUME_CASES = {
    # name: (break the copy, extra flags, error class, words of the one line)
    "other-task": (None, ["--task", "sort:4"], ConfigError, ["--task sort:4", "--task sort:3"]),
    "other-num-layers": (None, ["--num-layers", "3"], ConfigError, ["--num-layers 3", "--num-layers None"]),
    "empty-tracker": (lambda ck: (ck / mckpt.TRACKER).write_text(""), [], CheckpointError, [mckpt.TRACKER]),
    "non-numeric-tracker": (lambda ck: (ck / mckpt.TRACKER).write_text("two"), [], CheckpointError, ["'two'"]),
    "tracker-to-missing-iteration": (lambda ck: (ck / mckpt.TRACKER).write_text("7"), [], CheckpointError,
                                     ["iter_0000007", "missing"]),
    "corrupt-common.pt": (lambda ck: (ck / "iter_0000002" / "common.pt").write_bytes(b"\x00" * 100), [],
                          CheckpointError, ["common.pt"]),
    "bad-metadata.json": (lambda ck: (ck / "iter_0000002" / "metadata.json").write_text("[1"), [],
                          CheckpointError, ["metadata.json", "not valid JSON"]),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_refuses_a_broken_or_foreign_checkpoint_before_any_model(case, ck, tmp_path, capsys):
    breaks, extra, cls, words = RESUME_CASES[case]
    if breaks is not None:
        breaks(ck)
    before = _hashes(ck)
    argv = _flags(tmp_path, "--train-iters", "3", "--save", str(ck), "--resume", *extra)
    with pytest.raises(cls):
        parse_args(argv)
    assert run_cli(parse_args, argv, prog=PROG) == 2
    err = _one_line(capsys)
    for w in words:
        assert w in err, (w, err)
    assert _hashes(ck) == before


CHANGED_CASES = {
    # name: (extra flags, the words of the one line); the checkpoint was trained with TINY (seq 16, G 4, lr 3e-4)
    "seq-length": (["--seq-length", "32"], ["--seq-length 32 (the checkpoint's: --seq-length 16)"]),
    "lr": (["--lr", "0.001"], ["--lr 0.001 (the checkpoint's: --lr 0.0003)"]),
    "group-size": (["--n-samples-per-prompt", "2"],
                   ["--n-samples-per-prompt 2 (the checkpoint's: --n-samples-per-prompt 4)"]),
    "all-three": (["--seq-length", "32", "--lr", "0.001", "--n-samples-per-prompt", "2"],
                  ["--seq-length 32 (", "--lr 0.001 (", "--n-samples-per-prompt 2 (",
                   "--resume-allow-change seq-length,lr,n-samples-per-prompt"]),
    "train-iters-below": (["--train-iters", "1"], ["--train-iters 1", "below the checkpoint's iteration 2"]),
    "task-and-lr": (["--task", "sort:4", "--lr", "0.001"], ["--task sort:4 (the checkpoint's: --task sort:3)",
                                                          "--lr 0.001 ("]),
    "allow-task": (["--resume-allow-change", "task"], ["--resume-allow-change task", "must always match"]),
    "allow-unknown": (["--resume-allow-change", "save-interval"], ["--resume-allow-change save-interval",
                                                                  "not a flag of the run's training"]),
    "allow-other-flag": (["--lr", "0.001", "--resume-allow-change", "seq-length"], ["--lr 0.001 ("]),
}


@pytest.mark.parametrize("case", list(CHANGED_CASES))
def test_resume_with_changed_training_flags_lists_every_difference(case, ck, tmp_path, capsys):
    extra, words = CHANGED_CASES[case]
    argv = _flags(tmp_path, "--train-iters", "3", "--save", str(ck), "--resume", *extra)
    assert run_cli(parse_args, argv, prog=PROG) == 2
    err = _one_line(capsys)
    for w in words:
        assert w in err, (w, err)


def test_resume_with_an_allowed_change_says_so(ck, tmp_path, capsys):
    args = parse_args(_flags(tmp_path, "--train-iters", "3", "--save", str(ck), "--resume", "--lr", "0.001",
                             "--seq-length", "32", "--resume-allow-change", "lr", "--resume-allow-change",
                             "seq-length"))
    assert args.lr == 0.001 and args.seq_length == 32
    out = capsys.readouterr().out
    assert "--lr 0.001 (the checkpoint was trained with --lr 0.0003), allowed by --resume-allow-change" in out
    assert "--seq-length 32 (the checkpoint was trained with --seq-length 16)" in out


def test_resume_allow_change_without_a_checkpoint_to_resume_is_refused(tmp_path, capsys):
    assert run_cli(parse_args, _flags(tmp_path, "--resume-allow-change", "lr"), prog=PROG) == 2
    assert "--resume-allow-change needs --load or --resume" in _one_line(capsys)


def test_resume_from_a_flipped_shard_names_the_file(ck, tmp_path, capsys):
    shard = sorted((ck / "iter_0000002").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    for i in range(100, 2100):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = _hashes(ck)
    assert run(_flags(tmp_path, "--train-iters", "3", "--save", str(ck), "--resume")) == 2
    err = _one_line(capsys)
    assert str(shard) in err and "SHA-256" in err
    assert _hashes(ck) == before and mckpt.latest_iteration(ck) == 2


@pytest.mark.parametrize("where", ["metadata", "common.pt", "byte-item"])
def test_resume_refuses_a_pickled_payload_before_running_it(where, ck, tmp_path, capsys):
    """A payload in any pickle of the iteration (manifest rewritten to match) is refused by name, never run."""
    from quads_megatron.integrity import write_manifest
    from tests.reliability.test_untrusted_checkpoints import PLANTS, _payloads

    marker = tmp_path / "ran"
    obj, cls = _payloads(marker)["os.system"]
    file = PLANTS[where](ck / "iter_0000002", obj)
    write_manifest(ck / "iter_0000002")
    before = _hashes(ck)
    assert run(_flags(tmp_path, "--train-iters", "3", "--save", str(ck), "--resume")) == 2
    err = _one_line(capsys)
    assert file in err and "refused to unpickle" in err, err
    assert not marker.exists()
    assert _hashes(ck) == before and mckpt.latest_iteration(ck) == 2


def test_resume_from_our_iteration_without_its_manifest_is_refused(ck, tmp_path, capsys):
    """Deleting the manifest does not turn verification off: the flip it would have named is not loaded."""
    (ck / "iter_0000002" / "quads_manifest.json").unlink()
    shard = sorted((ck / "iter_0000002").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = _hashes(ck)
    assert run(_flags(tmp_path, "--train-iters", "3", "--save", str(ck), "--resume")) == 2
    err = _one_line(capsys)
    assert f"{ck / 'iter_0000002' / 'quads_manifest.json'}: missing, but" in err, err
    assert _hashes(ck) == before


# ------------------------------------------------------------------ NaN / Inf stop the loop before the save

def _nan_at_call(n: int):
    """A counter that says True from the n-th call on (the fault arrives at GRPO step n)."""
    calls = {"n": 0}

    def due():
        calls["n"] += 1
        return calls["n"] >= n
    return due


def _poison_grad(trainer, due):
    p = next(trainer.policy.model.parameters())
    p.register_hook(lambda g: g * math.inf if due() else g)


def _poison_trainer_logits(trainer, due):
    layer = trainer.policy.model.output_layer

    def hook(module, inputs, out):
        if due():
            return (out[0] * math.nan,) + tuple(out[1:]) if isinstance(out, tuple) else out * math.nan
        return out
    layer.register_forward_hook(hook)


def _poison_loss(trainer, due):
    cfg = trainer.loss_cfg
    real = trainer.train_on

    def train_on(batch, step=0):
        trainer.loss_cfg = dataclasses.replace(cfg, kl_coef=math.nan) if due() else cfg
        return real(batch, step)
    trainer.train_on = train_on


def _poison_rollout_logprobs(trainer, due):
    real = trainer.engine.generate

    def generate(prompts, params, seed):
        out = real(prompts, params, seed)
        if params.temperature > 0 and due():  # rollouts only, not the greedy pass@1 evaluation
            out[0].logprobs[0] = math.nan
        return out
    trainer.engine.generate = generate


NONFINITE = {
    "loss": (_poison_loss, "the GRPO loss"),
    "grad-norm": (_poison_grad, "the gradient norm"),
    "trainer-logprob": (_poison_trainer_logits, "the trainer log-prob"),
    "rollout-logprob": (_poison_rollout_logprobs, "the rollout log-prob"),
}


@pytest.mark.parametrize("case", list(NONFINITE))
def test_nonfinite_stops_before_saving_over_the_last_good_checkpoint(case, tmp_path, capsys):
    poison, what = NONFINITE[case]
    save = tmp_path / "ck"
    trainer = GRPOTrainer(parse_args(_flags(tmp_path, "--train-iters", "4", "--save", str(save), "--save-interval",
                                            "1", "--sft-iters", "0", "--eval-interval", "0")))
    try:
        # the fault arrives at step 2 (one micro-batch per step, no SFT): step 1 trains and saves the last
        # good checkpoint
        poison(trainer, _nan_at_call(2))
        with pytest.raises(NonFiniteError, match="step 2"):
            trainer.run()
        capsys.readouterr()
    finally:
        trainer.close()
    assert mckpt.latest_iteration(save) == 1
    assert sorted(p.name for p in save.iterdir()) == ["hf", "iter_0000001", mckpt.TRACKER]
    assert verify_manifest(save / "iter_0000001")
    # and through the entry point's wrapper: one line, exit 2
    trainer = GRPOTrainer(parse_args(_flags(tmp_path, "--train-iters", "1", "--sft-iters", "0",
                                            "--eval-interval", "0")))
    try:
        poison(trainer, _nan_at_call(1))
        assert run_cli(lambda _: trainer.run(), None, prog=PROG) == 2
    finally:
        trainer.close()
    err = _one_line(capsys)
    assert "step 1" in err and what in err and "NaN or Inf" in err, err


# ------------------------------------------------------------------ signals and orphans (subprocesses)

def _wait_for(pred, timeout=240.0, proc=None):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return True
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(0.2)
    return False


def _check_save_dir(save: Path, tracker_before: int):
    assert not [p.name for p in save.iterdir() if p.name.endswith(".tmp") or p.name.startswith(".")]
    after = mckpt.latest_iteration(save)
    assert after >= tracker_before
    for it in save.glob("iter_*"):
        assert verify_manifest(it), it
    assert (mckpt.iteration_dir(save, after)).is_dir()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_ends_with_one_line_and_no_half_written_iteration(sig, tmp_path):
    save = tmp_path / "ck"
    cmd = [sys.executable, "-m", "quads_megatron.rl", *_flags(tmp_path, "--train-iters", "1000", "--save", str(save),
                                                             "--save-interval", "1", "--sft-iters", "0",
                                                             "--eval-interval", "0")]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_for(lambda: (mckpt.latest_iteration(save) or 0) >= 2, proc=proc), proc.stderr.read()
        before = mckpt.latest_iteration(save)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, err
    ours = [ln for ln in err.strip().splitlines() if ln.startswith(PROG)]  # (torch may log a CUDA-less warning)
    assert ours == [f"{PROG}: interrupted by {sig.name}; partial output removed"] and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == ours[0]
    _check_save_dir(save, before)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        state = [ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("State:")][0]
    except (OSError, IndexError):
        return False
    return "Z" not in state.split()[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_killing_the_launchers_process_group_leaves_no_trainer(tmp_path):
    save = tmp_path / "ck"
    env = dict(ENV, NPROC_PER_NODE="1", PYTHON=sys.executable)
    cmd = ["bash", str(ROOT / "examples" / "train_grpo_moe.sh"),
           *_flags(tmp_path, "--train-iters", "1000", "--save", str(save), "--save-interval", "1", "--sft-iters", "0",
                   "--eval-interval", "0")]
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    workers = []
    try:
        assert _wait_for(lambda: (mckpt.latest_iteration(save) or 0) >= 1, proc=launcher)
        workers = _children(launcher.pid)
        assert workers, "torchrun has no worker"
        assert all(os.getsid(w) != os.getsid(launcher.pid) for w in workers)  # torchrun's workers: own sessions
        before = mckpt.latest_iteration(save)
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        assert _wait_for(lambda: not any(_alive(w) for w in workers), timeout=60), "trainer outlived its launcher"
    finally:
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
    _check_save_dir(save, before)
