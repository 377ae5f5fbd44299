"""Fault injection for the three converter CLIs (issue 15): every bad input is exit 2 with one line naming
the file/tensor, nothing at the output path, the input untouched; signals and kills leave no partial
output and no process behind.

One tiny HF checkpoint and its Megatron conversion are built once for the module; each case copies
what it breaks.  Expected messages are the facts each case plants (the field, the tensor, the file).
"""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quads_megatron.convert import cli, hf_to_megatron, megatron_to_hf, rollout_export
from quads_megatron.integrity import MANIFEST, verify_manifest
from tests.convert.convert_fixtures import save_tiny_hf
from tests.reliability.children import assert_gone, descendants, start_until_marked

EXPERT = "model.layers.1.mlp.experts.2.down_proj.weight"
PROGS = {hf_to_megatron.main: "quads-convert-hf-to-megatron", megatron_to_hf.main: "quads-convert-megatron-to-hf",
         rollout_export.main: "quads-export-rollout"}


# ---------------------------------------------------------------- fixtures and helpers

@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("conv")


@pytest.fixture(scope="module")
def hf(root):
    """A transformers-saved tiny Qwen3-MoE (no manifest)."""
    return save_tiny_hf(root / "hf")


@pytest.fixture(scope="module")
def mg(root, hf):
    """quads-convert-hf-to-megatron of ``hf`` (torch_dist + quads_manifest.json)."""
    out = root / "mg"
    assert cli.run(hf_to_megatron.main, ["--load-dir", str(hf), "--save-dir", str(out), "--no-progress"]) == 0
    return out


@pytest.fixture(scope="module")
def hf_ours(root, mg):
    """quads-convert-megatron-to-hf of ``mg`` (HF dir with quads_manifest.json)."""
    out = root / "hf_ours"
    assert cli.run(megatron_to_hf.main, ["--load-dir", str(mg), "--save-dir", str(out), "--no-progress"]) == 0
    return out


def _tokenizer(path, vocab):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(root):
    """Character tokenizer with ids < 96 (inside the tiny vocabulary of 256)."""
    return _tokenizer(root / "tok", {chr(i): i - 32 for i in range(32, 127)} | {"[UNK]": 95})


@pytest.fixture(scope="module")
def big_tok(root):
    """A tokenizer of another model: 'z' is id 300, outside the tiny vocabulary."""
    return _tokenizer(root / "big_tok", {chr(i): i - 32 for i in range(32, 122)} | {"z": 300, "[UNK]": 95})


