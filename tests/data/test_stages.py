"""Data stages (nanotron's data_stages): each stage's source from its start step, continued across a resume,
and a dataset shared by two stages continued rather than repeated; random tokens for throughput runs."""

import math
import os

import numpy as np
import pytest
from helpers import tokenize_with_datatrove, write_patterned_tokens, write_yaml

from femtotron.cli import main
from femtotron.config import load_config_dict
from femtotron.data.nanoset import Nanoset
from femtotron.data.stages import DataStages, StageStart
from femtotron.errors import ConfigError
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer

VOCAB = "model.model_config.vocab_size=448"  # the test tokenizer's 400 ids, padded
# A run cut short decays its learning rate over its own steps: constant, its steps are the longer run's.
CONSTANT_LR = "optimizer.learning_rate_scheduler.lr_decay_style=constant"


@pytest.fixture(scope="module")
def other_folder(tmp_path_factory, tokenizer_path):
    """A second datatrove folder, of other words: its samples are told apart from the first folder's."""
    folder = tmp_path_factory.mktemp("datatrove") / "other"
    return tokenize_with_datatrove(folder, tokenizer_path, ["pipeline", "tensor", "shard", "epoch"], seed=9)


def stage(name: str, start: int, folder) -> dict:
    return {"name": name, "start_training_step": start, "dataset_folder": folder}


def two_stages(tiny_config, first, second, run: str, *overrides: str, switch: int = 4):
    stages = [stage("stable", 1, str(first)), stage("decay", switch, str(second))]
    data = {"dataset_folder": None, "stages": stages}
    return tiny_config(f"general.run={run}", VOCAB, CONSTANT_LR, *overrides, data=data)


def saved_after(tiny_config, first, second, *, steps: int, switch: int = 4) -> str:
    """A two-stage run of `steps` steps that checkpoints at its end: the override that resumes from it."""
    trainer, _, _ = train(
        two_stages(
            tiny_config,
            first,
            second,
            "first",
            f"tokens.train_steps={steps}",
            f"checkpoints.checkpoint_interval={steps}",
            switch=switch,
        )
    )
    return f"checkpoints.resume_checkpoint_path={trainer.run_dir / 'checkpoints'}"


def train(config, console: bool = False):
    """The trainer, its losses and each step's sample rows as it read them; `console`: log to stdout."""
    trainer = Trainer(config, ParallelContext(), log_to_console=console)
    rows = []
    step_at = trainer.batches.step_at

    def recording(consumed):
        batches = step_at(consumed)
        rows.append([tuple(row.tolist()) for batch in batches for row in batch.inputs])
        return batches

    trainer.batches.step_at = recording
    losses = [result.loss for result in trainer.train()]
    return trainer, losses, rows


def test_each_stage_reads_its_own_folder_from_its_start_step(
    tiny_config, datatrove_folder, other_folder, capsys
):
    config = two_stages(tiny_config, datatrove_folder, other_folder, "staged", "tokens.train_steps=6")
    trainer, losses, rows = train(config, console=True)
    assert len(losses) == 6 and all(math.isfinite(loss) for loss in losses)
    nanosets = DataStages(config).nanosets
    first = {tuple(nanosets[0][g][:-1]) for g in range(400)}
    second = {tuple(nanosets[1][g][:-1]) for g in range(400)}
    for step, step_rows in enumerate(rows, start=1):
        assert set(step_rows) <= (first if step < 4 else second), step
    # the second stage starts at its own sample 0
    assert rows[3] == [tuple(trainer.train_data.nanosets[1][g][:-1].tolist()) for g in range(4)]
    assert [s.to_dict() for s in trainer.state.stages] == [
        {"name": "stable", "step": 1, "samples": 0},
        {"name": "decay", "step": 4, "samples": 12},
    ]
    log = capsys.readouterr().out
    assert "step 1: data stage 1 of 2, 'stable' (steps 1 to 3)" in log
    assert f"step 4: data stage 2 of 2, 'decay' (steps 4 to the end): {other_folder}" in log


@pytest.mark.parametrize("saved_at", [2, 3, 5])
def test_a_resumed_run_continues_in_the_right_stage_at_the_right_sample(
    tiny_config, datatrove_folder, other_folder, saved_at, capsys
):
    """Saved before the switch, just before it (the resumed run starts the new stage) and within it."""
    _, whole, whole_rows = train(
        two_stages(tiny_config, datatrove_folder, other_folder, "whole", "tokens.train_steps=6")
    )
    first, half, _ = train(
        two_stages(
            tiny_config,
            datatrove_folder,
            other_folder,
            f"first{saved_at}",
            f"tokens.train_steps={saved_at}",
            f"checkpoints.checkpoint_interval={saved_at}",
        )
    )
    saved = f"checkpoints.resume_checkpoint_path={first.run_dir / 'checkpoints'}"
    rest_config = two_stages(
        tiny_config, datatrove_folder, other_folder, f"rest{saved_at}", "tokens.train_steps=6", saved
    )
    resumed, rest, rest_rows = train(rest_config, console=True)
    assert half + rest == whole
    assert rest_rows == whole_rows[saved_at:]
    assert [s.name for s in resumed.state.stages] == ["stable", "decay"]
    if saved_at == 5:
        assert "step 6: continuing data stage 2 of 2, 'decay'" in capsys.readouterr().out


