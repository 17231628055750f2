"""Save a checkpoint: every rank writes its own slices, rank 0 commits by rename.

Save: in `<checkpoints>/.tmp-step-NNNNNNN` each rank writes the slices it is the one to save (its
1/(dp * cp) of every gradient bucket; whole-on-every-tp-rank parameters only on tp rank 0, a tied embedding
only on the first stage) and posts a record in the rendezvous store; rank 0 waits for every record, with a
timeout naming the ranks that never finished (C2), writes the manifest last, renames the directory to
`step-NNNNNNN`, points `latest` at it (both atomic) and deletes those beyond `checkpoints.keep_last_n`.
Nothing but a committed step directory is ever read as a checkpoint (serialize/resume_source.py).

A save is in two halves, `begin_save` (the values taken) and `finish_save` (written and committed), so
that checkpoints.async_save can write the second in the background (serialize/background.py).

A save takes the pieces it needs (`TrainingParts`), never the trainer.
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
from typing import Any

import numpy as np
import torch

from femtotron.atomic import atomic_path, remove
from femtotron.config import Config
from femtotron.crash_points import crash_point
from femtotron.data.run_data import stage_identity
from femtotron.layout import RankModel
from femtotron.mesh import NAMED
from femtotron.optim.zero import ZeroOptimizer
from femtotron.serialize.files import (
    MANIFEST,
    CheckpointError,
    Slice,
    build_manifest,
    file_record,
    fsync_directory,
    write_rank_file,
    write_synced,
)
from femtotron.serialize.geometry import Placement, placements
from femtotron.serialize.resume_source import (
    LATEST,
    checkpoint_root,
    committed_checkpoints,
    decided_by_rank_0,
    step_name,
)
from femtotron.serialize.weights import TOKENIZER_FILE
from femtotron.store import Store
from femtotron.train_state import TrainingParts

# Besides the mesh's sizes, what decides which slices and states each rank of a checkpoint holds.
LAYOUT_SETTINGS = ("pp_engine", "pp_virtual_stages", "tp_mode")


def mesh_of(config: Config) -> dict[str, Any]:
    """The manifest's `mesh`: each dimension's size (mesh.py), layout settings, ZeRO stage."""
    mesh = {key: getattr(config.parallelism, key) for key in (*NAMED, *LAYOUT_SETTINGS)}
    return mesh | {"zero_stage": config.optimizer.zero_stage}


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
    layout = model.data_parallel.layout
    named = model.named_parameters()
    out = []
    for piece in layout.shard_pieces:
        if not model.counted[piece.param]:
            continue
        name, param = named[piece.param]
        offset = layout.offsets[piece.param]
        pieces = layout.pieces
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
    state = model.data_parallel.state
    fp32 = state.param_dtype == torch.float32  # fp32 weights are their own masters
    kinds = optimizer.state_kinds if fp32 else ("master", *optimizer.state_kinds)
    states = {kind: optimizer.state(kind) for kind in kinds}
    states["model"] = state.owned_params()
    out = []
    for saved in saved_slices(model):
        # The optimizer's states are per owned piece, so they count from the piece's start.
        start = state.layout.pieces[saved.owner].start
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
