"""Save and resume training: every rank writes its own slices, rank 0 commits by rename.

Save: in `<checkpoints>/.tmp-step-NNNNNNN` each rank writes the slices it is the one to save (its
1/(dp * cp) of every gradient bucket; whole-on-every-tp-rank parameters only on tp rank 0, a tied embedding
only on the first stage) and posts a record in the rendezvous store; rank 0 waits for every record, with a
timeout naming the ranks that never finished (C2), writes the manifest last, renames the directory to
`step-NNNNNNN`, points `latest` at it (both atomic) and deletes those beyond `checkpoints.keep_last_n`.

Load: the manifest says where every slice is, so each rank reads exactly the boxes its layout needs, also
when the mesh changed (C1): weights, master weights, Adam moments and step count, the train state, and each
rank's RNG states when the mesh is unchanged (C3).

Which checkpoint a run starts from is `resume_source`'s choice. An explicit
`checkpoints.resume_checkpoint_path` wins, because a person who names a checkpoint means that one, even when
the run's own directory holds others (a warning says they are not resumed). Without it, the run's own
newest committed checkpoint is taken, so that a preempted, requeued or crashed job continues where it
stopped when the same command runs again. `checkpoints.auto_resume: false` starts from step 0 instead,
with a warning, because its saves will replace the old checkpoints of the same steps.

A checkpoints directory, given or the run's own, is read through its `latest` file (`resolve`). Only a
committed checkpoint counts: a step directory with its manifest, which appears by rename once the save is
complete. A half-written `.tmp-step-*` is ignored with a warning, and when `latest` is missing or names no
committed checkpoint the newest committed one is taken, also with a warning; so is one committed after
the one `latest` names (a kill came before `latest` was updated: manifests record `committed_at`). Links
are not checkpoints, and a save removes a link at its temporary directory rather than write through it: a
run directory from elsewhere cannot send reads or writes outside it. Rank 0 alone decides and
tells every rank (`agreed_resume_source`), because on a shared file system another node may not see the
newest checkpoint yet.

`model.init_from` is not a resume source. It gives a new run its first weights at step 0
(serialize/init.py); when that run later resumes from its own checkpoint, the checkpoint's weights replace
them, so a requeued job does not start over from the initial weights.

Save and load take the pieces they need (`TrainingParts`), never the trainer.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from femtotron.atomic import atomic_path, remove
from femtotron.config import Config, LlamaConfig
from femtotron.crash_points import crash_point
from femtotron.data.run_data import data_changes, data_identity, stage_identity
from femtotron.errors import ConfigError, FemtotronError
from femtotron.layout import RankModel
from femtotron.optim.zero import ZeroOptimizer
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.mesh import ADDED_LATER, NAMED
from femtotron.parallel.store import Store
from femtotron.serialize.files import (
    MANIFEST,
    CheckpointError,
    CheckpointReader,
    Slice,
    build_manifest,
    file_record,
    fsync_directory,
    read_manifest,
    write_rank_file,
    write_synced,
)
from femtotron.serialize.geometry import Placement, placements
from femtotron.serialize.weights import TOKENIZER_FILE, weights_present
from femtotron.train_state import TrainingParts

LATEST = "latest"
# The resume source a person named: only its checkpoint may be loaded in part (load_optimizer=false, ...).
EXPLICIT = "checkpoints.resume_checkpoint_path"
# The model_config fields that decide the tensors' shapes, and what the experts compute: a checkpoint only
# loads into an equal model.
MODEL_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
    "moe.num_experts",
    "moe.num_experts_per_tok",
    "moe.intermediate_size",
    "moe.num_shared_experts",
    "moe.shared_expert_gate",
    "moe.router_norm",
    "head_dim",
    "qkv_bias",
    "qk_norm",
    "no_rope_layers",
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
    "sliding_window",
    "full_attention_layers",
)


def checkpoint_root(config: Config) -> Path:
    path = config.checkpoints.checkpoints_path
    return Path(path) if path is not None else config.run_dir / "checkpoints"


# Besides the mesh's sizes, what decides which slices and states each rank of a checkpoint holds.
LAYOUT_SETTINGS = ("pp_engine", "pp_virtual_stages", "tp_mode")


def mesh_of(config: Config) -> dict[str, Any]:
    """The manifest's `mesh`: each dimension's size (parallel/mesh.py), layout settings, ZeRO stage."""
    mesh = {key: getattr(config.parallelism, key) for key in (*NAMED, *LAYOUT_SETTINGS)}
    return mesh | {"zero_stage": config.optimizer.zero_stage}


def saved_mesh(manifest: dict[str, Any]) -> dict[str, Any]:
    """A manifest's `mesh`, with the dimensions added after it was written at their size then: 1."""
    return {name: 1 for name in ADDED_LATER} | manifest["mesh"]