def tree_hash(path) -> str:
    """SHA-256 over every file name and content under ``path`` (hashlib, independent of the code under test)."""
    path = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in files:
        h.update(str(p.relative_to(path) if path.is_dir() else p.name).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def copy(src, dst, *, manifest=True):
    shutil.copytree(src, dst, symlinks=True)
    if not manifest:
        (Path(dst) / MANIFEST).unlink()
    return Path(dst)


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def edit_tensor(d, name, fn):
    tensors = load_file(str(d / "model.safetensors"))
    fn(tensors[name])
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def flip_bytes(f, start, count):
    data = bytearray(Path(f).read_bytes())
    for i in range(start, start + count):
        data[i] ^= 0xFF
    Path(f).write_bytes(bytes(data))


def tensor_offset(f, name) -> int:
    """Byte offset of tensor ``name``'s data in a safetensors file (header: u64 length + JSON)."""
    raw = Path(f).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return 8 + n + json.loads(raw[8:8 + n])[name]["data_offsets"][0]


def leftovers(out) -> list:
    """The output and every temporary sibling of it."""
    out = Path(out)
    return [p.name for p in out.parent.iterdir() if p.name == out.name or p.name.startswith(f".{out.name}.")] \
        if out.parent.is_dir() else []


def assert_refused(main, argv, capsys, match, *, out=None, inputs=()):
    """Exit 2, one stderr line naming ``match`` (regex), ``out`` not created, every input byte-identical."""
    before = {p: tree_hash(p) for p in inputs}
    out_existed = out is not None and Path(out).exists()
    capsys.readouterr()
    rc = cli.run(main, argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2, lines
    assert len(lines) == 1, lines
    assert re.search(match, lines[0]), lines[0]
    if out is not None and not out_existed:
        assert leftovers(out) == [], leftovers(out)
    for p, h in before.items():
        assert tree_hash(p) == h, f"input {p} changed"
    return lines[0]


# ---------------------------------------------------------------- 1. no data loss

def _overlap_cases(tmp_path, hf, mg):
    """(main, argv, inputs to keep) where --save-dir equals, contains or lies inside an input."""
    h = copy(hf, tmp_path / "X" / "hf")
    m = copy(mg, tmp_path / "M" / "mg")
    (tmp_path / "link").symlink_to(h)
    cfg = tmp_path / "C"
    cfg.mkdir()
    shutil.copy(hf / "config.json", cfg / "config.json")
    return {
        "export_save_is_load": (rollout_export.main, ["--load-dir", str(h), "--save-dir", str(h), "--force"], [h]),
        "export_save_is_parent_of_load": (rollout_export.main, ["--load-dir", str(h), "--save-dir", str(h.parent),
                                                                "--force"], [h]),
        "export_save_through_symlink": (rollout_export.main, ["--load-dir", str(h), "--save-dir",
                                                              str(tmp_path / "link"), "--force"], [h]),
        "h2m_save_is_load": (hf_to_megatron.main, ["--load-dir", str(h), "--save-dir", str(h), "--force"], [h]),
        "h2m_save_inside_load": (hf_to_megatron.main, ["--load-dir", str(h), "--save-dir", str(h / "mg")], [h]),
        "m2h_save_is_parent_of_load": (megatron_to_hf.main, ["--load-dir", str(m), "--save-dir", str(m.parent),
                                                             "--force"], [m]),
        "m2h_save_holds_hf_config": (megatron_to_hf.main, ["--load-dir", str(m), "--hf-config", str(cfg / "config.json"),
                                                           "--save-dir", str(cfg), "--force"], [m, cfg]),
    }


OVERLAPS = ["export_save_is_load", "export_save_is_parent_of_load", "export_save_through_symlink", "h2m_save_is_load",
            "h2m_save_inside_load", "m2h_save_is_parent_of_load", "m2h_save_holds_hf_config"]


@pytest.mark.parametrize("case", OVERLAPS)
def test_save_dir_overlapping_an_input_is_refused_even_with_force(case, tmp_path, hf, mg, capsys):
    main, argv, keep = _overlap_cases(tmp_path, hf, mg)[case]
    assert_refused(main, argv + ["--no-progress"], capsys, r"--save-dir .* overlaps --(load-dir|hf-config) ",
                   inputs=keep)
    assert all(p.is_dir() for p in keep)


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_stale_temp_dirs_of_a_dead_run_are_removed_and_a_live_ones_kept(tmp_path, hf):
    out = tmp_path / "out"
    dead = _dead_pid()
    (tmp_path / f".out.partial-{dead}-abc").mkdir()
    (tmp_path / f".out.partial-{dead}-abc" / "half.safetensors").write_bytes(b"x" * 100)
    live = tmp_path / f".out.partial-{os.getpid()}-live"
    live.mkdir()
    other = tmp_path / f".other.partial-{dead}-abc"
    other.mkdir()
    argv = ["--load-dir", str(hf), "--save-dir", str(out), "--rollout-precision", "w4a16", "--no-progress"]
    assert cli.run(rollout_export.main, argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live.name, other.name])
    assert verify_manifest(out) is True


def test_a_replaced_checkpoint_left_by_a_dead_run_is_put_back_not_overwritten(tmp_path, hf, capsys):
    out = tmp_path / "out"
    old = tmp_path / f".out.old-{_dead_pid()}-xyz"
    (old / "ckpt").mkdir(parents=True)
    (old / "ckpt" / "model.safetensors").write_bytes(b"previous checkpoint")
    argv = ["--load-dir", str(hf), "--save-dir", str(out), "--rollout-precision", "w4a16", "--no-progress"]
    assert_refused(rollout_export.main, argv, capsys, r"output .*out already exists; pass --force")
    assert (out / "model.safetensors").read_bytes() == b"previous checkpoint"
    assert not old.exists()


# ---------------------------------------------------------------- signals and kills (subprocesses)

# The child runs the real CLI; only a delay is injected where it writes (so the signal lands mid-write)
# and a marker file says the write has begun.
_SLOW = {
    "h2m": ("quads_megatron.convert.hf_to_megatron",
            "from megatron.core.dist_checkpointing.strategies import filesystem_async as m\n"
            "real = m.FileSystemWriterAsync.write_preloaded_data\n"
            "def slow(*a, **k):\n    open(MARK, 'w').close(); time.sleep(120); return real(*a, **k)\n"
            "m.FileSystemWriterAsync.write_preloaded_data = staticmethod(slow)\n"),
    "export": ("quads_megatron.convert.rollout_export", None),
    "m2h": ("quads_megatron.convert.megatron_to_hf", None),
}
_SLOW_SAFETENSORS = ("import quads_megatron.convert.hf_checkpoint as m\n"
                     "real = m.save_file\n"
                     "def slow(*a, **k):\n    real(*a, **k); open(MARK, 'w').close(); time.sleep(120)\n"
                     "m.save_file = slow\n")


def _start(tmp_path, tool, argv):
    module, patch = _SLOW[tool]
    mark = tmp_path / "writing"
    script = tmp_path / "child.py"
    script.write_text(f"import sys, time\nMARK = {str(mark)!r}\n{patch or _SLOW_SAFETENSORS}"
                      f"import {module} as tool\nsys.argv = ['{tool}'] + {argv!r}\ntool.console_main()\n")
    return start_until_marked(script, mark)


def _tool_argv(tool, hf, mg, out):
    load = hf if tool in ("h2m", "export") else mg
    extra = ["--rollout-precision", "w4a16"] if tool == "export" else []
    return ["--load-dir", str(load), "--save-dir", str(out), "--no-progress", *extra]


@pytest.mark.parametrize("tool, sig", [("h2m", signal.SIGTERM), ("h2m", signal.SIGINT), ("export", signal.SIGTERM),
                                       ("m2h", signal.SIGINT)], ids=["h2m-SIGTERM", "h2m-SIGINT", "export-SIGTERM",
                                                                     "m2h-SIGINT"])
def test_signal_mid_write_ends_with_one_line_and_removes_the_partial_output(tool, sig, tmp_path, hf, mg):
    out = tmp_path / "out"
    before = tree_hash(mg if tool == "m2h" else hf)
    proc = _start(tmp_path, tool, _tool_argv(tool, hf, mg, out))
    children = descendants(proc.pid)
    assert leftovers(out), "no partial directory while writing"
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    ours = [line for line in err.splitlines() if line.startswith(f"{tool}:")]
    assert ours == [f"{tool}: interrupted by {signal.Signals(sig).name}; partial output removed"], err
    assert "Traceback" not in err, err
    assert leftovers(out) == []
    assert_gone(children)
    assert tree_hash(mg if tool == "m2h" else hf) == before


def test_sigkill_mid_write_leaves_no_writer_and_the_next_run_cleans_up(tmp_path, hf, mg):
    out = tmp_path / "out"
    proc = _start(tmp_path, "h2m", _tool_argv("h2m", hf, mg, out))
    children = descendants(proc.pid)
    assert children, "dist_checkpointing forked no writer (the case this test is about)"
    proc.kill()
    proc.communicate(timeout=30)     # returns only once no process holds the pipes (no orphaned writer)
    assert_gone(children)
    stale = sorted(leftovers(out))     # the dead run's temporary, and its lock file (no process holds it)
    assert len(stale) == 2 and stale[0] == ".out.lock" and stale[1].startswith(".out.partial-"), stale
    assert cli.run(hf_to_megatron.main, _tool_argv("h2m", hf, mg, out)) == 0
    assert leftovers(out) == ["out"]
    assert verify_manifest(out) is True


# ---------------------------------------------------------------- 2 + 3 + 6. validation before any work

def _cfg_file(tmp_path, hf, **changes):
    d = tmp_path / "cfg"
    d.mkdir()
    shutil.copy(hf / "config.json", d / "config.json")
    edit_config(d, **changes)
    return d / "config.json"


def _validation_cases(t, hf, mg, tok, big_tok):
    """{case: () -> (main, argv, match)}; a case's inputs are built under ``t`` when it is called."""
    out = str(t / "out")
    h = lambda **c: edit_config(copy(hf, t / "h"), **c)          # noqa: E731
    m2h = lambda *a: (megatron_to_hf.main, ["--load-dir", str(mg), "--save-dir", out, *a])      # noqa: E731
    exp = lambda load, *a: (rollout_export.main, ["--load-dir", str(load), "--save-dir", out, *a])  # noqa: E731
    h2m = lambda load, *a: (hf_to_megatron.main, ["--load-dir", str(load), "--save-dir", out, *a])  # noqa: E731

    def calib(text_or_bytes, suffix=".jsonl"):
        f = t / f"calib{suffix}"
        f.write_bytes(text_or_bytes if isinstance(text_or_bytes, bytes) else text_or_bytes.encode())
        return f

    def listed_config():
        d = copy(hf, t / "listed")
        (d / "config.json").write_text(json.dumps([json.loads((hf / "config.json").read_text())]))
        return d

    (t / "afile").write_text("x")
    cases = {
        # 2. a preset or config whose shapes are not the checkpoint's: refused from .metadata, nothing built
        "m2h_preset_30b_on_tiny": lambda: (*m2h("--preset", "qwen3-30b-a3b"), r"tensor embedding\.word_embeddings\.weight has "
                                   r"shape \[256, 64\], --preset qwen3-30b-a3b implies \['V', 2048\]"),
        "m2h_config_shapes_disagree": lambda: (*m2h("--hf-config", str(_cfg_file(t, hf, moe_intermediate_size=32))),
                                       r"linear_fc1\.weight has shape \[2, 4, 128, 64\], --hf-config .*cfg.* implies "
                                       r"\[2, 4, 64, 64\]"),
        # 3. --hf-config vs the checkpoint
        "m2h_vocab_smaller": lambda: (*m2h("--hf-config", str(_cfg_file(t, hf, vocab_size=200))),
                              r"vocab_size=200, but the checkpoint .* was written with vocab_size=256"),
        "m2h_vocab_larger": lambda: (*m2h("--hf-config", str(_cfg_file(t, hf, vocab_size=512))),
                             r"vocab_size=512, but the checkpoint's embedding .* has only 256 rows"),
        "m2h_top_k_differs": lambda: (*m2h("--hf-config", str(_cfg_file(t, hf, num_experts_per_tok=1))),
                              r"num_experts_per_tok=1, but the checkpoint .* written with num_experts_per_tok=2"),
        "m2h_top_k_above_experts": lambda: (*m2h("--hf-config", str(_cfg_file(t, hf, num_experts_per_tok=5))),
                                    r"num_experts_per_tok=5 is larger than num_(local_)?experts=4"),
        "m2h_hf_config_is_a_list": lambda: (*m2h("--hf-config", str(listed_config() / "config.json")),
                                    r"config\.json: expected a JSON object, found a list"),
        "export_top_k_above_experts": lambda: (*exp(h(num_experts_per_tok=5)),
                                               r"num_experts_per_tok=5 is larger than num_(local_)?experts=4"),
        "export_num_experts_string": lambda: (*exp(h(num_experts="4")), r"num_experts must be an integer, found '4' \(str\)"),
        "export_num_local_experts_string": lambda: (*exp(h(num_experts=None, num_local_experts="4")),
                                            r"num_local_experts must be an integer, found '4' \(str\)"),
        "export_hidden_size_float": lambda: (*exp(h(hidden_size=64.0)), r"hidden_size must be an integer, found 64\.0"),
        "export_config_is_a_list": lambda: (*exp(listed_config()), r"config\.json: expected a JSON object, found a list"),
        "h2m_config_is_a_list": lambda: (*h2m(listed_config()), r"config\.json: expected a JSON object, found a list"),
        "h2m_top_k_string": lambda: (*h2m(h(num_experts_per_tok="2")), r"num_experts_per_tok must be an integer, found '2'"),
        # 3. calibration flags and data
        "export_calib_size_negative": lambda: (*exp(hf, "--calib-size", "-5"), r"--calib-size -5: must be a positive integer"),
        "export_calib_size_zero": lambda: (*exp(hf, "--calib-size", "0"), r"--calib-size 0: must be a positive integer"),
        "export_calib_seq_len_zero": lambda: (*exp(hf, "--calib-seq-len", "0"), r"--calib-seq-len 0: must be a positive"),
        "export_calib_seq_len_past_model": lambda: (*exp(hf, "--calib-seq-len", "100"),
                                            r"--calib-seq-len 100: longer than the model's max_position_embeddings=64"),
        "export_calib_file_empty": lambda: (*exp(hf, "--calib-data", str(calib("", ".txt")), "--tokenizer-dir", str(tok)),
                                    r"calib\.txt: no calibration prompts"),
        "export_calib_file_binary": lambda: (*exp(hf, "--calib-data", str(calib(bytes(range(256)) * 4, ".txt")),
                                          "--tokenizer-dir", str(tok)), r"calib\.txt: not UTF-8 text"),
        "export_calib_prompt_empty": lambda: (*exp(hf, "--calib-data", str(calib('{"text": "ok"}\n{"text": ""}\n')),
                                           "--tokenizer-dir", str(tok)), r"calib\.jsonl:2: the prompt tokenizes to no tokens"),
        "export_calib_tokenizer_too_big": lambda: (*exp(hf, "--calib-data", str(calib('{"text": "abz"}\n')),
                                                "--tokenizer-dir", str(big_tok)),
                                           r"calib\.jsonl:1: token id 300 is outside the model's vocab_size=256"),
        # 3. other flags
        "export_max_shard_size_abc": lambda: (*exp(hf, "--max-shard-size", "ABC"), r"--max-shard-size 'ABC': expected a size"),
        "m2h_max_shard_size_abc": lambda: (*m2h("--max-shard-size", "ABC"), r"--max-shard-size 'ABC': expected a size"),
        "export_device_banana": lambda: (*exp(hf, "--device", "banana"), r"--device 'banana': expected cpu, cuda or cuda:N"),
        "export_output_parent_is_a_file": lambda: (rollout_export.main, ["--load-dir", str(hf), "--save-dir",
                                                                 str(t / "afile" / "out")], r"afile is not a directory"),
        "export_output_unwritable": lambda: (rollout_export.main, ["--load-dir", str(hf), "--save-dir", "/proc/quads-no-such/out",
                                                           "--rollout-precision", "w4a16"],
                                     r"output /proc/quads-no-such/out: cannot create it"),
        "h2m_tp_zero": lambda: (*h2m(hf, "--tensor-model-parallel-size", "0"), r"--tensor-model-parallel-size 0: must be a positive"),
        "m2h_tp_zero": lambda: (*m2h("--tensor-model-parallel-size", "0"), r"--tensor-model-parallel-size 0: must be a positive"),
        "h2m_vocab_divisible_by_zero": lambda: (*h2m(hf, "--make-vocab-size-divisible-by", "0"),
                                        r"--make-vocab-size-divisible-by 0: must be a positive"),
        "h2m_tp2_without_torchrun": lambda: (*h2m(hf, "--tensor-model-parallel-size", "2"),
                                     r"do not fit 1 process\(es\) \(run it under torchrun --nproc-per-node N\)"),
        "m2h_ep2_without_torchrun": lambda: (*m2h("--expert-model-parallel-size", "2"), r"do not fit 1 process\(es\)"),
    }
    if not torch.cuda.is_available():
        cases["export_device_cuda_without_gpu"] = lambda: (*exp(hf, "--device", "cuda"), r"--device cuda: no CUDA GPU")
    return cases


VALIDATION = ["m2h_preset_30b_on_tiny", "m2h_config_shapes_disagree", "m2h_vocab_smaller", "m2h_vocab_larger",
              "m2h_top_k_differs", "m2h_top_k_above_experts", "m2h_hf_config_is_a_list", "export_top_k_above_experts",
              "export_num_experts_string", "export_num_local_experts_string", "export_hidden_size_float",
              "export_config_is_a_list", "h2m_config_is_a_list", "h2m_top_k_string", "export_calib_size_negative",
              "export_calib_size_zero", "export_calib_seq_len_zero", "export_calib_seq_len_past_model",
              "export_calib_file_empty", "export_calib_file_binary", "export_calib_prompt_empty",
              "export_calib_tokenizer_too_big", "export_max_shard_size_abc", "m2h_max_shard_size_abc",
              "export_device_banana", "export_output_parent_is_a_file", "export_output_unwritable", "h2m_tp_zero",
              "m2h_tp_zero", "h2m_vocab_divisible_by_zero", "h2m_tp2_without_torchrun", "m2h_ep2_without_torchrun",
              pytest.param("export_device_cuda_without_gpu",
                           marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present"))]


@pytest.mark.parametrize("case", VALIDATION)
def test_bad_flag_config_or_data_is_one_named_line_before_any_work(case, tmp_path, hf, mg, tok, big_tok, capsys):
    main, argv, match = _validation_cases(tmp_path, hf, mg, tok, big_tok)[case]()
    started = time.monotonic()
    out = Path(argv[argv.index("--save-dir") + 1])
    assert_refused(main, argv + ["--no-progress"], capsys, match, out=out if out.parent.is_dir() else None,
                   inputs=[hf, mg] + [p for p in tmp_path.iterdir() if p.name not in ("out",)])
    # nothing was built: the 30B preset would take minutes and tens of GB
    assert time.monotonic() - started < 30


# ---------------------------------------------------------------- 4. finite everywhere

def _nan_hf(t, hf, name, value, *, ff_bytes=False):
    d = copy(hf, t / "bad")
    if ff_bytes:   # 1000 bytes of 0xFF in the tensor's data: bf16 NaN
        f = d / "model.safetensors"
        data = bytearray(f.read_bytes())
        start = tensor_offset(f, name)
        data[start:start + 1000] = b"\xff" * 1000
        f.write_bytes(bytes(data))
        return d
    return edit_tensor(d, name, lambda x: x.view(-1).__setitem__(7, value))


@pytest.mark.parametrize("tool, name, value, ff", [
    ("export", "model.layers.0.input_layernorm.weight", float("nan"), False),
    ("export", "model.layers.1.self_attn.q_proj.weight", float("inf"), False),
    ("export", EXPERT, float("nan"), False),
    ("export", "model.embed_tokens.weight", None, True),
    ("h2m", "model.norm.weight", float("nan"), False),
    ("h2m", "model.layers.0.self_attn.k_norm.weight", float("-inf"), False),
])
def test_non_finite_hf_tensor_is_refused_by_name(tool, name, value, ff, tmp_path, hf, capsys):
    bad = _nan_hf(tmp_path, hf, name, value, ff_bytes=ff)
    main = rollout_export.main if tool == "export" else hf_to_megatron.main
    out = tmp_path / "out"
    argv = ["--load-dir", str(bad), "--save-dir", str(out)] + (["--rollout-precision", "w4a16"] if tool == "export" else [])
    kind = "NaN" if ff or value != value else "Inf"
    assert_refused(main, argv + ["--no-progress"], capsys,
                   rf"model\.safetensors: tensor {re.escape(name)} holds \d+ non-finite value\(s\) \(first: {kind}",
                   out=out, inputs=[bad])


@pytest.mark.parametrize("hf_name", ["model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.q_proj.weight"])
def test_non_finite_megatron_weight_is_refused_by_its_hf_name(hf_name, tmp_path, hf, mg, capsys):
    from quads_megatron.models import qwen3_moe
    from quads_megatron.convert.megatron_checkpoint import (build_model_from_hf_config, load_megatron_checkpoint,
                                                            save_megatron_checkpoint)
    from quads_megatron.convert.megatron_params import global_param_refs
    from quads_megatron.megatron.parallel import initialize_distributed

    config = json.loads((hf / "config.json").read_text())
    initialize_distributed()
    model = build_model_from_hf_config(config)
    load_megatron_checkpoint(model, mg)
    ref = next(r for r in global_param_refs(model) if hf_name in qwen3_moe.hf_names(r.rule, r.layer, r.expert))
    with torch.no_grad():
        ref.param.view(-1)[0] = float("nan")       # row 0 of linear_qkv is q_proj's row 0
    bad = save_megatron_checkpoint(model, tmp_path / "bad_mg", config)
    out = tmp_path / "out"
    assert_refused(megatron_to_hf.main, ["--load-dir", str(bad), "--save-dir", str(out), "--no-progress"], capsys,
                   rf"bad_mg: tensor {re.escape(hf_name)} holds 1 non-finite value\(s\) \(first: NaN", out=out,
                   inputs=[bad])


# ---------------------------------------------------------------- 5. integrity

def test_every_converter_output_carries_a_manifest_that_matches_its_files(mg, hf_ours, hf, tmp_path):
    out = tmp_path / "rollout"
    assert cli.run(rollout_export.main, ["--load-dir", str(hf), "--save-dir", str(out), "--rollout-precision", "w4a16",
                                         "--no-progress"]) == 0
    for d in (mg, hf_ours, out):
        files = json.loads((d / MANIFEST).read_text())["files"]
        on_disk = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p.name != MANIFEST)
        assert sorted(files) == on_disk
        for rel, entry in files.items():   # independent hash
            assert hashlib.sha256((d / rel).read_bytes()).hexdigest() == entry["sha256"], rel


@pytest.mark.parametrize("case", ["m2h_flipped_distcp", "export_flipped_safetensors", "h2m_flipped_safetensors",
                                  "m2h_flipped_common_pt"])
def test_flipped_bytes_in_a_written_checkpoint_are_named(case, tmp_path, mg, hf_ours, capsys):
    out = tmp_path / "out"
    if case.startswith("m2h"):
        d = copy(mg, tmp_path / "mg")
        f = d / ("__0_0.distcp" if "distcp" in case else "common.pt")
        flip_bytes(f, 100, 2000 if "distcp" in case else 1)
        main = megatron_to_hf.main
    else:
        d = copy(hf_ours, tmp_path / "h")
        f = d / "model.safetensors"
        flip_bytes(f, tensor_offset(f, EXPERT), 1)
        main = rollout_export.main if case.startswith("export") else hf_to_megatron.main
    assert_refused(main, ["--load-dir", str(d), "--save-dir", str(out), "--no-progress"], capsys,
                   rf"{re.escape(str(f))}: SHA-256 does not match {MANIFEST} \(corrupt file\)", out=out, inputs=[d])


# ---------------------------------------------------------------- 6. damaged Megatron checkpoints

def _damage(d, case):
    if case == "metadata_json_not_json":
        (d / "metadata.json").write_text("{not json")
    elif case == "metadata_json_wrong_backend":
        (d / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    elif case == "dcp_metadata_missing":
        (d / ".metadata").unlink()
    elif case in ("dcp_metadata_truncated", "shard_truncated", "shard_truncated_manifest"):
        f = d / (".metadata" if case.startswith("dcp") else "__0_1.distcp")
        os.truncate(f, f.stat().st_size // 2)
    elif case == "shard_missing":
        (d / "__0_1.distcp").unlink()
    elif case == "common_pt_corrupt":
        (d / "common.pt").write_bytes(b"\x00garbage" * 50)
    return d


DAMAGE = {
    "metadata_json_not_json": r"metadata\.json: not valid JSON",
    "metadata_json_wrong_backend": r"metadata\.json: expected a dist_checkpointing config .* found 'zarr'",
    "dcp_metadata_missing": r"\.metadata: missing",
    "dcp_metadata_truncated": r"\.metadata: truncated or corrupt",
    "shard_missing": r"__0_1\.distcp: missing shard",
    "shard_truncated": r"__0_1\.distcp: truncated shard \(\d+ bytes, \.metadata needs \d+\)",
    "shard_truncated_manifest": r"__0_1\.distcp: \d+ bytes, the manifest says \d+",
    "common_pt_corrupt": r"common\.pt: truncated or corrupt",
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_megatron_checkpoint_is_named(case, tmp_path, mg, capsys):
    d = _damage(copy(mg, tmp_path / "mg", manifest=case.endswith("manifest")), case)
    out = tmp_path / "out"
    assert_refused(megatron_to_hf.main, ["--load-dir", str(d), "--save-dir", str(out), "--no-progress"], capsys,
                   DAMAGE[case], out=out, inputs=[d])


@pytest.mark.parametrize("tracker, match", [
    ("", r"latest_checkpointed_iteration\.txt: expected an iteration number.*, found ''"),
    ("abc\n", r"latest_checkpointed_iteration\.txt: expected an iteration number.*, found 'abc'"),
    ("7\n", r"latest_checkpointed_iteration\.txt names iteration 7, but .*iter_0000007 is missing"),
])
def test_bad_tracker_of_a_save_directory_is_named(tracker, match, tmp_path, mg, capsys):
    save = tmp_path / "save"
    copy(mg, save / "iter_0000001")
    (save / "latest_checkpointed_iteration.txt").write_text(tracker)
    out = tmp_path / "out"
    assert_refused(megatron_to_hf.main, ["--load-dir", str(save), "--save-dir", str(out), "--no-progress"], capsys,
                   match, out=out, inputs=[save])
