"""The one output writer (``quads_megatron.output_dir``) as every CLI uses it (issue 26, "Lost data"; issue 23
item 4): a second writer of the same output exits 2 naming the holder, ``--force`` replaces only what this
project wrote, an output that is, contains or lies inside an input is refused, and the temporaries of a
writer killed mid-write are removed by the next run.

Each case plants its facts (a user's file, a process holding the lock, a killed child) with the standard
library and checks exit codes, messages and the file tree with hashlib, not with the code under test.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quads_megatron.apps import pretrain
from quads_megatron.convert import cli, rollout_export
from quads_megatron.errors import run_cli
from quads_megatron.integrity import MANIFEST
from quads_megatron.rl.loop import PROG
from tests.convert.convert_fixtures import save_tiny_hf
from tests.reliability.test_converters import _start, _tool_argv, leftovers, tree_hash

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rl"))
from tiny_flags import TINY  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
           PYTHONWARNINGS="ignore")
EXPORT = ["--rollout-precision", "w4a16", "--no-progress"]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return save_tiny_hf(tmp_path_factory.mktemp("outdir") / "hf")


def _run(main, argv, capsys, prog=None):
    """(exit code, stderr lines) of a CLI's main through the project's one error path."""
    capsys.readouterr()
    rc = run_cli(main, argv, prog=prog) if prog else cli.run(main, argv)
    return rc, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


# ---------------------------------------------------------------- a second writer of the same output

_HOLDER = """import sys, time
sys.argv = ["holder-of-the-lock"]
from quads_megatron.output_dir import output_lock
with output_lock({out!r}, flag={flag!r}):
    open({mark!r}, "w").close()
    time.sleep(120)
"""


def _hold_lock(tmp_path, out, flag="--save-dir"):
    """A separate process that holds the output's lock (as a converter mid-write would) until killed."""
    mark = tmp_path / "holding"
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER.format(out=str(out), flag=flag, mark=str(mark)))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not mark.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        time.sleep(0.05)
    return proc


def test_second_export_to_an_output_being_written_exits_2_naming_the_writer(tmp_path, hf, capsys):
    """Two real exports of the same --save-dir: the second stops at once, names the first's pid, and the
    first one's result is the one that lands."""
    out = tmp_path / "out"
    first = _start(tmp_path, "export", _tool_argv("export", hf, None, out))   # slowed mid-write
    try:
        t0 = time.perf_counter()
        rc, err = _run(rollout_export.main, ["--load-dir", str(hf), "--save-dir", str(out), *EXPORT], capsys)
        assert time.perf_counter() - t0 < 30
        assert rc == 2 and len(err) == 1, err
        assert re.search(rf"--save-dir {re.escape(str(out))}: another writer holds it \(pid {first.pid} on ", err[0]), err
        assert not out.exists()
    finally:
        first.kill()
        first.communicate(timeout=30)


def test_second_grpo_run_on_a_save_directory_in_use_exits_2_naming_the_holder(tmp_path, capsys):
    from quads_megatron.rl.loop import main

    save = tmp_path / "ck"
    holder = _hold_lock(tmp_path, save, flag="--save")
    try:
        rc, err = _run(main, TINY + ["--tensorboard-dir", str(tmp_path / "tb"), "--save", str(save)], capsys,
                       prog=PROG)
        assert rc == 2 and len(err) == 1, err
        assert f"--save {save}: another writer holds it (pid {holder.pid} on " in err[0], err
        assert "holder-of-the-lock" in err[0], err
    finally:
        holder.kill()
        holder.communicate(timeout=30)


def test_the_lock_goes_with_its_holder(tmp_path, hf, capsys):
    """A holder killed with SIGKILL leaves its lock file; the next writer takes it, writes, and removes it."""
    out = tmp_path / "out"
    holder = _hold_lock(tmp_path, out)
    holder.kill()
    holder.communicate(timeout=30)
    assert (tmp_path / ".out.lock").exists()
    rc, err = _run(rollout_export.main, ["--load-dir", str(hf), "--save-dir", str(out), *EXPORT], capsys)
    assert rc == 0, err
    assert leftovers(out) == ["out"] and (out / MANIFEST).is_file()


