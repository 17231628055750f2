"""Resume from a checkpoint: check that it fits this run, then fill each rank's tensors from it.

Load: the manifest says where every slice is, so each rank reads exactly the boxes its layout needs, also
when the mesh changed (C1): weights, master weights, Adam moments and step count, the train state, and each
rank's RNG states when the mesh is unchanged (C3).

Before any tensor is read the checkpoint is checked against the run: its model (`MODEL_FIELDS`, named field
by field), its optimizer, and its data (refused on other data unless checkpoints.resume_with_other_data).
Which checkpoint is loaded is serialize/resume_source.py's choice.

A load takes the pieces it needs (`TrainingParts`), never the trainer.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from femtotron.config import Config, LlamaConfig
from femtotron.config.sections import MoEConfig
from femtotron.data.run_data import data_changes, data_identity
from femtotron.errors import ConfigError, FemtotronError
from femtotron.layout import RankModel
from femtotron.mesh import ADDED_LATER
from femtotron.optim.zero import ZeroOptimizer
from femtotron.serialize.files import MANIFEST, CheckpointError, CheckpointReader
from femtotron.serialize.geometry import placements
from femtotron.serialize.resume_source import EXPLICIT, decided_by_rank_0, resolve
from femtotron.serialize.saving import data_size, mesh_of
from femtotron.train_state import TrainingParts

# The model_config fields (moe.KEY: MoEConfig's) that change no saved tensor and not what the weights mean:
# a checkpoint loads into a model that differs in them, so a run may change them when it resumes.
NOT_CHECKED = frozenset(
    {
        "max_position_embeddings",  # RoPE has no weights: a resume may lengthen the context
        "rope_theta",  # nor do its base and scaling, which a long-context continuation changes
        "rope_scaling",
        "rms_norm_eps",  # the norms' guard against dividing by zero, not part of what they learned
        "logits_z_loss_coef",  # terms of the loss, not of the model
        "moe.aux_loss_coef",
        "moe.z_loss_coef",
        "moe.capacity_factor",  # how many of a micro-batch's tokens an expert takes in training
    }
)


def model_fields() -> tuple[str, ...]:
    """LlamaConfig's fields in their order, its MoEConfig's as moe.KEY, less NOT_CHECKED."""
    fields = []
    for name in LlamaConfig.model_fields:
        fields += [f"moe.{key}" for key in MoEConfig.model_fields] if name == "moe" else [name]
    return tuple(field for field in fields if field not in NOT_CHECKED)


# The model_config fields that decide the tensors' shapes, and what the model computes with them: a
# checkpoint only loads into an equal model. Derived, so that a field added to LlamaConfig is checked unless
# NOT_CHECKED declares it.
MODEL_FIELDS = model_fields()


def saved_mesh(manifest: dict[str, Any]) -> dict[str, Any]:
    """A manifest's `mesh`, with the dimensions added after it was written at their size then: 1."""
    return {name: 1 for name in ADDED_LATER} | manifest["mesh"]


def model_differences(saved: dict[str, Any], config: Config, where: str, fields=MODEL_FIELDS) -> list[str]:
    """The model_config fields (by default those that decide the tensors' shapes and what the model computes
    with them) that differ, as lines. `saved` is read as a LlamaConfig: a manifest written before a field
    existed has its default."""

    def flat(values: dict[str, Any]) -> dict[str, Any]:
        """moe's keys as moe.KEY; the dense MLP's size only where a layer is dense."""
        moe = {f"moe.{key}": value for key, value in (values.get("moe") or {}).items()}
        unused = {"intermediate_size": None} if moe and not moe["moe.dense_layers"] else {}
        return values | moe | unused

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
    state = model.data_parallel.state
    if state.zero.shards_parameters:
        fill_pieces(model, state.owned_params(), reader, tensor_of)
        return
    for name, param in model.named_parameters():
        fill(param.data.view(-1), param, start=0, stop=param.numel(), reader=reader, tensor=tensor_of(name))


def fill_pieces(
    model: RankModel, targets: list[torch.Tensor], reader: CheckpointReader, tensor_of: Callable[[str], str]
) -> None:
    """Per owned piece (FlatLayout.pieces), its elements of the parameter's tensor into its target."""
    named = model.named_parameters()
    layout = model.data_parallel.layout
    for piece, target in zip(layout.pieces, targets, strict=True):
        if target is None:  # a state the other optimizer keeps (optim/zero.py)
            continue
        name, param = named[piece.param]
        offset = layout.offsets[piece.param]
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


def set_rng_state(reader: CheckpointReader, file: str) -> None:
    states = json.loads(reader.metadata(file)["rng"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached))
    torch.set_rng_state(reader.extra(file, "rng/torch_cpu"))
    if torch.cuda.is_available() and "rng/torch_cuda" in reader.keys(file):  # absent when saved without GPUs
        torch.cuda.set_rng_state(reader.extra(file, "rng/torch_cuda"))
