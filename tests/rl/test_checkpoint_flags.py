"""--save never loses data silently: it saves at the end without --save-interval, refuses to start over in a
directory that holds another run's checkpoint (unless --force), and never moves the tracker backwards."""

import pytest

from quads_megatron.errors import CheckpointError
from quads_megatron.megatron import checkpoint as mckpt
from quads_megatron.rl.arguments import build_parser, parse_args
from quads_megatron.rl.loop import GRPOTrainer, main, run


@pytest.mark.parametrize("interval", [[], ["--save-interval", "0"]], ids=["no-interval", "interval-0"])
def test_save_alone_saves_at_the_end(tiny_args, tmp_path, interval):
    save = tmp_path / "ck"
    main(tiny_args("--train-iters", "2", "--save", str(save), *interval))
    assert mckpt.latest_iteration(save) == 2
    assert sorted(p.name for p in save.iterdir()) == ["hf", "iter_0000002", mckpt.TRACKER]


def test_help_says_when_it_saves():
    text = " ".join(build_parser().format_help().split())
    assert "always at the end of training" in text and "--force" in text


def test_rerun_into_a_save_dir_with_a_checkpoint_is_refused(tiny_args, tmp_path, capsys):
    save = tmp_path / "ck"
    main(tiny_args("--train-iters", "3", "--save", str(save), "--save-interval", "1"))
    before = {p.name: p.stat().st_mtime_ns for p in save.iterdir()}
    capsys.readouterr()
    (tmp_path / "elsewhere").mkdir()
    for extra in ([], ["--load", str(tmp_path / "elsewhere")]):
        assert run(tiny_args("--train-iters", "2", "--save", str(save), *extra)) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert str(save) in err and "--resume" in err and "--force" in err and "iteration 3" in err
    assert {p.name: p.stat().st_mtime_ns for p in save.iterdir()} == before
    assert mckpt.latest_iteration(save) == 3
    # resuming it is fine (the same directory as --load, spelled --resume)
    assert parse_args(tiny_args("--train-iters", "4", "--save", str(save), "--resume")).load == str(save)

    # --force starts over: the old run's iterations go at the first new save, the tracker follows the new run
    trainer = GRPOTrainer(parse_args(tiny_args("--train-iters", "2", "--save", str(save), "--force")))
    try:
        trainer.run()
        assert mckpt.latest_iteration(save) == 2
        assert sorted(p.name for p in save.iterdir()) == ["hf", "iter_0000002", mckpt.TRACKER]
        # and the checkpoint layer itself never moves the tracker backwards
        with pytest.raises(CheckpointError, match="backwards"):
            trainer.policy.save_checkpoint(save, 1)
        assert mckpt.latest_iteration(save) == 2 and not (save / "iter_0000001").exists()
    finally:
        trainer.close()