# ---------------------------------------------------------------- --force replaces only what we wrote

def _user_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "thesis.tex").write_text("four years of work\n")
    (path / "data").mkdir()
    (path / "data" / "runs.csv").write_text("1,2,3\n")
    return path


def test_force_refuses_a_directory_of_user_files_and_names_them(tmp_path, hf, capsys):
    out = _user_dir(tmp_path / "out")
    before = tree_hash(out)
    rc, err = _run(rollout_export.main, ["--load-dir", str(hf), "--save-dir", str(out), "--force", *EXPORT], capsys)
    assert rc == 2 and len(err) == 1, err
    assert "--force replaces only a directory this project wrote" in err[0] and "'thesis.tex'" in err[0] \
        and "'data/'" in err[0], err
    assert tree_hash(out) == before and leftovers(out) == ["out"]


def test_force_replaces_our_own_output_and_an_empty_directory(tmp_path, hf, capsys):
    out = tmp_path / "out"
    out.mkdir()                                   # empty: replaceable
    argv = ["--load-dir", str(hf), "--save-dir", str(out), "--force", *EXPORT]
    assert _run(rollout_export.main, argv, capsys)[0] == 0
    first = json.loads((out / MANIFEST).read_text())["files"]
    assert "model.safetensors" in first or any(k.endswith(".safetensors") for k in first)
    (out / "stale-marker").write_text("x")        # ours (manifest) with an extra file: still ours, replaced whole
    assert _run(rollout_export.main, argv, capsys)[0] == 0
    assert not (out / "stale-marker").exists() and leftovers(out) == ["out"]


def test_pretrain_force_refuses_a_user_directory_before_training(tmp_path, capsys):
    save = _user_dir(tmp_path / "save")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("x = 1\n" * 3000)
    before = tree_hash(save)
    t0 = time.perf_counter()
    rc, err = _run(pretrain.main, ["--preset", "tiny", "--data-path", str(corpus), "--train-iters", "1", "--save",
                                   str(save), "--force", "--no-progress"], capsys, prog="quads-pretrain")
    assert rc == 2 and len(err) == 1 and "--save " in err[0] and "'thesis.tex'" in err[0], err
    assert time.perf_counter() - t0 < 20
    assert tree_hash(save) == before


def test_grpo_force_refuses_a_save_directory_with_user_files(tmp_path, capsys):
    from quads_megatron.rl.arguments import parse_args

    save = _user_dir(tmp_path / "ck")
    (save / "latest_checkpointed_iteration.txt").write_text("3\n")
    before = tree_hash(save)
    rc, err = _run(parse_args, TINY + ["--tensorboard-dir", str(tmp_path / "tb"), "--save", str(save), "--force"],
                   capsys, prog=PROG)
    assert rc == 2 and len(err) == 1, err
    assert "--force starts over only in a directory a GRPO run wrote" in err[0] and "'thesis.tex'" in err[0], err
    assert "latest_checkpointed_iteration.txt" not in err[0]   # the tracker is ours: not named as foreign
    assert tree_hash(save) == before


# ---------------------------------------------------------------- outputs that are inputs

