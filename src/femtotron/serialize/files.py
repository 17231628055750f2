"""The checkpoint format on disk: a manifest and safetensors files of slices of global tensors.

    step-0000006/
      manifest.json            format version, step, counters, config, mesh, per-file checksums, and for
                               every tensor its global shape, dtype and which file holds which slice
      rank-00000.safetensors   the slices rank 0 wrote, and its RNG states
      ...

Tensor names are `<kind>/<parameter name>`: `model` (weights, the model's dtype), `master` (fp32 masters,
absent when the model is fp32), `exp_avg` and `exp_avg_sq` (Adam, fp32). Nothing unpickles: safetensors, JSON.

A checkpoint may come from elsewhere, its manifest made by hand: every manifest read is checked before any
tensor is (`check_manifest`), so that none reads outside its directory, leaves part of a tensor to
`torch.empty`'s contents, or makes a reader allocate more than its files hold.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from femtotron.atomic import atomic_path
from femtotron.errors import FemtotronError
from femtotron.serialize.geometry import Box, first_overlap, intersect, relative, volume

FORMAT = "femtotron-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
DTYPES = {name: getattr(torch, name) for name in ("float32", "bfloat16", "float16", "uint8")}


class Slice(NamedTuple):
    """Part of a global tensor that one rank writes: the values of `box` of tensor `tensor`."""

    tensor: str  # <kind>/<parameter name>
    shape: tuple[int, ...]  # the global tensor's
    box: Box
    values: torch.Tensor


class CheckpointError(FemtotronError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the run."""

    exit_code = 6


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, text: str) -> None:
    """Write `text` and flush it to the disk before returning (a rename after it then commits real data)."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def write_rank_file(
    directory: Path, rank: int, slices: list[Slice], extra: dict[str, torch.Tensor], metadata: dict[str, str]
) -> dict[str, Any]:
    """Write a rank's slices, `extra` tensors (RNG states) and `metadata` strings; return its file record."""
    tensors = dict(extra)
    records = []
    for index, piece in enumerate(slices):
        # The index keeps the keys apart: one rank may hold several slices of the same tensor.
        key = f"{index}:{piece.tensor}"
        tensors[key] = piece.values.detach().to("cpu").contiguous()
        start, stop = piece.box
        records.append(
            {
                "tensor": piece.tensor,
                "shape": piece.shape,
                "dtype": str(piece.values.dtype).removeprefix("torch."),
                "key": key,
                "start": start,
                "stop": stop,
            }
        )
    path = directory / rank_file(rank)
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    return file_record(path) | {"slices": records}


def file_record(path: Path) -> dict[str, Any]:
    """What the manifest knows of a file besides slices (the tokenizer): its name, sha256 and size."""
    return {"file": path.name, "sha256": sha256_of(path), "bytes": path.stat().st_size, "slices": []}


