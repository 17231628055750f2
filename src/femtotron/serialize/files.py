"""The checkpoint format on disk: a manifest and safetensors files of slices of global tensors.

    step-0000006/
      manifest.json            format version, step, counters, config, mesh, per-file checksums, and for
                               every tensor its global shape, dtype and which file holds which slice
      rank-00000.safetensors   the slices rank 0 wrote, and its RNG states
      ...

Tensor names are `<kind>/<parameter name>`: `model` (weights, the model's dtype), `master` (fp32 masters,
absent when the model is fp32), `exp_avg` and `exp_avg_sq` (Adam, fp32). Nothing unpickles: safetensors, JSON.

Checksums (format version 2) are XXH3-128, computed while a file is written, never by reading it back: a
rank file records one for its header and one for each tensor's bytes (together every byte of the file), so
a load checks each tensor it reads as it reads it, in the same pass, instead of reading every file twice
(version 1's per-file sha256, still read). Version 3 adds the manifest's own (`MANIFEST_CHECKSUM`). XXH3 is
not cryptographic, and need not be: whoever can change a file can change the manifest beside it; the
checksums find disks, copies and transfers that lost bytes.
The safetensors files are written and read here, not by the safetensors library, so that the bytes go from
the tensors to the file (and back) without another copy, hashed on the way, with the GIL released for the
background writes of `checkpoints.async_save`.

A checkpoint may come from elsewhere, its manifest made by hand: every manifest read is checked before any
tensor is (`check_manifest`), so that none reads outside its directory, leaves part of a tensor to
`torch.empty`'s contents, or makes a reader allocate more than its files hold.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import xxhash

from femtotron.atomic import atomic_path
from femtotron.crash_points import crash_point
from femtotron.errors import FemtotronError
from femtotron.serialize.geometry import Box, first_overlap, intersect, relative, volume

FORMAT = "femtotron-checkpoint"
VERSION = 3
# 1: a sha256 per file, checked by reading the file a second time; 2: no checksum of the manifest itself
READABLE_VERSIONS = (1, 2, 3)
MANIFEST = "manifest.json"
MANIFEST_CHECKSUM = "manifest_xxh3_128"  # of the manifest's other fields: a changed step or shape is found
DTYPES = {name: getattr(torch, name) for name in ("float32", "bfloat16", "float16", "uint8")}
# safetensors' names for them
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "U8": torch.uint8}
DTYPE_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
WHOLE_FILE = "xxh3_128"  # a file's record: the checksum of all its bytes (the tokenizer)
PARTS = "parts_xxh3_128"  # a rank file's record: the checksum of its header and of each tensor's bytes
HEADER = "__header__"  # the header's part (safetensors reserves names with __ for itself)
LARGEST_HEADER = 100 << 20  # as the safetensors library: no manifest-listed file makes us parse more


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


def checksum_of(path: Path, kind: str = WHOLE_FILE) -> str:
    """The whole file's checksum: XXH3-128 (`WHOLE_FILE`), or "sha256" (format version 1's)."""
    digest = xxhash.xxh3_128() if kind == WHOLE_FILE else hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, list[str]]:
    """A safetensors file's first bytes (length, JSON header padded to 8 bytes) and the order of the tensors'
    data after it: widest dtype first, so that every tensor starts aligned to its element size."""
    order = sorted(tensors, key=lambda key: -tensors[key].element_size())
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key in order:
        size = tensors[key].numel() * tensors[key].element_size()
        header[key] = {
            "dtype": DTYPE_CODES[tensors[key].dtype],
            "shape": list(tensors[key].shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text, order


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> tuple[dict[str, str], int]:
    """Write `tensors` (contiguous, on the CPU) as safetensors at `path` atomically and fsynced, hashing
    every part on the way; return the parts' checksums (`HEADER` and one per tensor) and the file's size. A
    file system with fewer free bytes than the file needs fails before anything is written (ENOSPC)."""
    head, order = safetensors_header(tensors, metadata)
    size = len(head) + sum(t.numel() * t.element_size() for t in tensors.values())
    if size > shutil.disk_usage(path.parent).free:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    parts = {HEADER: xxhash.xxh3_128_hexdigest(head)}
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(head)
        for key in order:
            data = as_bytes(tensors[key])
            parts[key] = xxhash.xxh3_128_hexdigest(data)
            f.write(data)
            crash_point("checkpoint.tensor_written")
        f.flush()
        os.fsync(f.fileno())
    return parts, size


def write_rank_file(
    directory: Path, rank: int, slices: list[Slice], extra: dict[str, torch.Tensor], metadata: dict[str, str]
) -> dict[str, Any]:
    """Write a rank's slices, `extra` tensors (RNG states) and `metadata` strings; return its file record.
    A disk without room for the file fails before anything is written, naming the bytes it needs."""
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
    try:
        parts, size = write_safetensors(path, tensors, metadata)
    except OSError as e:  # a WriteError too: atomic_path's, of the same errno
        reason = os.strerror(e.errno) if e.errno else str(e)
        needed = len(safetensors_header(tensors, metadata)[0]) + sum(t.nbytes for t in tensors.values())
        raise CheckpointError(
            f"cannot write checkpoint file {path}: {reason}. It needs {needed:,} bytes; "
            f"{shutil.disk_usage(directory).free:,} are free there. Free space, lower "
            "checkpoints.keep_last_n, or set checkpoints.checkpoints_path to a file system with room; the "
            "previous checkpoint is intact."
        ) from None
    return {"file": path.name, "bytes": size, PARTS: parts, "slices": records}


def file_record(path: Path) -> dict[str, Any]:
    """What the manifest knows of a file besides slices (the tokenizer): its name, checksum and size."""
    return {"file": path.name, WHOLE_FILE: checksum_of(path), "bytes": path.stat().st_size, "slices": []}


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
    return sealed(
        {
            "format": FORMAT,
            "version": VERSION,
            **state,
            "files": {r["file"]: {k: v for k, v in r.items() if k not in ("file", "slices")} for r in files},
            "tensors": dict(sorted(tensors.items())),
        }
    )


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """XXH3-128 of the manifest's fields but this checksum, written canonically (sorted keys): the same fields
    give the same checksum however the file is laid out, and one changed digit (a step 4 read as 6) fails."""
    fields = {key: value for key, value in manifest.items() if key != MANIFEST_CHECKSUM}
    return xxhash.xxh3_128_hexdigest(json.dumps(fields, sort_keys=True).encode())


def sealed(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest with its own checksum (`MANIFEST_CHECKSUM`)."""
    return {**manifest, MANIFEST_CHECKSUM: manifest_checksum(manifest)}