def test_pretrain_save_inside_its_training_data_is_refused(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.py").write_text("x = 1\n" * 3000)
    before = tree_hash(data)
    for save in (data, data / "ckpt"):
        rc, err = _run(pretrain.main, ["--preset", "tiny", "--data-path", str(data), "--save", str(save), "--force",
                                       "--no-progress"], capsys, prog="quads-pretrain")
        assert rc == 2 and len(err) == 1 and f"--save {save} overlaps --data-path {data}" in err[0], err
    assert tree_hash(data) == before


@pytest.mark.parametrize("which", ["task", "recipe", "eval"])
def test_grpo_summary_json_over_an_input_is_refused(which, tmp_path, capsys):
    from quads_megatron.rl.arguments import parse_args

    task = tmp_path / "task.jsonl"
    task.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")
    recipe = tmp_path / "recipe.json"
    recipe.write_text("{}")
    target = {"task": task, "recipe": recipe, "eval": evals}[which]
    extra = {"task": ["--task", str(task)], "recipe": ["--quads-recipe", str(recipe)],
             "eval": ["--task", str(task), "--eval-data", str(evals)]}[which]
    flag = {"task": "--task", "recipe": "--quads-recipe", "eval": "--eval-data"}[which]
    before = target.read_bytes()
    rc, err = _run(parse_args, TINY + ["--tensorboard-dir", str(tmp_path / "tb"), *extra, "--summary-json",
                                       str(target)], capsys, prog=PROG)
    assert rc == 2 and len(err) == 1 and f"--summary-json {target} overlaps {flag} {target}" in err[0], err
    assert target.read_bytes() == before


@pytest.mark.parametrize("flag", ["--save", "--tensorboard-dir"])
def test_grpo_outputs_inside_the_initial_checkpoint_are_refused(flag, tmp_path, hf, capsys):
    from quads_megatron.rl.arguments import parse_args

    before = tree_hash(hf)
    argv = TINY + ["--hf-checkpoint", str(hf), "--tensorboard-dir", str(tmp_path / "tb"), flag, str(hf / "run")]
    rc, err = _run(parse_args, argv, capsys, prog=PROG)
    assert rc == 2 and len(err) == 1 and f"{flag} {hf / 'run'} overlaps --hf-checkpoint {hf}" in err[0], err
    assert tree_hash(hf) == before


def test_export_save_dir_holding_the_recipe_is_refused_even_with_force(tmp_path, hf, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "recipe.json").write_text(json.dumps({"rollout_precision": "w4a16"}))
    before = tree_hash(out)
    rc, err = _run(rollout_export.main, ["--load-dir", str(hf), "--save-dir", str(out), "--quads-recipe",
                                         str(out / "recipe.json"), "--force", "--no-progress"], capsys)
    assert rc == 2 and len(err) == 1 and f"--save-dir {out} overlaps --quads-recipe" in err[0], err
    assert tree_hash(out) == before


# ---------------------------------------------------------------- a writer killed mid-write

_KILLED = """import os, sys
sys.argv = ["killed-writer"]
from quads_megatron.output_dir import atomic_output_dir
with atomic_output_dir({out!r}, force=True) as tmp:
    (tmp / "model.safetensors").write_bytes(b"half a checkpoint")
    os._exit(9)                      # no cleanup handler runs: as a SIGKILL or a power loss would leave it
"""

_KILLED_SAVE = """import os, signal, sys
from pathlib import Path
sys.argv = ["killed-grpo"]
from quads_megatron.output_dir import atomic_output_dir
from quads_megatron.rl.loop import claim_save_dir
save = Path({save!r})
with claim_save_dir(save), atomic_output_dir(save / {name!r}, force=True, flag="--save", lock=False) as tmp:
    (tmp / "common.pt").write_bytes(b"half an iteration")
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _partials(directory: Path) -> list:
    return sorted(p.name for p in directory.iterdir() if ".partial-" in p.name)


def test_a_writer_killed_mid_write_leaves_its_temporary_and_the_next_run_removes_it(tmp_path, hf, capsys):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-c", _KILLED.format(out=str(out))], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 9, p.stderr
    assert not out.exists() and len(_partials(tmp_path)) == 1 and _partials(tmp_path)[0].startswith(".out.partial-")
    rc, err = _run(rollout_export.main, ["--load-dir", str(hf), "--save-dir", str(out), *EXPORT], capsys)
    assert rc == 0, err
    assert leftovers(out) == ["out"] and (out / MANIFEST).is_file()


@pytest.mark.parametrize("name", ["iter_0000003", "hf"])
def test_grpo_iteration_and_hf_copy_killed_mid_write_are_removed_by_the_next_run(name, tmp_path):
    """What used to survive a kill as ``iter_N.tmp`` / ``hf.tmp``: the next run on --save removes it, whichever
    iteration it was (the next run need not write the same one)."""
    from quads_megatron.rl.loop import claim_save_dir

    save = tmp_path / "ck"
    p = subprocess.run([sys.executable, "-c", _KILLED_SAVE.format(save=str(save), name=name)], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert [n.split(".partial-")[0] for n in _partials(save)] == [f".{name}"]
    assert (tmp_path / ".ck.lock").exists()           # the dead run's lock file: taken over below
    with claim_save_dir(save):
        assert _partials(save) == [] and list(save.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
