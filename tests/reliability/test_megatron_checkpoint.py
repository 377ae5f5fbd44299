"""Megatron dist checkpoints (GRPO --save, the converters): every broken file is a named one-line CheckpointError.

One tiny iteration (model + AdamW + per-rank RNG state) is saved once per module through
``save_iteration``; each case copies it, breaks one thing, and loads it with ``load_iteration``
into a fresh tiny model. The expected file names come from the directory listing, the expected
hashes from hashlib, never from the code under test.
"""

import hashlib
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch

from quads_megatron.errors import CheckpointError, Interrupted
from quads_megatron.integrity import MANIFEST
from quads_megatron.megatron import build_gpt_model, initialize_distributed, qwen3_moe_config
from quads_megatron.megatron import checkpoint as mckpt
from tests.reliability.children import assert_gone, descendants, start_until_marked

ITER = "iter_0000001"


def _model(**overrides):
    return build_gpt_model(qwen3_moe_config("tiny", **overrides), 256, 16)


def _tree_hashes(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A save directory holding iteration 1 of the tiny model with AdamW state (saved once)."""
    initialize_distributed()
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    root = tmp_path_factory.mktemp("mckpt") / "save"
    mckpt.save_iteration(model, root, 1, opt, common={"note": "test"}, rank_state={"rng": mckpt.get_rng_state()})
    return root


@pytest.fixture
def copy(saved, tmp_path):
    """A fresh copy of the saved directory (the case breaks it) and its iteration directory."""
    root = tmp_path / "save"
    shutil.copytree(saved, root)
    return root, root / ITER


def _load(root, **overrides):
    model = _model(**overrides)
    return mckpt.load_iteration(model, root, torch.optim.AdamW(model.parameters()))


def _shard(it: Path) -> Path:
    return sorted(it.glob("*.distcp"))[0]


def _truncate(path: Path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path, offset=None, n=1):
    data = bytearray(path.read_bytes())
    start = len(data) // 2 if offset is None else offset
    for i in range(start, start + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _no_manifest(it: Path):
    (it / MANIFEST).unlink()


# ------------------------------------------------------------------ what the save writes

def test_save_is_atomic_and_lists_every_file_in_the_manifest(saved):
    it = saved / ITER
    assert sorted(p.name for p in saved.iterdir()) == [ITER, mckpt.TRACKER]  # no .tmp left behind
    assert (saved / mckpt.TRACKER).read_text().strip() == "1"
    files = json.loads((it / MANIFEST).read_text())["files"]
    on_disk = sorted(p.name for p in it.iterdir() if p.name != MANIFEST)
    assert sorted(files) == on_disk and {".metadata", "common.pt", "metadata.json"} <= set(on_disk)
    for name, entry in files.items():
        assert entry["sha256"] == hashlib.sha256((it / name).read_bytes()).hexdigest(), name
    assert _load(saved)["iteration"] == 1  # and it loads


def test_interrupted_save_leaves_no_iteration_and_keeps_the_tracker(copy):
    root, _ = copy

    class Bomb:
        """Pickled with the per-rank state, in the middle of the dist_checkpointing write."""

        def __reduce__(self):
            raise Interrupted(2)

    before = _tree_hashes(root)
    model = _model()
    with pytest.raises(Interrupted):
        mckpt.save_iteration(model, root, 2, torch.optim.AdamW(model.parameters()), rank_state={"x": Bomb()})
    assert _tree_hashes(root) == before  # no iter_0000002(.tmp), tracker still 1


def test_tracker_never_moves_backwards(copy):
    root, _ = copy
    (root / mckpt.TRACKER).write_text("5\n")
    (root / ITER).rename(root / "iter_0000005")
    before = _tree_hashes(root)
    with pytest.raises(CheckpointError, match="backwards"):
        mckpt.save_iteration(_model(), root, 3)
    assert _tree_hashes(root) == before


# ------------------------------------------------------------------ a save killed or interrupted mid-write (subprocess)

# The child saves iteration 1 through the real save_iteration under run_cli; only a delay is injected in the
# forked shard writer (so the signal lands mid-write), and a marker file says the write has begun.
_CHILD = """import sys, time
MARK, SAVE = {mark!r}, {save!r}
def slow(*a, **k):
    open(MARK, 'w').close(); time.sleep(120); return real(*a, **k)
def main(_):
    from quads_megatron.megatron import build_gpt_model, initialize_distributed, qwen3_moe_config
    from quads_megatron.megatron import checkpoint as mckpt
    initialize_distributed()
    mckpt.save_iteration(build_gpt_model(qwen3_moe_config("tiny"), 256, 16), SAVE, 1)
if __name__ == "__main__":   # (a spawned helper process imports this file)
    from megatron.core.dist_checkpointing.strategies import filesystem_async as m
    real = m.FileSystemWriterAsync.write_preloaded_data
    m.FileSystemWriterAsync.write_preloaded_data = staticmethod(slow)
    from quads_megatron.errors import run_cli
    sys.exit(run_cli(main, [], prog="save"))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_save_iteration_killed_mid_write_leaves_no_writer_and_no_iteration(sig, tmp_path):
    """No dist_checkpointing helper server or shard writer outlives the trainer's save (it would hold the
    pipes: ``communicate`` returns only once nobody does), and no iteration or tracker appears."""
    save, mark = tmp_path / "save", tmp_path / "writing"
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(mark=str(mark), save=str(save)))
    proc = start_until_marked(script, mark)
    children = descendants(proc.pid)
    assert children, "dist_checkpointing forked no writer (the case this test is about)"
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=30)
    assert_gone(children)
    assert proc.returncode == (-sig if sig == signal.SIGKILL else 128 + sig), err
    if sig != signal.SIGKILL:
        assert [ln for ln in err.splitlines() if ln.startswith("save:")] == [
            f"save: interrupted by {signal.Signals(sig).name}; partial output removed"] and "Traceback" not in err, err
    assert not (save / mckpt.TRACKER).exists() and not (save / ITER).exists()
    if sig != signal.SIGKILL:
        assert list(save.iterdir()) == []   # the partial iteration was removed
    else:   # nothing ran to clean up: the hidden partial iteration stays, and the next run on --save removes it
        from quads_megatron.rl.loop import claim_save_dir

        assert [p.name.split(".partial-")[0] for p in save.iterdir()] == [f".{ITER}"]
        with claim_save_dir(save):
            assert list(save.iterdir()) == []


