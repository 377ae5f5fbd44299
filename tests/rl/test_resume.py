"""Checkpoint/resume: the resumed run continues bit-identically; a crash mid-step keeps the last checkpoint."""

import random

import pytest
import torch

from quads_megatron.megatron import checkpoint as mckpt
from quads_megatron.rl.arguments import parse_args
from quads_megatron.rl.loop import GRPOTrainer


def _run(argv, scramble_rng=False):
    """Run the GRPO job in-process; return the trainer (its policy), the summary and the final RNG states.

    scramble_rng: move the RNGs off the state the setup left them in, so only a restored RNG state
    (not a re-run of the same seeding) makes the final states equal.
    """
    trainer = GRPOTrainer(parse_args(argv))
    if scramble_rng:
        torch.manual_seed(987654321)
        random.seed(987654321)
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    return trainer, summary, (torch.get_rng_state(), random.getstate())


def test_resume_gives_identical_next_step(tiny_args, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    ta, a, rng_a = _run(tiny_args("--train-iters", "3", "--save", str(full), "--save-interval", "2", tb="a"))
    _run(tiny_args("--train-iters", "2", "--save", str(part), "--save-interval", "2", tb="b"))
    tb, b, rng_b = _run(tiny_args("--train-iters", "3", "--save", str(part), "--resume", tb="b"), scramble_rng=True)
    assert mckpt.latest_iteration(full) == mckpt.latest_iteration(part) == 3
    assert (full / "hf" / "config.json").is_file() and (full / "hf" / "tokenizer.json").is_file()
    assert (part / "iter_0000003" / "metadata.json").is_file()  # Megatron dist_checkpointing, Megatron's layout
    assert b["steps"] == 3 and a["history"] == b["history"]  # steps 1-2 from the checkpoint, step 3 identical
    # master weights, AdamW moments and steps, and the RNG stream: bit for bit after the resumed step
    ma, mb = ta.policy.model.state_dict(), tb.policy.model.state_dict()
    assert ma.keys() == mb.keys()
    for k, v in ma.items():
        if torch.is_tensor(v):
            assert torch.equal(v, mb[k]), k
    oa, ob = ta.policy.optimizer.state_dict()["state"], tb.policy.optimizer.state_dict()["state"]
    assert oa and oa.keys() == ob.keys()
    for i, st in oa.items():
        assert st.keys() == ob[i].keys()
        for k, v in st.items():
            assert torch.equal(v, ob[i][k]), (i, k)
    assert torch.equal(rng_a[0], rng_b[0]) and rng_a[1] == rng_b[1]


def test_crash_mid_step_keeps_last_checkpoint(tiny_args, tmp_path, monkeypatch):
    save = tmp_path / "ck"
    trainer = GRPOTrainer(parse_args(tiny_args("--train-iters", "4", "--save", str(save), "--save-interval", "1",
                                               "--eval-interval", "100")))
    real = trainer.engine.generate
    calls = {"n": 0}

    def flaky(prompts, params, seed):
        calls["n"] += 1
        if calls["n"] == 4:  # 1 = pass@1 before GRPO, 2-3 = steps 1-2, 4 = step 3
            raise RuntimeError("rollout server died")
        return real(prompts, params, seed)

    monkeypatch.setattr(trainer.engine, "generate", flaky)
    with pytest.raises(RuntimeError, match="rollout server died"):
        trainer.run()
    trainer.close()
    assert mckpt.latest_iteration(save) == 2
    assert sorted(p.name for p in save.iterdir()) == ["hf", "iter_0000001", "iter_0000002", mckpt.TRACKER]
    loop_state = mckpt.load_common_state(save)[GRPOTrainer.LOOP_STATE_KEY]
    assert loop_state["iteration"] == 2 and [h["step"] for h in loop_state["history"][1:]] == [1, 2]
