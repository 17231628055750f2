"""Training runs for the checkpoint tests (serialize/test_saving.py, test_restore.py, test_resume_source.py,
test_manager.py, test_background.py...): the tiny model trained, saved and resumed on any layout, and the
comparison of a resumed run with an uninterrupted one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from distributed import run_ranks
from helpers import full_masters, write_yaml

from femtotron.parallel.context import ParallelContext
from femtotron.parallel.tensor_parallel import full_tensor
from femtotron.trainer import Trainer

LAYERS = 4


def make(tiny_config, run, *more, dp=1, tp=1, pp=1, zero=0, steps=6, cp=1, ep=1):
    """The tiny model with 4 layers; the global batch is 16 samples of 32 tokens for every dp. The learning
    rate decays over 4 steps after the 2 of warm-up whatever train_steps is, so a run cut short follows the
    schedule of the whole run."""
    return tiny_config(
        f"general.run={run}",
        f"model.model_config.num_hidden_layers={LAYERS}",
        "optimizer.learning_rate_scheduler.lr_decay_steps=4",
        "model.model_config.num_key_value_heads=4",
        "tokens.micro_batch_size=2",
        f"tokens.batch_accumulation_per_replica={8 // dp}",
        f"tokens.train_steps={steps}",
        f"parallelism.dp={dp}",
        f"parallelism.tp={tp}",
        f"parallelism.pp={pp}",
        f"parallelism.cp={cp}",
        f"parallelism.ep={ep}",
        f"optimizer.zero_stage={zero}",
        "parallelism.dp_bucket_size_mb=0.02",
        "parallelism.collective_timeout_seconds=60",
        *more,
    )


def train(config, ctx):
    """Train; return the losses, every parameter gathered to full shape (from this rank's stages), and the
    samples each step read on this rank (as token rows, to check none is skipped or repeated)."""
    trainer = Trainer(config, ctx, log_to_console=False)
    seen = []
    step_at = trainer.batches.step_at

    # Every tp, pp and cp rank of a replica reads the same samples: count them once.
    def recording(consumed_samples):
        batches = step_at(consumed_samples)
        if ctx.tp_rank == 0 and ctx.pp_rank == 0 and ctx.cp_rank == 0:
            seen.append((trainer.state.step, [row.tolist() for batch in batches for row in batch.inputs]))
        return batches

    trainer.batches.step_at = recording
    losses = [r.loss for r in trainer.train()]
    ep = trainer.model.ep.group
    named = trainer.model.named_parameters()
    with trainer.model.whole_parameters(list(range(len(named)))):  # ZeRO-3: gathered to read them
        weights = {n: full_tensor(p, p.shard, trainer.tp, ep).float().clone() for n, p in named}
    masters = {
        n: full_tensor(m, p.shard, trainer.tp, ep).clone()
        for (n, p), m in zip(trainer.model.named_parameters(), full_masters(trainer.optimizer), strict=True)
    }
    return {"losses": losses, "weights": weights, "masters": masters, "seen": seen}


def ranks_train(rank, configs):
    """On every rank of a layout, run the configs one after the other."""
    par = configs[0].parallelism
    ctx = ParallelContext(par.dp, par.tp, par.pp, par.cp, par.ep, collective_timeout_seconds=60)
    out = [train(config, ctx) for config in configs]
    ctx.close()
    return out


def merged(per_rank, index):
    """One run's results over all ranks: losses (rank 0's), weights by name, samples per step."""
    weights = {}
    masters = {}
    seen = {}
    for rank in per_rank:
        weights.update(rank[index]["weights"])
        masters.update(rank[index]["masters"])
        for step, rows in rank[index]["seen"]:
            seen.setdefault(step, []).extend(rows)
    return per_rank[0][index]["losses"], weights, masters, {s: sorted(rows) for s, rows in seen.items()}


def whole_then_halves(tiny_config, prefix: str, *more: str, **layout):
    """On every rank of `layout`: 6 steps uninterrupted; 3 steps with a checkpoint; a resume of that
    checkpoint for 3 more (`more`: settings of all three). Returns the results and the checkpoint
    directory."""
    first = make(tiny_config, f"{prefix}first", "checkpoints.checkpoint_interval=3", *more, **layout, steps=3)
    saved = first.run_dir / "checkpoints"
    configs = [
        make(tiny_config, f"{prefix}whole", *more, **layout),
        first,
        make(tiny_config, f"{prefix}rest", f"checkpoints.resume_checkpoint_path={saved}", *more, **layout),
    ]
    world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)
    return run_ranks(ranks_train, world, configs, timeout=600), saved


def assert_the_resume_is_bit_exact(per_rank) -> None:
    """The halves of `whole_then_halves` are the whole run: losses, samples per step, weights, masters."""
    losses, weights, masters, seen = merged(per_rank, 0)
    first_losses, _, _, first_seen = merged(per_rank, 1)
    rest_losses, rest_weights, rest_masters, rest_seen = merged(per_rank, 2)
    assert first_losses + rest_losses == losses
    assert {**first_seen, **rest_seen} == seen  # the same samples in the same steps
    for name, weight in weights.items():
        assert torch.equal(rest_weights[name], weight), name
        assert torch.equal(rest_masters[name], masters[name]), name


def assert_one_process_continues(tiny_config, run: str, saved, per_rank, *more: str) -> None:
    """The checkpoint `saved` by `whole_then_halves`, resumed on one process without ZeRO, continues the
    uninterrupted run: its losses (up to summation order) and weights (`more`: the runs' settings)."""
    losses, weights, _, _ = merged(per_rank, 0)
    single = make(tiny_config, run, f"checkpoints.resume_checkpoint_path={saved}", *more)
    single_losses, single_weights, _, _ = merged([ranks_train(0, [single])], 0)
    assert single_losses == pytest.approx(losses[3:], rel=1e-5)
    for name, weight in weights.items():
        assert (single_weights[name] - weight).abs().max() <= 1e-4 * weight.abs().max(), name


def checkpointed_run(tiny_config, run, *more):
    """`make`'s 4 steps with a checkpoint every 2, trained; returns its checkpoints directory."""
    config = make(tiny_config, run, "checkpoints.checkpoint_interval=2", *more, steps=4)
    Trainer(config, ParallelContext(), log_to_console=False).train()
    return config.run_dir / "checkpoints"


def crashing_train(config, tmp_path, point):
    """`femtotron train` in a process of its own, SIGKILLed at crash point `point`."""
    env = {**os.environ, "FEMTOTRON_CRASH_AT": point, "OMP_NUM_THREADS": "1"}
    died = subprocess.run(
        [sys.executable, "-m", "femtotron", "train", write_yaml(config, tmp_path / f"{point}.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert died.returncode == -signal.SIGKILL, died.stdout + died.stderr
