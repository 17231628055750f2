"""When a run saves, and what it does with a save: the checkpoint policy the trainer calls into.

The trainer makes one call at each point of a run: `resume` before step 1, `save_initial_state` before the
first step, `after_step` after each, `on_stop` when a stop signal came, `at_end` after the last step and
`abandon` when training failed. Whether a save is written before training goes on (serialize/saving.py) or
by a background writer while it does (checkpoints.async_save, serialize/background.py) is decided here, and
each committed save is logged here with how long training stopped for it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import NoReturn

from femtotron.errors import TrainingInterrupted
from femtotron.serialize import saving
from femtotron.serialize.background import BackgroundSaves, Written, check_host_memory
from femtotron.serialize.restore import load
from femtotron.serialize.resume_source import agreed_resume_source
from femtotron.serialize.weights import save_weights, write_tokenizer
from femtotron.stop_signals import signal_name
from femtotron.train_state import TrainingParts


class CheckpointManager:
    """The saves of one rank's run: every rank makes the same calls at the same steps."""

    def __init__(self, parts: TrainingParts) -> None:
        self.parts = parts
        self.settings = parts.config.checkpoints
        self.background = BackgroundSaves(parts.ctx) if self.settings.async_save else None
        self.last_saved: int | None = None  # the step whose state is on disk
        self.last_checkpoint: Path | None = None

    def resume(self) -> str | None:
        """Before step 1: fail now on a checkpoints path that cannot be written (or, saving in the background,
        a host without room to stage a save), load the checkpoint the run resumes from, take the staging
        buffers. Returns the line that says what was resumed, for the log after the start report."""
        parts = self.parts
        state = parts.state
        # A read-only or full disk fails now, not at the first save after minutes of training.
        if self.settings.checkpoint_interval or self.settings.save_initial_state:
            saving.check_writable(parts)
            if self.background is not None:
                check_host_memory(parts)
        path, what, warnings = agreed_resume_source(parts.config, parts.ctx)
        for warning in warnings:
            parts.log.warn(warning)
        resumed = None
        if path is not None:
            resumed, self.last_checkpoint = load(parts, path, what)
            state.stages = parts.data.resumed(state.stages, state.step)
            self.last_saved = state.step  # that state is on disk already
        if self.background is not None and self.settings.checkpoint_interval:
            self.background.reserve(parts)
        return resumed

    def save_initial_state(self) -> None:
        """checkpoints.save_initial_state: step 0's checkpoint, before the first step of a run not resumed."""
        if self.settings.save_initial_state and self.parts.state.step == 0:
            self.save()

    def after_step(self) -> None:
        """Log a background save that finished meanwhile; save every checkpoints.checkpoint_interval steps."""
        if self.background is not None:
            self.report(self.background.finished())
        interval = self.settings.checkpoint_interval
        if interval and self.parts.state.step % interval == 0:
            self.save()

    def on_stop(self, signum: int) -> NoReturn:
        """Some rank got SIGTERM, SIGUSR1 or Ctrl-C: save a checkpoint (unless this step's is saved), then
        stop."""
        step = self.parts.state.step
        if self.last_saved != step:
            self.save()
        if self.background is not None:
            self.report(self.background.wait())
        path = self.last_checkpoint
        raise TrainingInterrupted(
            f"{signal_name(signum)} received: stopped after step {step} and saved checkpoint "
            f"{path}. Run the same command again to resume from it (checkpoints.auto_resume); another run "
            f"resumes it with checkpoints.resume_checkpoint_path={path.parent}."
        )

    def at_end(self) -> None:
        """After the last step: its checkpoint unless saved, the final weights (checkpoints.save_final_state),
        and the last background save waited for."""
        parts = self.parts
        if self.settings.checkpoint_interval and self.last_saved != parts.state.step:
            self.save()
        if self.settings.save_final_state:
            save_weights(parts.ctx, parts.model, parts.config.run_dir, parts.log)
            if parts.ctx.rank == 0:
                write_tokenizer(parts.config.run_dir, parts.tokenizer)
        if self.background is not None:  # the last save was written while the weights were
            self.report(self.background.wait())

    def abandon(self) -> None:
        """Training failed: leave a background write unfinished after the collective timeout."""
        if self.background is not None:
            self.background.abandon()

    def save(self) -> None:
        """Save this step's checkpoint: whole, or (checkpoints.async_save) once the previous background save
        is done, its values copied for the background writer."""
        parts = self.parts
        start = time.perf_counter()
        if self.background is None:
            path = saving.save(parts)
            seconds = time.perf_counter() - start
            written = Written(path=path, step=parts.state.step, stall_seconds=seconds, write_seconds=seconds)
            self.report(written)
        else:
            self.report(self.background.wait())
            stall = self.background.start(parts)
            mib = self.background.staging.bytes() / 2**20
            parts.log.info(
                f"checkpoint of step {parts.state.step}: training stopped {stall:.2f} s to copy "
                f"{mib:,.1f} MiB for the background writer"
            )
        parts.ctx.comm.take_seconds()  # the save's store and barrier time is not part of any training step
        self.last_saved = parts.state.step

    def report(self, written: Written | None) -> None:
        """Log a committed checkpoint, and record how long training stopped for it and how long the write
        took in metrics.jsonl (at the current step: the dashboards take steps in order)."""
        if written is None:
            return
        parts = self.parts
        self.last_checkpoint = written.path
        for warning in written.warnings:
            parts.log.warn(warning)
        mib = sum(f.stat().st_size for f in written.path.iterdir()) / 2**20 if parts.ctx.rank == 0 else 0
        how = f"in {written.write_seconds:.1f} s"
        if self.background is not None:
            how = (
                f"written in the background in {written.write_seconds:.1f} s, training stopped "
                f"{written.stall_seconds:.2f} s"
            )
        parts.log.info(f"saved checkpoint {written.path} ({mib:,.1f} MiB {how})")
        parts.log.record(
            {
                "step": parts.state.step,
                "checkpoint_step": written.step,
                "checkpoint_stall_seconds": written.stall_seconds,
                "checkpoint_write_seconds": written.write_seconds,
            }
        )