def test_a_stage_moved_before_the_checkpoint_or_removed_is_refused(
    tiny_config, datatrove_folder, other_folder
):
    saved = saved_after(tiny_config, datatrove_folder, other_folder, steps=2, switch=5)
    moved = two_stages(
        tiny_config, datatrove_folder, other_folder, "moved", "tokens.train_steps=6", saved, switch=2
    )
    with pytest.raises(ConfigError, match=r"set its start_training_step to 3 \(it starts now\), or later"):
        Trainer(moved, ParallelContext(), log_to_console=False).train()
    stages = [stage("renamed", 1, str(datatrove_folder))]
    renamed = tiny_config(
        "general.run=renamed", VOCAB, saved, data={"dataset_folder": None, "stages": stages}
    )
    with pytest.raises(ConfigError, match="names data stage 'stable', which data.stages no longer lists"):
        Trainer(renamed, ParallelContext(), log_to_console=False).train()
    starts_now = two_stages(
        tiny_config, datatrove_folder, other_folder, "now", "tokens.train_steps=3", saved, switch=3
    )
    trainer, losses, _ = train(starts_now)
    assert len(losses) == 1 and [s.to_dict() for s in trainer.state.stages][-1] == {
        "name": "decay",
        "step": 3,
        "samples": 8,
    }


def test_a_dataset_shared_by_two_stages_continues_where_the_first_left_it(tmp_path):
    """The decay stage blends the stable corpus with new data: its draws of the corpus follow the ones the
    stable stage made, so no sample comes twice before the corpus's epoch ends."""
    corpus = write_patterned_tokens(tmp_path / "corpus", documents=12, length=700)
    new = write_patterned_tokens(tmp_path / "new", documents=4, length=700, seed=1)
    stages = [
        {"name": "stable", "start_training_step": 1, "dataset_folder": corpus, "seed": 5},
        {"name": "decay", "start_training_step": 11, "dataset_folder": {corpus: 0.5, new: 0.5}, "seed": 6},
    ]
    config = load_config_dict(
        {"tokens": {"train_steps": 20, "sequence_length": 32}, "data": {"stages": stages}},
    )
    data = DataStages(config)
    history = data.planned(global_batch_size=10)
    assert history == [
        StageStart(name="stable", step=1, samples=0),
        StageStart(name="decay", step=11, samples=100),
    ]
    stable = data.continued(0, history[:1])
    decay = data.continued(1, history)
    assert decay.skip == [100, 0] and decay.streams[0] == stable.streams[0]
    seen = [stable.locate(g)[1] for g in range(100)]
    later = [index for dataset, index in map(decay.locate, range(100)) if dataset == 0]
    assert len(later) == 50 and not set(seen) & set(later)
    assert len(set(seen + later)) == 150  # an epoch of the corpus is 262 samples: none repeats


def draws_by_dataset(data: DataStages, global_batch_size: int, train_steps: int) -> dict[str, list[int]]:
    """Each dataset's samples (its own indices) in the order an uninterrupted run's stages draw them."""
    history = data.planned(global_batch_size)
    ends = [entry.samples for entry in history[1:]] + [train_steps * global_batch_size]
    drawn: dict[str, list[int]] = {}
    for index, (entry, end) in enumerate(zip(history, ends, strict=True)):
        nanoset = data.continued(index, history[: index + 1])
        for g in range(end - entry.samples):
            dataset, sample = nanoset.locate(g)
            drawn.setdefault(os.path.realpath(nanoset.prefixes[dataset]), []).append(sample)
    return drawn


def one_stream(prefix: str, seed: int, count: int) -> list[int]:
    """The first `count` draws of a dataset's permutation stream in a one-stage run of data seed `seed`."""
    nanoset = Nanoset([prefix], None, 32, seed)
    return [nanoset.locate(g)[1] for g in range(count)]


