"""What the bench scripts share: random token data, a femtotron Trainer for a model shape, and ranks
started as separate processes (by the tests' launcher, tests/distributed.py)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' rank launcher
from distributed import RankFailed, run_ranks  # noqa: E402

from femtotron.config import load_config_dict
from femtotron.data.indexed import IndexedDatasetWriter
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer

MODEL_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


# The model and batch of examples/debug.yaml; scripts derive their shapes from it.
DEBUG_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 2048,
    "sequence_length": 128,
    "micro_batch_size": 16,
}
HEADLINE = "HEADLINE "  # the prefix of the lines `make bench` (bench/run_all.py) collects


def headline(figure: str, ours: float, baseline: float, number_format: str = ",.1f", unit: str = "") -> None:
    """One figure of the benchmark table: what, femtotron's value, the baseline's (measured in the same
    run), and their ratio, computed here from the two: the table's figures are always what its ratio is
    made of."""
    shown = {"ours": f"{ours:{number_format}}{unit}", "baseline": f"{baseline:{number_format}}{unit}"}
    print(HEADLINE + json.dumps({"figure": figure, **shown, "ratio": ours / baseline}))


def summary_headline(figure: str, measured: str, reference: str, ratio: float) -> None:
    """A ratio that summarises many cases (a median over them): the two columns say what was compared."""
    print(HEADLINE + json.dumps({"figure": figure, "ours": measured, "baseline": reference, "ratio": ratio}))


def median_pair(ours: list[float], baseline: list[float]) -> tuple[float, float]:
    """The two figures of the round whose ratio is the rounds' median (the lower middle for an even count).
    Rounds measured in turn pair off the machine's drift; showing one pair keeps the ratio theirs."""
    pairs = sorted(zip(ours, baseline, strict=True), key=lambda pair: pair[0] / pair[1])
    return pairs[(len(pairs) - 1) // 2]


def write_random_tokens(prefix: Path, vocab: int, tokens: int) -> None:
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(8):
        writer.add_document(rng.integers(1, vocab, tokens // 8, dtype=np.uint16))
    writer.finalize()


def shape_config(
    shape: dict,
    dtype: str,
    data_prefix: Path | str,
    run_dir: Path | str,
    run: str = "bench",
    **sections: dict,
):
    """A config for `shape` (the MODEL_KEYS plus sequence_length and micro_batch_size) trained on the tokens
    at `data_prefix`; `sections` are merged into theirs (model, parallelism, optimizer, tokens, ...)."""
    raw = {
        "general": {"run": run},
        "model": {
            "model_config": {
                **{k: shape[k] for k in MODEL_KEYS},
                "max_position_embeddings": shape["sequence_length"],
            },
            "dtype": dtype,
        },
        "tokens": {
            "sequence_length": shape["sequence_length"],
            "micro_batch_size": shape["micro_batch_size"],
            "train_steps": 10**6,
        },
        "data": {"dataset_folder": str(data_prefix)},
        "logging": {"output_dir": str(run_dir)},
        "checkpoints": {"save_final_state": False},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return load_config_dict(raw)


def shape_trainer(shape: dict, dtype: str, data_prefix: Path, run_dir: Path, **kwargs: Any) -> Trainer:
    """A one-process Trainer of `shape_config`."""
    return Trainer(
        shape_config(shape, dtype, data_prefix, run_dir, **kwargs), ParallelContext(), log_to_console=False
    )


def spawn_ranks(
    layout: dict[str, int], rank_fn: Callable, cases: list, args: Any, on_case: Callable[[Any, list], None]
) -> None:
    """Run one process per rank of `layout` (ParallelContext's dp/tp/pp) with the tests' launcher, each
    calling `rank_fn(ctx, cases, args, report)`, where `report(case index, value)` records a case's result;
    then call `on_case(case, values by rank)` for every case. `args.timeout` bounds each case."""

    def rank_main(rank: int) -> dict[int, Any]:
        values: dict[int, Any] = {}
        with ParallelContext(**layout, init_timeout_seconds=60, collective_timeout_seconds=300) as ctx:
            rank_fn(ctx, cases, args, values.__setitem__)
        return values

    try:
        per_rank = run_ranks(rank_main, math.prod(layout.values()), timeout=args.timeout * len(cases))
    except RankFailed as e:
        raise SystemExit(f"{layout}: {e}") from None
    for index, case in enumerate(cases):
        on_case(case, [values[index] for values in per_rank])