def build_manifest(state: dict[str, Any], files: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest from the run state (step, counters, config, mesh, ...) and every file's record."""
    tensors: dict[str, dict[str, Any]] = {}
    for record in files:
        for piece in record["slices"]:
            entry = tensors.setdefault(
                piece["tensor"], {"shape": list(piece["shape"]), "dtype": piece["dtype"], "slices": []}
            )
            where = {"file": record["file"], "key": piece["key"]}
            entry["slices"].append(where | {"start": list(piece["start"]), "stop": list(piece["stop"])})
    return {
        "format": FORMAT,
        "version": VERSION,
        **state,
        "files": {r["file"]: {"sha256": r["sha256"], "bytes": r["bytes"]} for r in files},
        "tensors": dict(sorted(tensors.items())),
    }


class CheckpointReader:
    """Reads slices of global tensors from a committed checkpoint, checking each file's size (`verify_all`:
    and sha256; a distributed load has each rank `verify` a share instead). Use as a context manager."""

    def __init__(self, directory: str | os.PathLike, verify_all: bool = False) -> None:
        self.directory = Path(directory)
        self.verify_all = verify_all
        self.manifest = read_manifest(self.directory)
        self.tensors: dict[str, Any] = self.manifest["tensors"]
        self._open: dict[str, Any] = {}
        self._verified: set[str] = set()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._open.clear()

    def has(self, tensor: str) -> bool:
        return tensor in self.tensors

    def _path(self, name: str) -> Path:
        """The file `name`, after checking the manifest lists it, it exists and has the listed size."""
        path = self.directory / name
        if path.resolve().parent != self.directory.resolve():
            raise CheckpointError(
                f"checkpoint file {path} is a link to {path.resolve()}, outside the checkpoint: a checkpoint "
                "from elsewhere may not read other files. Copy the files themselves into the checkpoint."
            )
        expected = self.manifest["files"].get(name)
        if expected is None:
            raise CheckpointError(
                f"{self.directory / MANIFEST} names a slice in {name} but lists no such file: "
                "the manifest is damaged. Resume from an earlier checkpoint."
            )
        if not path.is_file():
            raise CheckpointError(
                f"checkpoint file {path} is missing (the manifest lists it). Copy the whole "
                "checkpoint directory again, or resume from an earlier checkpoint."
            )
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(
                f"checkpoint file {path} has {size:,} bytes but the manifest says "
                f"{expected['bytes']:,}: it is truncated or was overwritten. Copy the "
                "checkpoint again, or resume from an earlier checkpoint."
            )
        return path

    def verify(self, name: str) -> None:
        """Check file `name`'s sha256 against the manifest."""
        if name in self._verified:
            return
        path = self._path(name)
        if sha256_of(path) != self.manifest["files"][name]["sha256"]:
            raise CheckpointError(
                f"checkpoint file {path} fails its sha256 checksum (the manifest has "
                f"{self.manifest['files'][name]['sha256'][:16]}...): its contents are corrupt. "
                "Copy the checkpoint again, or resume from an earlier checkpoint."
            )
        self._verified.add(name)

    def _file(self, name: str) -> Any:
        if name not in self._open:
            path = self._path(name)
            if self.verify_all:
                self.verify(name)
            try:
                self._open[name] = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(
                    f"checkpoint file {path} cannot be read as safetensors ({e}). Resume from "
                    "an earlier checkpoint."
                ) from None
        return self._open[name]

    def keys(self, name: str) -> list[str]:
        return list(self._file(name).keys())

    def shape(self, tensor: str) -> tuple[int, ...]:
        return tuple(self._entry(tensor)["shape"])

    def _entry(self, tensor: str) -> dict[str, Any]:
        if tensor not in self.tensors:
            raise CheckpointError(
                f"checkpoint {self.directory} holds no tensor {tensor!r}: it was saved from a "
                "different model. Check model.model_config against the checkpoint's config "
                f"({self.directory / MANIFEST})."
            )
        return self.tensors[tensor]

    def read(self, tensor: str, box: Box) -> torch.Tensor:
        """The part `box` of global tensor `tensor`, assembled from every slice that overlaps it."""
        entry = self._entry(tensor)
        overlaps = []
        for piece in entry["slices"]:
            stored = (tuple(piece["start"]), tuple(piece["stop"]))
            overlap = intersect(box, stored)
            if overlap is not None:  # each file checked against the manifest before anything is allocated
                overlaps.append((piece, stored, overlap, self._file(piece["file"])))
        out = torch.empty([h - lo for lo, h in zip(*box, strict=True)], dtype=DTYPES[entry["dtype"]])
        covered = 0
        for piece, stored, overlap, file in overlaps:
            try:
                values = file.get_slice(piece["key"])[relative(overlap, stored[0])]
            except SafetensorError as e:
                raise CheckpointError(
                    f"checkpoint file {self.directory / piece['file']}: cannot read "
                    f"{piece['key']} ({e}). Resume from an earlier checkpoint."
                ) from None
            out[relative(overlap, box[0])] = values
            covered += volume(overlap)
        if covered != volume(box):
            raise CheckpointError(
                f"checkpoint {self.directory}: the slices of {tensor} cover {covered:,} of the "
                f"{volume(box):,} elements asked for ({box}): files are missing from the "
                "manifest. Resume from an earlier checkpoint."
            )
        return out

    def metadata(self, name: str) -> dict[str, str]:
        return self._file(name).metadata() or {}

    def extra(self, name: str, key: str) -> torch.Tensor:
        try:
            return self._file(name).get_tensor(key)
        except SafetensorError as e:
            raise CheckpointError(
                f"checkpoint file {self.directory / name}: cannot read {key} ({e}). Resume from "
                "an earlier checkpoint."
            ) from None


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{directory} is not a committed checkpoint: it has no {MANIFEST} (a save that "
            "did not finish leaves none). Give a step-NNNNNNN directory that has one, or the "
            "checkpoints directory that holds them (its latest is taken)."
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(
            f"{path} is not valid JSON ({type(e).__name__}: {e}): the checkpoint is damaged. Resume from an "
            "earlier checkpoint."
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f'{path} is not a femtotron checkpoint manifest (no "format": "{FORMAT}").')
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{path} has format version {manifest.get('version')!r}; this femtotron reads "
            f"version {VERSION}. Use the femtotron version that wrote it (or convert it with "
            "that version's `femtotron consolidate`)."
        )
    for key in ("step", "config", "mesh", "files", "tensors"):
        if key not in manifest:
            raise CheckpointError(
                f"{path} lacks the field {key!r}: the manifest is damaged. Resume from an earlier checkpoint."
            )
    check_manifest(manifest, path)
    return manifest


def check_manifest(manifest: dict[str, Any], path: Path) -> None:
    """Refuse a manifest (made by hand, or damaged) that would read outside the checkpoint, leave part of a
    tensor unread, or allocate more than its files hold, with the entry that is wrong."""

    def wrong(entry: str, rule: str) -> CheckpointError:
        return CheckpointError(
            f"{path}: {entry} {rule}: the manifest is damaged or was not written by femtotron. Resume from "
            "an earlier checkpoint, or copy this one again from where it was saved."
        )

    counters = ("step", "consumed_samples", "consumed_tokens", "non_finite_skips", "optimizer_steps")
    for key in (*counters, "committed_at"):
        if key in manifest and (type(manifest[key]) is not int or manifest[key] < 0):
            raise wrong(f'"{key}": {manifest[key]!r}', "is not a whole number >= 0")
    stages = manifest.get("data_stages", [])
    for record in stages if isinstance(stages, list) else [None]:
        whole = isinstance(record, dict) and isinstance(record.get("name"), str)
        if not whole or not all(type(record.get(k)) is int and record[k] >= 0 for k in ("step", "samples")):
            raise wrong('"data_stages"', "is not a list of records of a name, a step and samples")
    for key in ("config", "mesh", "files", "tensors"):
        if not isinstance(manifest[key], dict):
            raise wrong(f'"{key}"', f"is a {type(manifest[key]).__name__}, not a mapping")
    for name, record in manifest["files"].items():
        if name in ("", ".", "..") or Path(name).name != name:
            raise wrong(f"file {name!r}", "is not a plain file name inside the checkpoint directory")
        if not isinstance(record, dict) or type(record.get("bytes")) is not int or record["bytes"] < 0:
            raise wrong(f"file {name!r}", 'has no "bytes": a whole number >= 0')
        if not isinstance(record.get("sha256"), str):
            raise wrong(f"file {name!r}", 'has no "sha256" string')
    needed = dict.fromkeys(manifest["files"], 0)  # bytes of slices per file, bounded by the file's size
    for tensor, entry in manifest["tensors"].items():
        check_tensor_entry(entry, needed, lambda rule, name=tensor: wrong(f"tensor {name!r}", rule))
    for name, count in needed.items():
        if count > manifest["files"][name]["bytes"]:
            raise wrong(
                f"file {name!r}",
                f"is listed with {manifest['files'][name]['bytes']:,} bytes but holds "
                f"slices of {count:,} bytes",
            )


def check_tensor_entry(entry: Any, needed: dict[str, int], wrong: Callable[[str], CheckpointError]) -> None:
    """One tensor's entry: a known dtype, a shape, and slices inside it covering it exactly once, each in a
    listed file (`needed`: bytes per file, added to)."""
    if not isinstance(entry, dict):
        raise wrong("is not a mapping")
    if entry.get("dtype") not in DTYPES:
        raise wrong(f"has dtype {entry.get('dtype')!r}; known: {', '.join(DTYPES)}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise wrong(f"has shape {shape!r}, not a list of whole numbers >= 0")
    slices = entry.get("slices")
    if not isinstance(slices, list):
        raise wrong('has no list of "slices"')
    boxes = []
    for piece in slices:
        if (
            not isinstance(piece, dict)
            or piece.get("file") not in needed
            or not isinstance(piece.get("key"), str)
        ):
            raise wrong(f"has a slice {piece!r} whose file is not in the manifest's files (or has no key)")
        start = piece.get("start")
        stop = piece.get("stop")
        if not (within(start, stop, shape)):
            raise wrong(f"has a slice [{start}, {stop}) outside its shape {shape}")
        boxes.append((tuple(start), tuple(stop)))
        needed[piece["file"]] += volume(boxes[-1]) * DTYPES[entry["dtype"]].itemsize
    overlap = first_overlap(boxes)
    if overlap is not None:
        raise wrong(f"has overlapping slices {overlap[0]} and {overlap[1]}")
    covered = sum(volume(box) for box in boxes)
    if covered != math.prod(shape):
        raise wrong(f"has slices covering {covered:,} of its {math.prod(shape):,} elements")


def within(start: Any, stop: Any, shape: list[int]) -> bool:
    """Whether [start, stop) is a non-empty box of whole numbers inside `shape`."""
    if not (isinstance(start, list) and isinstance(stop, list) and len(start) == len(stop) == len(shape)):
        return False
    bounds = zip(start, stop, shape, strict=True)
    return all(type(low) is int and type(high) is int and 0 <= low < high <= n for low, high, n in bounds)
