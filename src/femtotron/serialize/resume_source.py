"""Which checkpoint a run resumes from: the committed checkpoints of a directory, the one a path means, and
rank 0's choice given to every rank.

Which checkpoint a run starts from is `resume_source`'s choice. An explicit
`checkpoints.resume_checkpoint_path` wins, because a person who names a checkpoint means that one, even when
the run's own directory holds others (a warning says they are not resumed). Without it, the run's own
newest committed checkpoint is taken, so that a preempted, requeued or crashed job continues where it
stopped when the same command runs again. `checkpoints.auto_resume: false` starts from step 0 instead,
with a warning, because its saves will replace the old checkpoints of the same steps.

A checkpoints directory, given or the run's own, is read through its `latest` file (`resolve`). Only a
committed checkpoint counts: a step directory with its manifest, which appears by rename once the save is
complete (serialize/saving.py). A half-written `.tmp-step-*` is ignored with a warning, and when `latest`
is missing or names no committed checkpoint the newest committed one is taken, also with a warning; so is
one committed after the one `latest` names (a kill came before `latest` was updated: manifests record
`committed_at`). Links are not checkpoints, and a save removes a link at its temporary directory rather
than write through it: a run directory from elsewhere cannot send reads or writes outside it. Rank 0 alone
decides and tells every rank (`agreed_resume_source`), because on a shared file system another node may
not see the newest checkpoint yet.

`model.init_from` is not a resume source. It gives a new run its first weights at step 0
(serialize/init.py); when that run later resumes from its own checkpoint, the checkpoint's weights replace
them, so a requeued job does not start over from the initial weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from femtotron.config import Config
from femtotron.parallel.context import ParallelContext
from femtotron.serialize.files import MANIFEST, CheckpointError, read_manifest
from femtotron.serialize.weights import weights_present

LATEST = "latest"
# The resume source a person named: only its checkpoint may be loaded in part (load_optimizer=false, ...).
EXPLICIT = "checkpoints.resume_checkpoint_path"


def checkpoint_root(config: Config) -> Path:
    path = config.checkpoints.checkpoints_path
    return Path(path) if path is not None else config.run_dir / "checkpoints"


def step_name(path: Path) -> str:
    """step-NNNNNNN, also for the .old-step-NNNNNNN a re-commit of that step set aside."""
    return path.name.removeprefix(".old-")


def committed_checkpoints(root: Path) -> list[Path]:
    """The checkpoints under `root` that were committed (have a manifest), oldest step first: step-N, or
    the .old-step-N a re-commit of step N set aside if it was killed before step-N was back. Links are not
    taken: a run from elsewhere may not send reads and saves outside its directory."""
    found = {}
    for path in sorted(root.glob(".old-step-*")) + sorted(root.glob("step-*")):  # step-N wins
        if not path.is_symlink() and (path / MANIFEST).is_file():
            found[step_name(path)] = path
    return [found[name] for name in sorted(found)]


def committed_after(named: Path, committed: list[Path], latest: Path) -> Path | None:
    """The checkpoint committed after the one `latest` names (a kill between a commit's rename and its update
    of `latest`), or None. Only the manifests written since `latest` are read; old ones count as older."""
    since = latest.stat().st_mtime
    later = [p for p in committed if p != named and (p / MANIFEST).stat().st_mtime >= since]
    if not later:
        return None
    newest = max(later, key=committed_at)
    return newest if committed_at(newest) > committed_at(named) else None


def committed_at(directory: Path) -> int:
    return read_manifest(directory).get("committed_at", 0)


def resolve(path: Path, what: str = "checkpoints.resume_checkpoint_path") -> tuple[Path, list[str]]:
    """The checkpoint directory `path` means (a step-NNNNNNN directory, or the newest committed one in a
    checkpoints directory), and warnings to log. `what` names where the path came from, for messages."""
    if not path.exists():
        raise CheckpointError(
            f"{what}: {path} does not exist. Give a checkpoint (a step-NNNNNNN directory) or the "
            "checkpoints directory that holds them."
        )
    if (path / MANIFEST).is_file() or path.name.startswith("step-"):
        return path, []
    warnings = [
        f"ignoring {tmp}: a save that did not finish (the process died while writing it)"
        for tmp in sorted(path.glob(".tmp-step-*"))
    ]
    warnings += [
        f"ignoring {link}: a link (to {link.resolve()}); a checkpoint must be a directory inside {path}"
        for link in sorted(path.glob("step-*"))
        if link.is_symlink()
    ]
    committed = committed_checkpoints(path)
    if not committed:
        raise CheckpointError(
            f"{what}: {path} holds no committed checkpoint (no step-NNNNNNN directory with a "
            f"{MANIFEST}). Give another run's checkpoints, or start without it."
        )
    latest = path / LATEST
    named = latest.read_text(errors="replace").strip() if latest.is_file() else None
    by_name = {step_name(p): p for p in committed}
    if named in by_name:
        newer = committed_after(by_name[named], committed, latest)
        if newer is None:
            return by_name[named], warnings
        warnings.append(
            f"{latest} names {named}, but {newer.name} was committed after it (the run was killed before "
            f"it updated {LATEST}); taking {newer.name}"
        )
        return newer, warnings
    warnings.append(
        f"{latest} {'is missing' if named is None else f'names {named!r}, which is not committed'}; "
        f"taking the newest committed checkpoint, {committed[-1].name}"
    )
    return committed[-1], warnings


class ResumeSource(NamedTuple):
    """Where a run starts. A tuple still, so that `path, what, warnings = ...` reads it whole."""

    path: Path | None  # a checkpoint or checkpoints directory, for `resolve`; None: from step 0
    what: str  # the setting that named it, for messages
    warnings: list[str]


def resume_source(config: Config) -> ResumeSource:
    """Where this run starts (see the module's docstring for the order and why).

    An explicit `checkpoints.resume_checkpoint_path` wins. Otherwise the run's own checkpoints directory is
    taken when it holds a committed checkpoint, unless `checkpoints.auto_resume` is false. The path is not
    resolved here; `resolve` picks the step directory, rank 0's view of it deciding (`load`).
    """
    own = checkpoint_root(config)
    given = config.checkpoints.resume_checkpoint_path
    own_latest = committed_checkpoints(own)[-1:] if own.is_dir() else []
    if given is not None:
        warnings = []
        # No warning when the given path is the run's own checkpoints directory or a step in it.
        given_path = Path(given).resolve()
        if own_latest and own.resolve() not in (given_path, given_path.parent):
            warnings.append(
                f"checkpoints.resume_checkpoint_path={given} is given, so the checkpoints of this "
                f"run in {own} (up to {own_latest[0].name}) are not resumed; remove "
                "resume_checkpoint_path to continue from them"
            )
        return ResumeSource(path=Path(given), what=EXPLICIT, warnings=warnings)
    if not own_latest:
        return ResumeSource(path=None, what="", warnings=[])
    if not config.checkpoints.auto_resume:
        warning = (
            f"checkpoints.auto_resume=false: starting from step 0, although {own} holds checkpoints up "
            f"to {own_latest[0].name}; this run's saves replace them"
        )
        return ResumeSource(path=None, what="", warnings=[warning])
    check_same_run(config, own_latest[0])
    what = "checkpoints.checkpoints_path (the run's own, checkpoints.auto_resume=true)"
    return ResumeSource(path=own, what=what, warnings=[])


def run_name(config: dict[str, Any]) -> str:
    """Which run a config is: its project and (templates expanded) run name, as a manifest's config has it."""
    general = config.get("general", {})
    return f"{general.get('project', 'femtotron')}/{general.get('run', 'run')}"


def check_same_run(config: Config, newest: Path) -> None:
    """Auto-resume continues this run only: a checkpoints_path shared by several runs (nanotron's configs
    all say `checkpoints_path: checkpoints`) holds others' checkpoints too, and continuing one of them
    would train on another run's weights and overwrite its steps."""
    saved = run_name(read_manifest(newest)["config"])
    ours = run_name(config.to_dict())
    if saved != ours:
        raise CheckpointError(
            f"{newest} is a checkpoint of run {saved}, not of this run ({ours}): both save into "
            f"{checkpoint_root(config)}. Give this run a checkpoints.checkpoints_path of its own (unset: "
            "RUN_DIR/checkpoints), or, to continue that run on purpose, set "
            f"checkpoints.resume_checkpoint_path={newest}."
        )


def decided_by_rank_0(ctx: ParallelContext, topic: str, decide: Callable[[], Any]) -> Any:
    """`decide()` on rank 0, its JSON result given to every rank (on a shared file system one rank may see a
    checkpoint another does not yet). Rank 0's CheckpointError reaches the others as theirs, at once."""
    key = ctx.store.fresh_key("decision")
    if ctx.rank == 0:
        try:
            posted = json.dumps({"value": decide()})
        except CheckpointError as e:
            ctx.store.post(key, json.dumps({"error": str(e)}))
            raise
        ctx.store.post(key, posted)
    else:
        posted = ctx.store.collect([key], ctx.collective_timeout_seconds).get(key, "{}")
    decided = json.loads(posted)
    if "value" not in decided:
        raise CheckpointError(decided.get("error", f"rank {ctx.rank}: no word from rank 0 on {topic}"))
    return decided["value"]


def agreed_resume_source(config: Config, ctx: ParallelContext) -> ResumeSource:
    """`resume_source` as rank 0 sees it, on every rank (another node may not see the newest one yet)."""

    def decide() -> dict[str, Any]:
        source = resume_source(config)
        path = str(source.path) if source.path is not None else None
        return {"path": path, "what": source.what, "warnings": source.warnings}

    decided = decided_by_rank_0(ctx, "which checkpoint to resume from", decide)
    path = Path(decided["path"]) if decided["path"] else None
    return ResumeSource(path=path, what=decided["what"], warnings=decided["warnings"])


def already_done(config: Config) -> str | None:
    """A line saying the run is finished, when its own newest checkpoint is its last step and its final
    weights are written (a finished job started again, by a requeue or by hand, then does nothing)."""
    source = resume_source(config)
    if source.path is None or config.checkpoints.resume_checkpoint_path is not None:
        return None
    directory, _ = resolve(source.path, source.what)
    step = int(read_manifest(directory)["step"])
    train_steps = config.tokens.train_steps
    final_weights_missing = config.checkpoints.save_final_state and not weights_present(config.run_dir)
    if step < train_steps or final_weights_missing:
        return None
    return (
        f"already done: {directory} is step {step} of tokens.train_steps={train_steps} and the weights are "
        f"in {config.run_dir}. Nothing to train: raise tokens.train_steps to go on, or set "
        "checkpoints.auto_resume=false to start over."
    )