@dataclass(frozen=True, kw_only=True)
class SavedSlice:
    """A slice one rank saves: part `place` of parameter `name`, at [low, high) of the flat buffers."""

    name: str
    shape: tuple[int, ...]  # the global tensor's
    place: Placement
    low: int
    high: int
    owner: int  # the index of the owned piece (DataParallel.pieces) that holds these elements


def saved_slices(model: RankModel) -> list[SavedSlice]:
    """What one rank saves: its 1/(dp * cp) of every bucket, of the parameters whose copy here counts."""
    data_parallel = model.data_parallel
    named = model.named_parameters()
    out = []
    for piece in data_parallel.shard_pieces:
        if not model.counted[piece.param]:
            continue
        name, param = named[piece.param]
        offset = data_parallel.offsets[piece.param]
        pieces = data_parallel.pieces
        owner = next(i for i, p in enumerate(pieces) if p.start <= piece.start and piece.end <= p.end)
        # placements() counts within the parameter's own local tensor; the flat buffers start it at offset.
        low = piece.start - offset
        high = piece.end - offset
        for place in placements(param.shard, tuple(param.shape), low, high):
            saved = SavedSlice(
                name=name,
                shape=param.shard.global_shape,
                place=place,
                low=offset + place.flat_start,
                high=offset + place.flat_stop,
                owner=owner,
            )
            out.append(saved)
    return out