# ------------------------------------------------------------------ broken checkpoints: one named error each

def _tracker(text):
    return lambda root, it: (root / mckpt.TRACKER).write_text(text)


CASES = {
    # name: (break it, the file the message must name, a phrase of the message)
    "flipped-byte-in-shard": (lambda root, it: _flip(_shard(it)), lambda it: _shard(it), "SHA-256"),
    "2000-flipped-bytes-in-shard": (lambda root, it: _flip(_shard(it), 64, 2000), lambda it: _shard(it), "SHA-256"),
    "truncated-shard": (lambda root, it: _truncate(_shard(it)), lambda it: _shard(it), "truncated"),
    "missing-shard": (lambda root, it: _shard(it).unlink(), None, "missing"),  # None: the deleted shard
    "truncated-.metadata": (lambda root, it: _truncate(it / ".metadata"), lambda it: it / ".metadata", "truncated"),
    "missing-.metadata": (lambda root, it: (it / ".metadata").unlink(), lambda it: it / ".metadata", "missing"),
    "corrupt-common.pt": (lambda root, it: _flip(it / "common.pt", 100, 50), lambda it: it / "common.pt", "SHA-256"),
    "metadata.json-not-json": (lambda root, it: (it / "metadata.json").write_text("{nope"),
                               lambda it: it / "metadata.json", "not valid JSON"),
    "metadata.json-wrong-keys": (lambda root, it: (it / "metadata.json").write_text('{"a": 1}'),
                                 lambda it: it / "metadata.json", "sharded_backend"),
    "empty-tracker": (_tracker(""), lambda it: it.parent / mckpt.TRACKER, "expected an iteration number"),
    "non-numeric-tracker": (_tracker("seven\n"), lambda it: it.parent / mckpt.TRACKER, "'seven'"),
    "tracker-to-missing-iteration": (_tracker("9\n"), lambda it: it.parent / "iter_0000009", "missing"),
    # a directory written by someone else (no manifest): the same files are still named
    "foreign-truncated-shard": (lambda root, it: (_no_manifest(it), _truncate(_shard(it))), lambda it: _shard(it),
                                "truncated"),
    "foreign-missing-shard": (lambda root, it: (_no_manifest(it), _shard(it).unlink()), None, "missing"),
    "foreign-truncated-.metadata": (lambda root, it: (_no_manifest(it), _truncate(it / ".metadata")),
                                    lambda it: it / ".metadata", "truncated or corrupt"),
    "foreign-missing-common.pt": (lambda root, it: (_no_manifest(it), (it / "common.pt").unlink()),
                                  lambda it: it / "common.pt", "missing"),
    "foreign-corrupt-common.pt": (lambda root, it: (_no_manifest(it), _truncate(it / "common.pt")),
                                  lambda it: it / "common.pt", "common.pt"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_broken_checkpoint_is_a_named_error(copy, case):
    root, it = copy
    shard_name = _shard(it).name  # before the case may delete it
    breaks, names, phrase = CASES[case]
    breaks(root, it)
    before = _tree_hashes(root)
    with pytest.raises(CheckpointError) as e:
        _load(root)
    msg = str(e.value)
    assert "\n" not in msg and phrase in msg, msg
    expected = str(names(it)) if names is not None else str(it / shard_name)
    assert expected in msg, msg
    assert _tree_hashes(root) == before  # the input is untouched


@pytest.mark.parametrize("overrides, key", [({"hidden_size": 32}, "(2, 64)"), ({"num_moe_experts": 8}, "(2, 4, 64)"),
                                            ({"num_layers": 3}, "(2, 64)")],
                         ids=["hidden-size", "num-experts", "num-layers"])
def test_model_config_that_disagrees_with_the_checkpoint(copy, overrides, key):
    root, it = copy
    with pytest.raises(CheckpointError) as e:
        _load(root, **overrides)
    msg = str(e.value)
    assert "\n" not in msg and str(it) in msg and key in msg and "global shape" in msg, msg


def test_common_state_readers_name_the_file(copy):
    """load_common_state (the converters' and the GRPO resume check's reader) fails the same way."""
    root, it = copy
    _no_manifest(it)
    _truncate(it / "common.pt")
    with pytest.raises(CheckpointError, match="common.pt"):
        mckpt.load_common_state(root)
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        mckpt.load_common_state(root / "nope")