class SafetensorsFile:
    """One safetensors file of a checkpoint, mapped into memory: its header parsed and checked against the
    file's size, each tensor's bytes checked against the manifest's checksum the first time it is read."""

    def __init__(self, path: Path, checksums: dict[str, str] | None) -> None:
        self.path = path
        self.checksums = checksums  # None: a version-1 file, checked whole by sha256 instead
        self._checked: set[str] = set()
        with open(path, "rb") as f:
            # ACCESS_COPY: a private mapping, writable as torch wants its buffers; nothing reaches the file.
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        length = int.from_bytes(self.map[:8], "little") if len(self.map) >= 8 else -1
        if not 0 < length <= min(len(self.map) - 8, LARGEST_HEADER):
            raise self.error(f"has no safetensors header (its first 8 bytes give a length of {length:,})")
        self.data_start = 8 + length
        self._check(HEADER, memoryview(self.map)[: self.data_start])
        try:
            header = json.loads(bytes(self.map[8 : self.data_start]))
        except (ValueError, RecursionError) as e:  # also a number of over 4,300 digits
            raise self.error(f"has a header that is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise self.error("has a header that is not a JSON object")
        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self.error("has __metadata__ that is not a mapping of strings")
        self.metadata: dict[str, str] = metadata
        self.entries: dict[str, tuple[torch.dtype, list[int], int, int]] = {}
        for key, entry in header.items():
            self.entries[key] = self._entry(key, entry)

    def error(self, problem: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint file {self.path} {problem}: it is corrupt or not a checkpoint file. Copy the "
            "checkpoint again, or resume from an earlier checkpoint."
        )

    def _entry(self, key: str, entry: Any) -> tuple[torch.dtype, list[int], int, int]:
        """A header entry as (dtype, shape, first byte, end byte), after checking it lies inside the file."""
        fields = entry if isinstance(entry, dict) else {}
        dtype = SAFETENSORS_DTYPES.get(fields.get("dtype"))
        shape = fields.get("shape")
        offsets = fields.get("data_offsets")
        if (
            dtype is None
            or not isinstance(shape, list)
            or not all(type(n) is int and n >= 0 for n in shape)
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(n) is int for n in offsets)
        ):
            raise self.error(
                f"has a header entry {key!r} that is not a tensor of {', '.join(SAFETENSORS_DTYPES)}"
            )
        begin = self.data_start + offsets[0]
        end = self.data_start + offsets[1]
        if (
            not (self.data_start <= begin <= end <= len(self.map))
            or end - begin != math.prod(shape) * dtype.itemsize
        ):
            raise self.error(f"has tensor {key!r} at bytes {offsets} that do not hold its shape {shape}")
        return dtype, shape, begin, end

    def _check(self, part: str, data: memoryview) -> None:
        if self.checksums is None or part in self._checked:
            return
        if xxhash.xxh3_128_hexdigest(data) != self.checksums.get(part):
            what = "header" if part == HEADER else f"tensor {part!r}"
            raise self.error(f"fails its checksum for its {what} (XXH3-128 against the manifest)")
        self._checked.add(part)

    def keys(self) -> list[str]:
        return list(self.entries)

    def tensor(self, key: str) -> torch.Tensor:
        """Tensor `key` as a view of the file's bytes (read, and checked, on first use)."""
        if key not in self.entries:
            raise self.error(f"holds no tensor {key!r} (the manifest names it)")
        dtype, shape, begin, end = self.entries[key]
        self._check(key, memoryview(self.map)[begin:end])
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(
            self.map, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=begin
        ).view(shape)

    def check_all(self) -> None:
        for key in self.entries:
            self.tensor(key)