def rank_slices(model: RankModel, optimizer: ZeroOptimizer) -> list[Slice]:
    """Every slice this rank saves (tensor name, global shape, box, values), from the live tensors."""
    data_parallel = model.data_parallel
    fp32 = data_parallel.param_dtype == torch.float32  # fp32 weights are their own masters
    kinds = optimizer.state_kinds if fp32 else ("master", *optimizer.state_kinds)
    states = {kind: optimizer.state(kind) for kind in kinds}
    states["model"] = data_parallel.owned_params()
    out = []
    for saved in saved_slices(model):
        # The optimizer's states are per owned piece, so they count from the piece's start.
        start = data_parallel.pieces[saved.owner].start
        owned = slice(saved.low - start, saved.high - start)
        place = saved.place
        for kind in ("model", *kinds):
            flat = states[kind][saved.owner]
            if flat is None:  # Adam's moments of a Muon matrix, or Muon's momentum of Adam's parameters
                continue
            values = flat[owned].view(place.local_shape)[place.valid]
            out.append(Slice(f"{kind}/{saved.name}", saved.shape, place.target, values))
    return out


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This process's RNG states: torch's as tensors, Python's and numpy's as JSON (safetensors metadata)."""
    python = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state()
    states = {
        "python": [python[0], list(python[1]), python[2]],
        "numpy": [kind, keys.tolist(), position, has_gauss, cached],
    }
    tensors = {"rng/torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["rng/torch_cuda"] = torch.cuda.get_rng_state()
    return tensors, {"rng": json.dumps(states)}


def set_rng_state(reader: CheckpointReader, file: str) -> None:
    states = json.loads(reader.metadata(file)["rng"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached))
    torch.set_rng_state(reader.extra(file, "rng/torch_cpu"))
    if torch.cuda.is_available() and "rng/torch_cuda" in reader.keys(file):  # absent when saved without GPUs
        torch.cuda.set_rng_state(reader.extra(file, "rng/torch_cuda"))


@dataclass(kw_only=True)
class PendingSave:
    """A save whose values are taken (`begin_save`) and are yet to be written and committed (`finish_save`):
    what a rank writes, and (rank 0) what the manifest says. Nothing in it refers to the live training
    state, so training may go on while it is written."""

    rank: int
    world_size: int
    tmp: Path
    final: Path
    key: str  # the store's key for this save's messages
    slices: list[Slice]
    extra: dict[str, torch.Tensor]  # the RNG states
    metadata: dict[str, str]
    state: dict[str, Any] | None  # the manifest's run state (rank 0)
    tokenizer: bool  # rank 0 wrote the tokenizer into tmp
    prepared: Exception | None  # rank 0 could not make tmp
    timeout: float
    keep_last_n: int | None


def begin_save(
    parts: TrainingParts, stage: Callable[[list[Slice]], list[Slice]] | None = None
) -> PendingSave:
    """Every rank: take the current step's slices, RNG states and (rank 0) run state, after rank 0 made the
    temporary directory. `stage` copies the slices out of the live tensors (checkpoints.async_save);
    without it they are the live tensors themselves, to be written before training goes on."""
    ctx = parts.ctx
    config = parts.config
    root = checkpoint_root(config)
    name = f"step-{parts.state.step:07d}"
    tmp = root / f".tmp-{name}"
    key = ctx.store.fresh_key("save")
    prepared: Exception | None = None
    if ctx.rank == 0:
        try:
            remove(tmp)  # a crashed earlier save of the same step, or a link planted in a downloaded run
            root.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            if parts.tokenizer is not None:
                parts.tokenizer.save(str(tmp / TOKENIZER_FILE))
        except OSError as e:
            prepared = e
    ctx.comm.barrier(ctx.world_group)
    slices = rank_slices(parts.model, parts.optimizer)
    extra, metadata = rng_state()
    return PendingSave(
        rank=ctx.rank,
        world_size=ctx.world_size,
        tmp=tmp,
        final=root / name,
        key=key,
        slices=stage(slices) if stage is not None else slices,
        extra=extra,
        metadata=metadata,
        state=run_state(parts) if ctx.rank == 0 else None,
        tokenizer=parts.tokenizer is not None,
        prepared=prepared,
        timeout=config.parallelism.collective_timeout_seconds,
        keep_last_n=config.checkpoints.keep_last_n,
    )


def save(parts: TrainingParts) -> Path:
    """Write a checkpoint of the current step from every rank; return its directory once committed."""
    final, warnings = finish_save(begin_save(parts), parts.ctx.store)
    for warning in warnings:
        parts.log.warn(warning)
    return final


def finish_save(pending: PendingSave, store: Store) -> tuple[Path, list[str]]:
    """Every rank writes its file; rank 0 commits once all have, then deletes checkpoints beyond
    keep_last_n. Returns the committed directory and warnings. A rank's failure reaches rank 0 through the
    store, and rank 0's verdict every rank: all stop, with why. Runs in the background writer thread too,
    with a `store` connection of its own."""
    tmp = pending.tmp
    final = pending.final
    key = pending.key
    try:
        if pending.prepared is not None:
            raise pending.prepared
        tmp.mkdir(parents=True, exist_ok=True)  # on another node of a shared file system it may show up late
        written = write_rank_file(
            tmp, pending.rank, pending.slices, extra=pending.extra, metadata=pending.metadata
        )
        record = written | {"rng": True}
    except Exception as e:  # noqa: BLE001 - whatever it is (disk full), rank 0 must hear of it
        store.post(f"{key}/rank{pending.rank}", json.dumps({"error": f"{type(e).__name__}: {e}"}))
        if pending.rank != 0:
            raise CheckpointError(
                f"rank {pending.rank} could not write its part of checkpoint {final}: {e}. Check "
                f"free space and permissions under {final.parent}."
            ) from None
    else:
        store.post(f"{key}/rank{pending.rank}", json.dumps(record))
    timeout = pending.timeout
    if pending.rank != 0:
        # Rank 0 may itself wait `timeout` for a slow rank before it commits.
        outcome = store.collect([f"{key}/commit"], 2 * timeout + 60).get(f"{key}/commit")
        if outcome != "ok":
            raise CheckpointError(
                f"rank {pending.rank}: checkpoint {final} was not committed by rank 0: "
                f"{outcome or f'no word from rank 0 within {2 * timeout + 60:g} s'}"
            )
        return final, []
    try:
        records = collect_records(store, world=pending.world_size, key=key, final=final, timeout=timeout)
        if pending.tokenizer:
            records.append(file_record(tmp / TOKENIZER_FILE))
        commit(tmp, final, pending.state, records)
    except (CheckpointError, OSError) as e:
        verdict = e
        if isinstance(e, OSError):
            verdict = CheckpointError(
                f"checkpoint {final} was not committed: {type(e).__name__}: {e}. Check free space and "
                f"permissions under {final.parent}; the previous checkpoint is intact."
            )
        store.post(f"{key}/commit", str(verdict))
        raise verdict from None
    store.post(f"{key}/commit", "ok")
    return final, prune(final.parent, pending.keep_last_n, final)


def collect_records(store: Store, world: int, key: str, final: Path, timeout: float) -> list[dict[str, Any]]:
    """Rank 0: every rank's file record, or an error naming the ranks that did not deliver (C2)."""
    got = store.collect([f"{key}/rank{r}" for r in range(world)], timeout, remove=True)
    records = {int(k.rsplit("rank", 1)[1]): json.loads(v) for k, v in got.items()}
    failed = {r: rec["error"] for r, rec in records.items() if "error" in rec}
    missing = [r for r in range(world) if r not in records]
    if missing or failed:
        many = len(missing) > 1
        details = "".join(f"\n  rank {r}: {message}" for r, message in failed.items())
        lost = (
            f"rank{'s' * many} {', '.join(map(str, missing))} did not finish writing "
            f"{'their files' if many else 'its file'} within {timeout:g} s "
            "(parallelism.collective_timeout_seconds): died, or stuck on the file system. "
        )
        raise CheckpointError(
            f"checkpoint {final} was not committed: {lost if missing else ''}"
            + (f"Ranks failed to write:{details}\n" if failed else "")
            + f"The previous checkpoint is intact; the half-written {final.parent / ('.tmp-' + final.name)} "
            "is ignored on resume."
        )
    return [records[r] for r in range(world)]