def test_a_dataset_in_three_stages_is_one_stream_over_all_of_them(tmp_path):
    """The third stage continued the corpus in the second stage's own stream (seed 6), not the stream the
    second stage itself continued (the first's, seed 5): samples the first two stages drew came again.
    The corpus over all three stages must be the first stage's stream, unbroken."""
    corpus = write_patterned_tokens(tmp_path / "corpus", documents=12, length=700)  # 262 samples
    stages = [
        {"name": name, "start_training_step": start, "dataset_folder": corpus, "seed": seed}
        for name, start, seed in [("stable", 1, 5), ("long", 6, 6), ("decay", 11, 7)]
    ]
    config = load_config_dict(
        {"tokens": {"train_steps": 15, "sequence_length": 32}, "data": {"stages": stages}}
    )
    drawn = draws_by_dataset(DataStages(config), global_batch_size=10, train_steps=15)
    samples = drawn[os.path.realpath(corpus)]
    assert len(set(samples)) == 150  # 150 draws within the corpus's first epoch of 262: none comes twice
    assert samples == one_stream(corpus, 5, 150)


def test_a_dataset_first_drawn_by_a_later_stage_continues_after_that_stage_s_draws(tmp_path):
    """The corpus enters at the second stage (after 50 samples of other data) and continues in the third:
    the third skipped the samples consumed before the second stage's start too (drawn 50 of the corpus,
    skipped 100), so 50 of its samples were never trained on. Each dataset over the run must be the stream of
    the stage that first drew it, unbroken."""
    corpus = write_patterned_tokens(tmp_path / "corpus", documents=12, length=700)  # 262 samples
    new = write_patterned_tokens(tmp_path / "new", documents=4, length=700, seed=1)  # 87 samples
    stages = [
        {"name": "warmup", "start_training_step": 1, "dataset_folder": new, "seed": 4},
        {"name": "stable", "start_training_step": 6, "dataset_folder": corpus, "seed": 5},
        {"name": "decay", "start_training_step": 11, "dataset_folder": {corpus: 0.5, new: 0.5}, "seed": 6},
    ]
    config = load_config_dict(
        {"tokens": {"train_steps": 15, "sequence_length": 32}, "data": {"stages": stages}}
    )
    data = DataStages(config)
    decay = data.continued(2, data.planned(global_batch_size=10))
    assert decay.skip == [50, 50]  # each dataset's draws before the decay stage: 50 apiece
    drawn = draws_by_dataset(data, global_batch_size=10, train_steps=15)
    assert drawn == {
        os.path.realpath(new): one_stream(new, 4, 75),
        os.path.realpath(corpus): one_stream(corpus, 5, 75),
    }


def test_stage_rules_name_the_field_and_the_fix():
    def problems(data):
        with pytest.raises(ConfigError) as caught:
            load_config_dict({"tokens": {"train_steps": 5}, "data": data})
        return [(p.fields, p.message) for p in caught.value.problems]

    late = problems({"stages": [stage("a", 2, "d")]})
    assert (
        late[0][0] == ("data.stages.0.start_training_step",) and "Fix: start_training_step: 1" in late[0][1]
    )
    order = problems({"stages": [stage("a", 1, "d"), stage("b", 4, "d"), stage("c", 3, "d")]})
    assert order[0][0] == ("data.stages.2.start_training_step", "data.stages.1.start_training_step")
    names = problems({"stages": [stage("a", 1, "d"), stage("a", 4, "d")]})
    assert names[0][0] == ("data.stages.1.name",)
    both = problems({"dataset_folder": "d", "stages": [stage("a", 1, "d")]})
    assert both[0][0] == ("data.stages", "data.dataset_folder")
    none = problems({"seed": 3})
    assert none[0][0] == ("data.dataset_folder",) and "synthetic: true" in none[0][1]
    two = problems({"dataset_folder": "d", "synthetic": True})
    assert two[0][0] == ("data.dataset_folder", "data.synthetic")
    empty_stage = problems({"stages": [{"name": "a", "start_training_step": 1}]})
    assert empty_stage[0][0] == ("data.stages.0.dataset_folder",)


def test_synthetic_tokens_train_and_say_so(tiny_config, capsys):
    data = {"dataset_folder": None, "synthetic": True}
    config = tiny_config("tokens.train_steps=2", "general.run=synthetic", data=data)
    trainer, losses, rows = train(config, console=True)
    vocab = config.model.model_config_.vocab_size
    assert all(abs(loss - math.log(vocab)) < 1.0 for loss in losses)
    tokens = np.array([row for step in rows for row in step])
    assert tokens.max() < vocab and len(np.unique(tokens)) > vocab // 2
    log = capsys.readouterr().out
    assert "data.synthetic: this run trains on random token ids" in log
    assert "random token ids uniform over the vocabulary" in log