class CheckpointReader:
    """Reads slices of global tensors from a committed checkpoint, checking each file's size, and each
    tensor's checksum as it is read (`verify_all`: every file's first, as version 1 needs: there a
    distributed load has each rank `verify` a share instead). Use as a context manager."""

    def __init__(self, directory: str | os.PathLike, verify_all: bool = False) -> None:
        self.directory = Path(directory)
        self.verify_all = verify_all
        self.manifest = read_manifest(self.directory)
        self.tensors: dict[str, Any] = self.manifest["tensors"]
        self._open: dict[str, SafetensorsFile] = {}
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
        """Check file `name` whole against the manifest: its sha256 (version 1), its XXH3-128, or (a rank
        file) its header's and every tensor's."""
        if name in self._verified:
            return
        record = self.manifest["files"][name]
        if PARTS in record:
            self._file(name).check_all()
        else:
            path = self._path(name)
            kind = WHOLE_FILE if WHOLE_FILE in record else "sha256"
            if checksum_of(path, kind) != record[kind]:
                raise CheckpointError(
                    f"checkpoint file {path} fails its {kind} checksum (the manifest has "
                    f"{record[kind][:16]}...): its contents are corrupt. Copy the checkpoint again, or "
                    "resume from an earlier checkpoint."
                )
        self._verified.add(name)

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self._open:
            path = self._path(name)
            if self.verify_all and PARTS not in self.manifest["files"][name]:
                self.verify(name)
            try:
                self._open[name] = SafetensorsFile(path, self.manifest["files"][name].get(PARTS))
            except (OSError, ValueError) as e:
                raise CheckpointError(
                    f"checkpoint file {path} cannot be read ({e}). Resume from an earlier checkpoint."
                ) from None
        return self._open[name]

    def keys(self, name: str) -> list[str]:
        return self._file(name).keys()

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

    def read(self, tensor: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        """The part `box` of global tensor `tensor`, assembled from every slice that overlaps it: into `out`
        when given (of the box's shape, any dtype and device: a load writes straight into its targets)."""
        entry = self._entry(tensor)
        overlaps = []
        for piece in entry["slices"]:
            stored = (tuple(piece["start"]), tuple(piece["stop"]))
            overlap = intersect(box, stored)
            if overlap is not None:  # each file checked against the manifest before anything is allocated
                overlaps.append((piece, stored, overlap, self._file(piece["file"])))
        dtype = DTYPES[entry["dtype"]]
        if out is None:
            out = torch.empty([h - lo for lo, h in zip(*box, strict=True)], dtype=dtype)
        covered = 0
        for piece, stored, overlap, file in overlaps:
            values = file.tensor(piece["key"])
            wanted = tuple(h - lo for lo, h in zip(*stored, strict=True))
            if values.dtype != dtype or tuple(values.shape) != wanted:
                raise file.error(
                    f"holds {piece['key']} as {values.dtype} {list(values.shape)}, the manifest says "
                    f"{entry['dtype']} {list(wanted)}"
                )
            out[relative(overlap, box[0])] = values[relative(overlap, stored[0])]
            covered += volume(overlap)
        if covered != volume(box):
            raise CheckpointError(
                f"checkpoint {self.directory}: the slices of {tensor} cover {covered:,} of the "
                f"{volume(box):,} elements asked for ({box}): files are missing from the "
                "manifest. Resume from an earlier checkpoint."
            )
        return out

    def metadata(self, name: str) -> dict[str, str]:
        return self._file(name).metadata

    def extra(self, name: str, key: str) -> torch.Tensor:
        return self._file(name).tensor(key).clone()


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
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, or a number of over 4,300 digits
        raise CheckpointError(
            f"{path} is not valid JSON ({type(e).__name__}: {e}): the checkpoint is damaged. Resume from an "
            "earlier checkpoint."
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f'{path} is not a femtotron checkpoint manifest (no "format": "{FORMAT}").')
    if manifest.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{path} has format version {manifest.get('version')!r}; this femtotron reads "
            f"versions {', '.join(map(str, READABLE_VERSIONS))}. Use the femtotron version that wrote it (or "
            "convert it with that version's `femtotron consolidate`)."
        )
    # Version 3 keeps one: a field or a version read otherwise must not switch the check off.
    if manifest["version"] >= 3 or MANIFEST_CHECKSUM in manifest:
        try:
            intact = manifest.get(MANIFEST_CHECKSUM) == manifest_checksum(manifest)
        except (ValueError, RecursionError):
            intact = False
        if not intact:
            raise CheckpointError(
                f"{path} fails its own checksum ({MANIFEST_CHECKSUM}): a byte of it changed since it was "
                "written (its step, counters or shapes cannot be trusted). Resume from an earlier "
                "checkpoint, or copy this one again from where it was saved."
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
        if not has_checksums(record, manifest["version"]):
            wanted = (
                '"sha256"' if manifest["version"] == 1 else f'"{WHOLE_FILE}" or "{PARTS}" with "{HEADER}"'
            )
            raise wrong(f"file {name!r}", f"has no checksums ({wanted})")
    needed = dict.fromkeys(manifest["files"], 0)  # bytes of slices per file, bounded by the file's size
    for tensor, entry in manifest["tensors"].items():
        check_tensor_entry(entry, needed, lambda rule, name=tensor: wrong(f"tensor {name!r}", rule))
    for tensor, entry in manifest["tensors"].items():
        for piece in entry["slices"] if manifest["version"] > 1 else []:
            if piece["key"] not in manifest["files"][piece["file"]].get(PARTS, {}):
                raise wrong(
                    f"tensor {tensor!r}", f"has a slice {piece['key']!r} without a checksum in its file"
                )
    for name, count in needed.items():
        if count > manifest["files"][name]["bytes"]:
            raise wrong(
                f"file {name!r}",
                f"is listed with {manifest['files'][name]['bytes']:,} bytes but holds "
                f"slices of {count:,} bytes",
            )


def has_checksums(record: dict[str, Any], version: int) -> bool:
    """Whether a file's record has the checksums its format version keeps."""
    if version == 1:
        return isinstance(record.get("sha256"), str)
    parts = record.get(PARTS)
    if parts is not None:
        return isinstance(parts, dict) and HEADER in parts and all(isinstance(v, str) for v in parts.values())
    return isinstance(record.get(WHOLE_FILE), str)


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
