"""The training data over a run's steps: data stages (nanotron's `data_stages`), each drawing samples from its
own source from its start step until the next stage's.

A stage counts its own samples from 0 at the step it starts: its first step reads the stage's global samples
0 .. B-1 (B the global batch), whatever the stages before it read. A dataset that an earlier stage drew from
continues where that stage left it, in the same permutation stream: a decay stage that mixes the pretraining
corpus with new data does not repeat the pretraining samples already seen (nanotron offsets such folders by
the tokens earlier stages consumed, for the same reason).

Where the run is in its stages is a record in the train state (and so in every checkpoint): each stage
entered, with its first step and the global samples consumed before it (`StageStart`). A resumed run
rebuilds every skip count from that record, so it continues in the right stage at the right sample.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

from femtotron.config import Config
from femtotron.config.sections import DataSource, stage_end
from femtotron.data.nanoset import Dataset, Nanoset, open_nanoset
from femtotron.data.synthetic import SyntheticTokens
from femtotron.data.text_cache import tokenized_spec
from femtotron.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class StageStart:
    """A stage the run entered: its name, its first step, and the global samples consumed before it."""

    name: str
    step: int
    samples: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "step": self.step, "samples": self.samples}

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> StageStart:
        return cls(name=str(record["name"]), step=int(record["step"]), samples=int(record["samples"]))


def open_source(source: DataSource, config: Config, seed: int) -> Nanoset:
    """The samples of one source: tokenized datasets blended by weight, text tokenized at start, or random
    tokens."""
    sequence_length = config.tokens.sequence_length
    if source.synthetic:
        vocab_size = config.model.model_config_.vocab_size
        return Nanoset([SyntheticTokens(vocab_size, seed)], None, sequence_length, seed)
    if source.text_dataset is not None:
        return open_nanoset(tokenized_spec(source, config), sequence_length, seed)
    return open_nanoset(source.dataset_folder, sequence_length, seed)


def _identity(dataset: Dataset) -> str:
    """The same dataset in two stages: the same files, however the path to them is written."""
    return (
        dataset.path_prefix if isinstance(dataset, SyntheticTokens) else os.path.realpath(dataset.path_prefix)
    )


class DataStages:
    """Every stage's samples, all opened at start: a wrong path in a late stage fails before step 1."""

    def __init__(self, config: Config) -> None:
        self.stages = config.data.stage_list()
        self.nanosets = [open_source(stage, config, stage.seed) for stage in self.stages]

    def index_at(self, step: int) -> int:
        """The stage step `step` (counted from 1) trains on."""
        return bisect_right([stage.start_training_step for stage in self.stages], step) - 1

    def nanoset_of(self, name: str, what: str) -> Nanoset:
        names = [stage.name for stage in self.stages]
        if name not in names:
            raise ConfigError(
                f"{what} names data stage {name!r}, which data.stages no longer lists ({', '.join(names)}): "
                "the run's place in its data depends on it. Restore that stage as it was, or start a new run."
            )
        return self.nanosets[names.index(name)]

    def continued(self, index: int, history: list[StageStart]) -> Nanoset:
        """Stage `index`'s samples, its datasets continuing where the stages before it in `history` (whose
        last entry is this stage) left them."""
        base = self.nanosets[index]
        streams = list(base.streams)
        skip = [0] * len(base.datasets)
        position = {_identity(dataset): d for d, dataset in enumerate(base.datasets)}
        for earlier, following in zip(history[:-1], history[1:], strict=True):
            nanoset = self.nanoset_of(earlier.name, "the run's record of its data stages")
            drawn = nanoset.draws(following.samples - earlier.samples)
            for dataset, stream, count in zip(nanoset.datasets, nanoset.streams, drawn, strict=True):
                d = position.get(_identity(dataset))
                if d is None or count == 0:
                    continue
                if skip[d] == 0:  # the first stage that drew it: its stream is the dataset's from then on
                    streams[d] = stream
                skip[d] += count
        return Nanoset(
            base.datasets, base.weights, base.sequence_length, base.seed, streams=streams, skip=skip
        )

    def resumed(self, history: list[StageStart], step: int) -> list[StageStart]:
        """The stage record of a run resumed after `step` steps, checked against the stages of the config: it
        goes on in the stage its checkpoint was in, or starts the next one now, never one that started
        earlier (its samples would begin mid-way). A checkpoint written before stages has one: the first."""
        if not history:
            history = [StageStart(name=self.stages[0].name, step=1, samples=0)]
        for entry in history:
            self.nanoset_of(entry.name, f"the checkpoint (step {step})")
        stage = self.stages[self.index_at(step + 1)]
        last = history[-1]
        if stage.name != last.name and stage.start_training_step != step + 1:
            raise ConfigError(
                f"the checkpoint was saved after step {step}, in data stage {last.name!r} (from step "
                f"{last.step}); the config puts step {step + 1} in stage {stage.name!r}, which starts at "
                f"step {stage.start_training_step}, before the checkpoint: that stage never started, so "
                f"where its samples begin is unknown. Fix: set its start_training_step to {step + 1} (it "
                "starts now), or later."
            )
        return history

    def planned(self, global_batch_size: int) -> list[StageStart]:
        """The stage record of an uninterrupted run with this batch: every stage entered at its step."""
        return [
            StageStart(
                name=stage.name,
                step=stage.start_training_step,
                samples=(stage.start_training_step - 1) * global_batch_size,
            )
            for stage in self.stages
        ]

    def describe(self, index: int, nanoset: Nanoset) -> str:
        """A stage's name, steps and datasets, with where each continues, for the log."""
        stage = self.stages[index]
        end = stage_end(self.stages, index)
        last = "the end" if end is None else str(end)
        parts = []
        for dataset, weight, skip in zip(nanoset.datasets, nanoset.weights, nanoset.skip, strict=True):
            share = f" ({weight:.0%})" if len(nanoset.datasets) > 1 else ""
            after = f", continuing after the {skip:,} samples earlier stages drew" if skip else ""
            parts.append(f"{dataset.path_prefix}{share}{after}")
        return (
            f"data stage {index + 1} of {len(self.stages)}, {stage.name!r} (steps "
            f"{stage.start_training_step} to {last}): {'; '.join(parts)}"
        )