def current_stage(parts: TrainingParts) -> int:
    """The data stage of the step just done (of step 1 before any)."""
    return parts.data.index_at(max(parts.state.step, 1))


def data_size(parts: TrainingParts) -> dict[str, int]:
    """What the manifest records of the training data, to warn on resume when it changed."""
    nanoset = parts.data.nanosets[current_stage(parts)]
    return {"samples_per_epoch": nanoset.samples_per_epoch, "tokens": nanoset.num_tokens}


def run_state(parts: TrainingParts) -> dict[str, Any]:
    """What the manifest records besides the tensors: where the run is, and how it was laid out."""
    config = parts.config
    state = parts.state.state_dict()
    state["lr_schedule"]["style"] = config.optimizer.learning_rate_scheduler.lr_decay_style
    stage_name = parts.data.stages[current_stage(parts)].name
    return {
        **state,
        "optimizer_steps": parts.optimizer.steps,
        "mesh": mesh_of(config),
        "world_size": parts.ctx.world_size,
        "global_batch_size": config.global_batch_size,
        "data": data_size(parts),
        "data_identity": stage_identity(parts.data, stage_name, parts.tokenizer),
        # Where a later stage's datasets continue depends on what the earlier ones drew (data/stages.py).
        "earlier_data_identities": [
            stage_identity(parts.data, entry.name, parts.tokenizer) for entry in parts.state.stages[:-1]
        ],
        "config": config.to_dict(),
    }


def commit(tmp: Path, final: Path, state: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """Write the manifest into the finished temporary directory, rename it into place, point `latest` at it
    (a same-step one there is set aside as .old-step-N and deleted only then, so a kill at any point leaves
    a step N to resume: `committed_checkpoints`). `records`: each rank's file, in rank order, then others.
    `committed_at` orders commits for `resolve` when a kill left `latest` behind."""
    rng = {str(rank): record["file"] for rank, record in enumerate(records) if record.get("rng")}
    manifest = build_manifest({**state, "rng": rng, "committed_at": time.time_ns()}, records)
    write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1))
    fsync_directory(tmp)
    crash_point("checkpoint.manifest_written")
    replaced = final.parent / f".old-{final.name}"
    if final.exists() or final.is_symlink():
        remove(replaced)
        final.rename(replaced)
        crash_point("checkpoint.set_aside")
    tmp.rename(final)
    fsync_directory(final.parent)
    crash_point("checkpoint.renamed")
    with atomic_path(final.parent / LATEST) as path:
        Path(path).write_text(final.name + "\n")
    crash_point("checkpoint.latest_written")
    remove(replaced)


