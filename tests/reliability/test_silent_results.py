"""Flags that used to be ignored with exit 0 (issue 26): a precision --format modelopt cannot express and a
--tokenizer-dir without a tokenizer are one named line and exit 2, before anything is read or written."""

import re

import pytest

from quads_megatron.convert import cli, rollout_export
from tests.convert.convert_fixtures import save_tiny_hf


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return save_tiny_hf(tmp_path_factory.mktemp("silent") / "hf")


def _refused(argv, capsys, match):
    capsys.readouterr()
    rc = cli.run(rollout_export.main, argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2, lines
    assert len(lines) == 1 and re.search(match, lines[0]), lines


@pytest.mark.parametrize("flag, value", [("--rollout-precision", "w4a4_rac"), ("--rollout-precision", "w4a16"),
                                         ("--rollout-precision", "quads"), ("--activation-scaling", "per_token"),
                                         ("--rac-channels", "16")])
def test_modelopt_format_refuses_what_it_cannot_express(flag, value, hf, tmp_path, capsys):
    out = tmp_path / "out"
    _refused(["--load-dir", str(hf), "--save-dir", str(out), "--format", "modelopt", flag, value, "--no-progress"],
             capsys, rf"{flag} {'(quads|w4a4_rac)' if value == 'quads' else value}: --format modelopt cannot express it")
    assert not out.exists()


@pytest.mark.parametrize("flag, value", [("--rollout-precision", "w4a4"), ("--activation-scaling", "static")])
def test_modelopt_format_accepts_what_it_stores(flag, value, hf, tmp_path):
    out = tmp_path / "out"
    assert cli.run(rollout_export.main, ["--load-dir", str(hf), "--save-dir", str(out), "--format", "modelopt",
                                         flag, value, "--no-progress", "--dry-run"]) == 0


@pytest.mark.parametrize("case", ["missing", "empty"])
def test_exporter_tokenizer_dir_without_a_tokenizer_is_named(case, hf, tmp_path, capsys):
    tok = tmp_path / "tok"
    if case == "empty":
        tok.mkdir()
    out = tmp_path / "out"
    _refused(["--load-dir", str(hf), "--save-dir", str(out), "--tokenizer-dir", str(tok), "--no-progress"], capsys,
             rf"--tokenizer-dir {re.escape(str(tok))}: (no such directory|holds no tokenizer)")
    assert not out.exists()
