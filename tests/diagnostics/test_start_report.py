"""The start report's summary, for what the layout tests do not read (tests/parallel/ read its tp and cp
lines)."""

from __future__ import annotations

import pytest
from distributed import run_ranks

from femtotron.diagnostics import start_report
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer


def _layout_line(rank, config):
    ctx = ParallelContext(dp=2, ep=2, collective_timeout_seconds=60)
    trainer = Trainer(config, ctx, log_to_console=False)
    summary = start_report.summary(trainer.parts, "")
    ctx.close()
    return next(line for line in summary.splitlines() if line.startswith("layout:"))


@pytest.mark.distributed
def test_the_layout_line_names_expert_parallelism(tiny_config):
    """ep splits the dp x cp ranks' experts, so it is no factor of the world size, but a user reading the
    layout must see it."""
    config = tiny_config("parallelism.dp=2", "parallelism.ep=2", "model.model_config.moe.num_experts=4")
    line = run_ranks(_layout_line, 2, config)[0]
    assert line.startswith("layout: dp=2 tp=1 pp=1 (experts over ep=2) on 2 process(es) on 1 host(s)")


def test_the_report_names_async_checkpoints_and_their_host_memory(tiny_config):
    config = tiny_config("checkpoints.checkpoint_interval=2", "checkpoints.async_save=true")
    trainer = Trainer(config, ParallelContext(), log_to_console=False)
    summary = start_report.summary(trainer.parts, "")
    staging = trainer.model.data_parallel.state.checkpoint_bytes() / 2**20
    assert (
        "checkpoints: written in the background (checkpoints.async_save); staging buffers of "
        f"{staging:,.1f} MiB of host memory on this rank" in summary
    )
    assert "async_save" not in start_report.summary(Trainer(tiny_config(), ParallelContext()).parts, "")
