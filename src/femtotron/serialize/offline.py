"""Checkpoint tools that run in one process, without a cluster: reshard and consolidate.

`reshard` rewrites a checkpoint as if saved from another mesh: for every rank of the new layout it builds
that rank's model on the meta device (layout.py: shapes only), reads the slices it would have saved, and
writes them to its file, so a run on that layout reads only its own dp group's files. Any layout can load
the original too; resharding saves that reading at start, and the manifest describes the mesh in use.

`consolidate` writes every weight at its full shape into one safetensors file, with the config and the
tokenizer, in the form of a finished run directory (serialize/weights.py; `femtotron generate` reads it).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from femtotron.atomic import atomic_path, copy_file, remove
from femtotron.config import Config, LlamaConfig, load_config_dict
from femtotron.layout import meta_rank_model
from femtotron.serialize.files import (
    MANIFEST,
    CheckpointError,
    CheckpointReader,
    Slice,
    file_record,
    write_rank_file,
)
from femtotron.serialize.restore import check_optimizer_matches
from femtotron.serialize.resume_source import resolve
from femtotron.serialize.saving import commit, mesh_of, saved_slices
from femtotron.serialize.weights import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    shape_problem,
    staged_outputs,
    write_config,
    write_parts,
)

SOURCE = "the CHECKPOINT argument"

KINDS = ("model", "master", "exp_avg", "exp_avg_sq", "momentum")


def reshard(source: Path, out: Path, overrides: list[str], sources: dict[str, str] | None = None) -> Path:
    """Write the checkpoint at (or latest under) `source` into the checkpoints directory `out`, laid out
    for the config the checkpoint was saved with plus `overrides` (e.g. parallelism.tp=4). `sources`: the
    option each override came from, for messages (e.g. {"parallelism.tp=4": "--tp 4"})."""
    directory, _ = resolve(source, SOURCE)
    if out.resolve() == directory.parent.resolve():
        raise CheckpointError(
            f"--out {out} is the directory the checkpoint {directory.name} is in: resharding "
            "there would replace the checkpoint it reads. Choose another --out."
        )
    with CheckpointReader(directory, verify_all=True) as reader:
        manifest = reader.manifest
        config = load_config_dict(manifest["config"], f"in checkpoint {directory}", overrides, sources)
        check_shapes(reader, config)
        check_optimizer_matches(manifest, config, directory)  # the state it holds is one optimizer's
        tmp = out / f".tmp-{directory.name}"
        final = out / directory.name
        remove(tmp)  # a killed reshard's, or a link planted there: never written through
        tmp.mkdir(parents=True)
        # Offline there are no RNG states to keep: each rank's file holds its slices alone.
        records = [
            write_rank_file(tmp, rank, rank_slices(config, rank, reader), extra={}, metadata={})
            for rank in range(config.parallelism.world_size)
        ]
        if copy_tokenizer(reader, tmp):
            records.append(file_record(tmp / TOKENIZER_FILE))
        # The run state as saved; build_manifest and commit write the rest again (format, files, rng...).
        rewritten = ("format", "version", "files", "tensors", "rng")
        state = {k: v for k, v in manifest.items() if k not in rewritten}
        # The ranks of the new mesh: the records also list the tokenizer's file.
        world_size = config.parallelism.world_size
        state.update(mesh=mesh_of(config), world_size=world_size, config=config.to_dict())
        commit(tmp, final, state, records)
    return final


def rank_slices(config: Config, rank: int, reader: CheckpointReader) -> list[Slice]:
    """What `rank` of `config`'s mesh would save, with the values read from `reader`."""
    model = meta_rank_model(config, rank)
    out = []
    for saved in saved_slices(model):
        for kind in KINDS:
            tensor = f"{kind}/{saved.name}"
            # An fp32 checkpoint has no master weights: its model weights are the masters.
            if reader.has(tensor):
                box = saved.place.target
                out.append(Slice(tensor, saved.shape, box, reader.read(tensor, box)))
    return out


def consolidate(source: Path, out: Path, with_optimizer: bool = False) -> Path:
    """A run directory in `out`: full-shape weights (`model.safetensors`), `config.yaml` and the tokenizer;
    `with_optimizer`: also fp32 master weights and the optimizer's moments (`optimizer.safetensors`,
    `<kind>/<name>`: Adam's `exp_avg`, `exp_avg_sq`; Muon's `momentum`)."""
    directory, _ = resolve(source, SOURCE)
    with (
        CheckpointReader(directory, verify_all=True) as reader,
        staged_outputs(out, CONFIG_FILE, directory) as staging,
    ):

        def full(tensor: str) -> torch.Tensor:
            shape = reader.shape(tensor)
            return reader.read(tensor, ((0,) * len(shape), shape))

        check_shapes(reader, load_config_dict(reader.manifest["config"], f"in checkpoint {directory}"))
        step = str(reader.manifest["step"])
        files = {WEIGHTS_FILE: lambda name: name.startswith("model/")}
        if with_optimizer:
            files["optimizer.safetensors"] = lambda name: not name.startswith("model/")
        for file, wanted in files.items():  # one file's tensors in memory at a time
            tensors = {name.removeprefix("model/"): full(name) for name in reader.tensors if wanted(name)}
            with atomic_path(staging / file) as tmp:
                save_file(tensors, tmp, metadata={"step": step})
        copy_tokenizer(reader, staging)
        write_config(staging, reader.manifest["config"])
        write_parts(staging, [WEIGHTS_FILE])
    return out


def check_shapes(reader: CheckpointReader, config: Config) -> None:
    """Refuse a checkpoint whose tensors do not have the shapes its config makes (a zero dimension among them,
    which consolidated into an empty embedding), naming the manifest and the tensor."""
    shapes = {tensor: reader.shape(tensor) for tensor in reader.tensors}
    weights = {tensor: shape for tensor, shape in shapes.items() if tensor.startswith("model/")}
    where = str(reader.directory / MANIFEST)

    def saved_names(state: dict[str, torch.Tensor], _: LlamaConfig) -> dict[str, torch.Tensor]:
        return {f"model/{name}": tensor for name, tensor in state.items()}

    problem = shape_problem(config.model.model_config_, weights, where, "its config", saved_names)
    if problem is None:
        for tensor, shape in shapes.items():  # the optimizer's state has its weight's shape
            weight = f"model/{tensor.partition('/')[2]}"
            if shape != shapes.get(weight):
                problem = (
                    f"{tensor} in {where} has shape {shape}, unlike {weight} ({shapes.get(weight, 'absent')})"
                )
                break
    if problem is not None:
        raise CheckpointError(f"{problem}: the checkpoint is damaged. Use an earlier checkpoint.")


def copy_tokenizer(reader: CheckpointReader, directory: Path) -> bool:
    """The checkpoint's tokenizer.json into `directory`, checked against the manifest's checksum, if the
    manifest lists one. Never a file the manifest's config names: that path can point anywhere."""
    if TOKENIZER_FILE not in reader.manifest["files"]:
        return False
    reader.verify(TOKENIZER_FILE)
    copy_file(reader.directory / TOKENIZER_FILE, directory / TOKENIZER_FILE)
    return True