def prune(root: Path, keep: int | None, newest: Path) -> list[str]:
    """Delete the oldest checkpoints before `newest` so that `keep` remain; return warnings. Checkpoints of
    later steps (left by a run that was rolled back) are not this run's to delete."""
    if not keep:
        return []
    older = [p for p in committed_checkpoints(root) if step_name(p) < newest.name]
    warnings = []
    for old in older[: max(len(older) - (keep - 1), 0)]:
        try:
            shutil.rmtree(old)
        except OSError as e:
            warnings.append(f"could not delete old checkpoint {old} (checkpoints.keep_last_n={keep}): {e}")
    return warnings


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


def model_differences(saved: dict[str, Any], config: Config, where: str, fields=MODEL_FIELDS) -> list[str]:
    """The model_config fields (by default those that decide the tensors' shapes and what the model computes
    with them) that differ, as lines. `saved` is read as a LlamaConfig: a manifest written before a field
    existed has its default."""

    def flat(values: dict[str, Any]) -> dict[str, Any]:  # moe's keys as moe.KEY; its dense MLP size is unused
        moe = {f"moe.{key}": value for key, value in (values.get("moe") or {}).items()}
        return values | moe | ({"intermediate_size": None} if moe else {})

    theirs = flat(LlamaConfig.model_validate(saved).model_dump(mode="json"))
    ours = flat(config.model.model_config_.model_dump(mode="json"))
    return [
        f"model.model_config.{field}: {where} {theirs.get(field)!r}, config {ours.get(field)!r}"
        for field in fields
        if theirs.get(field) != ours.get(field)
    ]


def check_model_matches(manifest: dict[str, Any], config: Config, directory: Path) -> None:
    wrong = model_differences(manifest["config"]["model"]["model_config"], config, "checkpoint")
    if wrong:
        lines = "".join(f"\n  {line}" for line in wrong)
        raise CheckpointError(
            f"checkpoint {directory} was saved from a different model:{lines}\nSet these fields as in the "
            f"checkpoint's config ({directory / MANIFEST}), or start a new run from step 0."
        )


def check_optimizer_matches(manifest: dict[str, Any], config: Config, directory: Path) -> None:
    """Adam's moments cannot continue as Muon's momentum, nor the other way round."""
    saved = manifest["config"].get("optimizer", {}).get("optimizer_factory", {}).get("name", "adamW")
    now = config.optimizer.optimizer_factory.name
    if saved != now:
        raise CheckpointError(
            f"checkpoint {directory} holds the state of optimizer_factory.name={saved}, this run's "
            f"optimizer.optimizer_factory.name is {now}: one's moments mean nothing to the other. Fix: set "
            f"it back to {saved}; or, to go on with {now} from these weights, start a new run with "
            f"checkpoints.resume_checkpoint_path={directory} and checkpoints.load_optimizer=false."
        )


def check_data_matches(parts: TrainingParts, manifest: dict[str, Any], directory: Path) -> None:
    """Refuse to resume on other data, another order of it or another tokenizer, saying what that would do,
    unless checkpoints.resume_with_other_data (then warn). The data compared is that of the stage the
    checkpoint was in and of every stage the run went through before it, as the config now describes the
    stages of those names. Checkpoints written before identities resume."""
    saved = manifest.get("data_identity")
    if not isinstance(saved, dict):
        return
    samples = manifest.get("consumed_samples", 0)

    def changes_in(identity: dict[str, Any]) -> list[str]:
        stage = str(
            identity.get("stage", parts.data.stages[0].name)
        )  # checkpoints from before stages had one
        now = data_identity(parts.data.nanoset_of(stage, f"checkpoint {directory}"), parts.tokenizer)
        return data_changes(identity, now, samples)

    changes = changes_in(saved)
    earlier = manifest.get("earlier_data_identities")
    for identity in earlier if isinstance(earlier, list) else []:
        if isinstance(identity, dict):
            changes += [
                f"in data stage {identity.get('stage')!r}, which the run went through before: {change}"
                for change in changes_in(identity)
                if change not in changes  # the tokenizer: said once
            ]
    if changes and not parts.config.checkpoints.resume_with_other_data:
        lines = "".join(f"\n  {change}" for change in changes)
        raise ConfigError(
            f"checkpoint {directory} was trained on other data:{lines}\nRestore the data settings of the "
            f"checkpoint's config ({directory / MANIFEST}); or set checkpoints.resume_with_other_data=true "
            "to resume on this data anyway; or start a new run."
        )
    for change in changes:
        parts.log.warn(f"checkpoints.resume_with_other_data=true: resuming although {change}")