def test_doctor_and_inspect_data_show_the_stages(
    tiny_config, datatrove_folder, other_folder, tmp_path, capsys
):
    config = two_stages(tiny_config, datatrove_folder, other_folder, "shown", "tokens.train_steps=6")
    path = write_yaml(config, tmp_path / "staged.yaml")
    assert main(["doctor", path, "--device", "H100"]) == 0
    out = capsys.readouterr().out
    assert (
        f"data stages:\n  'stable': steps 1 to 3, {datatrove_folder}, seed 1234\n  'decay': steps 4 to 6"
        in out
    )
    assert main(["inspect-data", path, "--n", "2"]) == 0
    out = capsys.readouterr().out
    assert "data stage 1 of 2, 'stable' (steps 1 to 3)" in out and "data stage 2 of 2, 'decay'" in out
    assert out.count("sample 0: ") == 2 and str(other_folder) in out


def test_doctor_names_each_stage_s_source_and_which_stage_trains_on_random_tokens(
    tiny_config, tokenizer_path, tmp_path, capsys
):
    text = tmp_path / "notes.jsonl"
    text.write_text('{"text": "a pipeline stage"}\n')
    stages = [
        {"name": "warm", "start_training_step": 1, "synthetic": True},
        {"name": "text", "start_training_step": 4, "text_dataset": str(text)},
    ]
    config = tiny_config(
        "general.run=sources",
        VOCAB,
        "tokens.train_steps=6",
        f"tokenizer.tokenizer_name_or_path={tokenizer_path}",
        data={"dataset_folder": None, "stages": stages},
    )
    assert main(["doctor", write_yaml(config, tmp_path / "sources.yaml"), "--device", "H100"]) == 0
    out = capsys.readouterr().out
    assert "'warm': steps 1 to 3, random tokens (synthetic), seed 1234" in out
    assert f"'text': steps 4 to 6, text {text} (tokenized at start), seed 1234" in out and "None" not in out
    # The warning names the stage, and a fix the stage rules allow (not data.dataset_folder: stages forbid).
    assert "data.stages.0.synthetic ('warm'): this run trains on random token ids" in out
    assert "Set data.stages.0.dataset_folder (or data.stages.0.text_dataset) instead" in out


def test_a_resume_in_a_later_stage_is_refused_when_an_earlier_stage_s_data_changed(
    tiny_config, datatrove_folder, other_folder
):
    """Where a later stage's datasets continue depends on what the earlier stages drew: another seed or
    dataset there would replay or skip samples with no word (exit 0 before the checkpoint recorded every
    stage)."""
    saved = saved_after(tiny_config, datatrove_folder, other_folder, steps=5)

    def resumed(earlier: dict, run: str):
        stages = [
            {**stage("stable", 1, str(datatrove_folder)), **earlier},
            stage("decay", 4, str(other_folder)),
        ]
        data = {"dataset_folder": None, "stages": stages}
        config = tiny_config(
            f"general.run={run}", VOCAB, CONSTANT_LR, "tokens.train_steps=6", saved, data=data
        )
        return Trainer(config, ParallelContext(), log_to_console=False)

    with pytest.raises(
        ConfigError, match=r"in data stage 'stable', which the run went through before: data\.seed"
    ):
        resumed({"seed": 7}, "seed").train()
    with pytest.raises(ConfigError, match=r"in data stage 'stable', .*: the contents of the datasets"):
        resumed({"dataset_folder": str(other_folder)}, "dataset").train()
    assert len(resumed({}, "same").train()) == 1  # unchanged: resumes


def test_every_earlier_stage_s_data_is_checked_on_a_resume_in_the_third(
    tiny_config, datatrove_folder, other_folder
):
    """Three stages, the checkpoint in the third: a change in the second (not only the first) is named."""

    def three_stages(run: str, *overrides: str, middle: dict):
        stages = [
            stage("stable", 1, str(datatrove_folder)),
            {**stage("mid", 3, str(other_folder)), **middle},
            stage("decay", 5, str(datatrove_folder)),
        ]
        data = {"dataset_folder": None, "stages": stages}
        return tiny_config(f"general.run={run}", VOCAB, CONSTANT_LR, *overrides, data=data)

    first, _, _ = train(
        three_stages("first", "tokens.train_steps=6", "checkpoints.checkpoint_interval=6", middle={})
    )
    assert [s.name for s in first.state.stages] == ["stable", "mid", "decay"]
    saved = f"checkpoints.resume_checkpoint_path={first.run_dir / 'checkpoints'}"
    changed = three_stages("changed", "tokens.train_steps=7", saved, middle={"seed": 7})
    with pytest.raises(
        ConfigError, match=r"in data stage 'mid', which the run went through before: data\.seed"
    ):
        Trainer(changed, ParallelContext(), log_to_console=False).train()
    _, losses, _ = train(three_stages("same", "tokens.train_steps=7", saved, middle={}))
    assert len(losses) == 1  # unchanged: resumes
