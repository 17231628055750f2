"""Checkpoint tools that run in one process, without a cluster: reshard and consolidate.

`reshard` rewrites a checkpoint as if saved from another mesh: for every rank of the new layout it builds
that rank's model on the meta device (layout.py: shapes only), reads the slices it would have saved, and
writes them to its file, so a run on that layout reads only its own dp group's files. Any layout can load
the original too; resharding saves that reading at start, and the manifest describes the mesh in use.

`consolidate` writes every weight at its full shape into one safetensors file, with the config and the
tokenizer, in the form of a finished run directory (serialize/weights.py; `femtotron generate` reads it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from femtotron.atomic import atomic_path
from femtotron.config import Config, load_config_dict
from femtotron.layout import meta_rank_model
from femtotron.serialize.checkpoint import commit, mesh_of, resolve, saved_slices
from femtotron.serialize.files import CheckpointError, CheckpointReader, Slice, file_record, write_rank_file
from femtotron.serialize.weights import TOKENIZER_FILE, WEIGHTS_FILE, write_config, write_parts

SOURCE = "the CHECKPOINT argument"

KINDS = ("model", "master", "exp_avg", "exp_avg_sq")


def reshard(source: Path, out: Path, overrides: list[str]) -> Path:
    """Write the checkpoint at (or latest under) `source` into the checkpoints directory `out`, laid out
    for the config the checkpoint was saved with plus `overrides` (e.g. parallelism.tp=4)."""
    directory, _ = resolve(source, SOURCE)
    if out.resolve() == directory.parent.resolve():
        raise CheckpointError(
            f"--out {out} is the directory the checkpoint {directory.name} is in: resharding "
            "there would replace the checkpoint it reads. Choose another --out."
        )
    with CheckpointReader(directory, verify_all=True) as reader:
        manifest = reader.manifest
        config = load_config_dict(manifest["config"], overrides=overrides)
        tmp = out / f".tmp-{directory.name}"
        final = out / directory.name
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        # Offline there are no RNG states to keep: each rank's file holds its slices alone.
        records = [
            write_rank_file(tmp, rank, rank_slices(config, rank, reader), extra={}, metadata={})
            for rank in range(config.parallelism.world_size)
        ]
        if (directory / TOKENIZER_FILE).is_file():
            shutil.copyfile(directory / TOKENIZER_FILE, tmp / TOKENIZER_FILE)
            records.append(file_record(tmp / TOKENIZER_FILE))
        # The run state as saved; build_manifest and commit write the rest again (format, files, rng...).
        rewritten = ("format", "version", "files", "tensors", "rng")
        state = {k: v for k, v in manifest.items() if k not in rewritten}
        state.update(mesh=mesh_of(config), world_size=len(records), config=config.to_dict())
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
    `with_optimizer`: also fp32 master weights and Adam moments (`optimizer.safetensors`, `<kind>/<name>`)."""
    directory, _ = resolve(source, SOURCE)
    out.mkdir(parents=True, exist_ok=True)
    with CheckpointReader(directory, verify_all=True) as reader:

        def full(tensor: str) -> torch.Tensor:
            shape = reader.shape(tensor)
            return reader.read(tensor, ((0,) * len(shape), shape))

        step = str(reader.manifest["step"])
        files = {WEIGHTS_FILE: lambda name: name.startswith("model/")}
        if with_optimizer:
            files["optimizer.safetensors"] = lambda name: not name.startswith("model/")
        for file, wanted in files.items():  # one file's tensors in memory at a time
            tensors = {name.removeprefix("model/"): full(name) for name in reader.tensors if wanted(name)}
            with atomic_path(out / file) as tmp:
                save_file(tensors, tmp, metadata={"step": step})
        config = reader.manifest["config"]
        named = (config.get("tokenizer") or {}).get("tokenizer_name_or_path")
        if TOKENIZER_FILE in reader.manifest["files"]:
            reader.verify(TOKENIZER_FILE)
            shutil.copyfile(directory / TOKENIZER_FILE, out / TOKENIZER_FILE)
        elif named and Path(named).is_file():  # a checkpoint written before checkpoints held their tokenizer
            shutil.copyfile(named, out / TOKENIZER_FILE)
    write_config(out, config)
    write_parts(out, [WEIGHTS_FILE])
    return out