def check_writable(parts: TrainingParts) -> None:
    """A read-only or full checkpoints path fails before step 1, on every rank together, not at the first
    save after minutes of training."""
    root = checkpoint_root(parts.config)

    def probe() -> None:
        probe_file = root / f".write-probe-{os.getpid()}"
        try:
            root.mkdir(parents=True, exist_ok=True)
            try:
                write_synced(probe_file, "femtotron checks that checkpoints can be written here\n")
            finally:
                probe_file.unlink(missing_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"checkpoints cannot be written to {root} ({type(e).__name__}: {e}). Free space there or fix "
                "its permissions, or set checkpoints.checkpoints_path to a writable directory."
            ) from None

    decided_by_rank_0(parts.ctx, "whether checkpoints can be written", probe)


def load(parts: TrainingParts, path: Path, what: str = EXPLICIT) -> tuple[str, Path]:
    """Restore the run from the checkpoint at (or latest under) `path`; return a line for the log and the
    checkpoint's directory.

    Rank 0 decides which checkpoint `path` means: ranks reading `latest` on their own could see different
    ones on a shared file system. Every rank then loads its own part and checks the checksums of its share
    of the files. If any rank fails, all stop with the error.
    """
    ctx = parts.ctx
    failure: FemtotronError | None = None
    summary = ""
    directory = path  # until rank 0 has resolved it, for the messages

    def pick() -> str:
        chosen, warnings = resolve(path, what)
        for warning in warnings:
            parts.log.warn(warning)
        return str(chosen)

    try:
        directory = Path(decided_by_rank_0(ctx, "which checkpoint to load", pick))
        with CheckpointReader(directory) as reader:
            # Version 1 keeps a checksum per file, read once more for it, each file by one rank only;
            # version 2's are checked as the tensors are read.
            files = sorted(reader.manifest["files"]) if reader.manifest["version"] == 1 else []
            for name in files[ctx.rank :: ctx.world_size]:
                reader.verify(name)
            check_model_matches(reader.manifest, parts.config, directory)
            check_data_matches(parts, reader.manifest, directory)
            ckpt = parts.config.checkpoints
            explicit = what == EXPLICIT  # another run's checkpoint: it may be taken in part
            moments = ckpt.load_optimizer or not explicit
            if moments:
                check_optimizer_matches(reader.manifest, parts.config, directory)
            load_tensors(parts.model, parts.optimizer, reader, moments=moments)
            summary = restore_counters(parts, reader, directory)
            if not moments:
                summary += (
                    "; the optimizer starts afresh (zero moments) from its master weights "
                    "(checkpoints.load_optimizer=false)"
                )
            if explicit and not ckpt.load_lr_scheduler:
                parts.state.lr_schedule_start = parts.state.step
                summary += (
                    f"; the lr schedule starts again at step {parts.state.step + 1} "
                    "(checkpoints.load_lr_scheduler=false)"
                )
    except FemtotronError as e:
        failure = e
    except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks, or they wait for a timeout
        failure = CheckpointError(
            f"rank {ctx.rank}: loading checkpoint {directory} failed: {type(e).__name__}: {e}"
        )
    failed = torch.tensor(float(failure is not None), device=ctx.device)
    ctx.comm.all_reduce(failed, ctx.world_group, op="max")
    if failure is not None:
        raise failure
    if failed.item():
        raise CheckpointError(
            f"rank {ctx.rank}: another rank could not load the checkpoint; its error says why."
        )
    return summary, directory


def fill(
    target: torch.Tensor,
    param: torch.Tensor,
    *,
    start: int,
    stop: int,
    reader: CheckpointReader,
    tensor: str,
) -> None:
    """Fill `target`, elements [start, stop) of `param`'s local tensor flattened, from tensor `tensor` of
    `reader` (a checkpoint, or any reader with `shape` and `read`: serialize/init.py's sources)."""
    if reader.shape(tensor) != param.shard.global_shape:
        raise CheckpointError(
            f"checkpoint {reader.directory}: {tensor} has global shape {reader.shape(tensor)}, "
            f"this model's is {param.shard.global_shape}. The checkpoint belongs to another model."
        )
    for place in placements(param.shard, tuple(param.shape), start, stop):
        view = target[place.flat_start - start : place.flat_stop - start].view(place.local_shape)
        reader.read(tensor, place.target, out=view[place.valid])


def load_tensors(
    model: RankModel, optimizer: ZeroOptimizer, reader: CheckpointReader, moments: bool = True
) -> None:
    """The weights and the optimizer's master weights; with `moments` Adam's moments and step count too,
    without them a fresh Adam (zero moments, step 0)."""

    def source(kind: str) -> Callable[[str], str]:  # fp32 checkpoints hold no separate master weights
        def tensor(name: str) -> str:
            masters = kind == "master" and not reader.has(f"master/{name}")
            return f"model/{name}" if masters else f"{kind}/{name}"

        return tensor

    with torch.no_grad():
        fill_parameters(model, reader, source("master"))
        optimizer.prepare_state(int(reader.manifest.get("optimizer_steps", 0)) if moments else 0)
        for kind in ("master", *optimizer.state_kinds) if moments else ("master",):
            fill_pieces(model, optimizer.state(kind), reader, source(kind))


def fill_parameters(model: RankModel, reader: CheckpointReader, tensor_of: Callable[[str], str]) -> None:
    """This rank's parameters from `reader` (tensor `tensor_of(name)` for each): whole, or under ZeRO-3 the
    owned pieces only, the rest being other ranks' to hold."""
    data_parallel = model.data_parallel
    if data_parallel.shard_params:
        fill_pieces(model, data_parallel.owned_params(), reader, tensor_of)
        return
    for name, param in model.named_parameters():
        fill(param.data.view(-1), param, start=0, stop=param.numel(), reader=reader, tensor=tensor_of(name))


def fill_pieces(
    model: RankModel, targets: list[torch.Tensor], reader: CheckpointReader, tensor_of: Callable[[str], str]
) -> None:
    """Per owned piece (DataParallel.pieces), its elements of the parameter's tensor into its target."""
    named = model.named_parameters()
    data_parallel = model.data_parallel
    for piece, target in zip(data_parallel.pieces, targets, strict=True):
        if target is None:  # a state the other optimizer keeps (optim/zero.py)
            continue
        name, param = named[piece.param]
        offset = data_parallel.offsets[piece.param]
        fill(
            target,
            param,
            start=piece.start - offset,
            stop=piece.end - offset,
            reader=reader,
            tensor=tensor_of(name),
        )


def restore_counters(parts: TrainingParts, reader: CheckpointReader, directory: Path) -> str:
    manifest = reader.manifest
    state = parts.state
    config = parts.config
    # Only an fp16 run's scale means anything; a bf16 or fp32 one is 1 (and would be fp16's minimum).
    fp16 = state.scaler.enabled and manifest["config"]["model"].get("dtype") == "float16"
    state.load_state_dict(manifest, loss_scale=fp16)
    saved = saved_mesh(manifest)
    current = mesh_of(config)
    same_layout = saved == current and manifest.get("world_size") == parts.ctx.world_size
    rng_file = manifest.get("rng", {}).get(str(parts.ctx.rank))
    if same_layout and rng_file is not None:
        set_rng_state(reader, rng_file)
    line = (
        f"resumed from {directory} at step {state.step} ({state.consumed_samples:,} samples, "
        f"{state.consumed_tokens:,} tokens consumed)"
    )
    data = data_size(parts)
    if "data_identity" not in manifest and manifest.get("data", data) != data:  # written before identities
        parts.log.warn(
            f"the training data differs from the checkpoint's ({manifest['data']['tokens']:,} tokens, now "
            f"{data['tokens']:,}): the run continues at global sample {state.consumed_samples:,} of the new "
            "data, not where the old data left off"
        )
    batch = manifest.get("global_batch_size", config.global_batch_size)
    if batch != config.global_batch_size:
        parts.log.warn(
            f"global batch size {batch} at the save, {config.global_batch_size} now: the data continues "
            "at the same global sample and the lr schedule by step, but the losses will not match a run "
            "that kept the batch"
        )
    if same_layout:
        return line if rng_file is not None else f"{line}; no RNG states in the checkpoint (written offline)"
    changed = ", ".join(f"{k} {saved.get(k)} -> {v}" for k, v in current.items() if saved.get(k) != v)
    return (
        f"{line}; resharded ({changed}): weights, master weights and Adam moments read as slices of the "
        "global tensors for this layout; the data continues at the same global sample; RNG states not "
        "restored (the ranks changed)"
    )
