"""The checkpoint format on disk: hostile manifests built by hand are refused naming the entry, links are
neither followed nor written through."""

from __future__ import annotations

import json
import re

import pytest
import torch
from checkpoint_runs import make
from helpers import write_yaml
from safetensors.torch import load_file, save_file

from femtotron.cli import main
from femtotron.parallel.context import ParallelContext
from femtotron.serialize.files import (
    MANIFEST,
    MANIFEST_CHECKSUM,
    SAFETENSORS_DTYPES,
    CheckpointError,
    CheckpointReader,
    Slice,
    build_manifest,
    checksum_of,
    rank_file,
    read_manifest,
    sealed,
    write_rank_file,
)
from femtotron.serialize.restore import load
from femtotron.serialize.saving import save
from femtotron.trainer import Trainer

VALUES = torch.arange(8, dtype=torch.float32).view(2, 4)


def hand_checkpoint(directory):
    """A checkpoint of one 2x4 tensor in two slices, one row each; returns its manifest."""
    directory.mkdir()
    rows = [Slice("model/w", (2, 4), ((row, 0), (row + 1, 4)), VALUES[row : row + 1]) for row in (0, 1)]
    record = write_rank_file(directory, 0, rows, extra={}, metadata={})
    manifest = build_manifest({"step": 1, "config": {}, "mesh": {}}, [record])
    (directory / MANIFEST).write_text(json.dumps(manifest))
    return manifest


def test_a_hand_built_checkpoint_reads_back(tmp_path):
    hand_checkpoint(tmp_path / "ok")
    with CheckpointReader(tmp_path / "ok", verify_all=True) as reader:
        assert torch.equal(reader.read("model/w", ((0, 0), (2, 4))), VALUES)


def test_S2_overlapping_slices_that_add_up_to_the_whole_are_refused(tmp_path):
    # Both slices are row 0, twice: their volumes sum to the tensor's, but row 1 is in no file. Before, the
    # sum passed and row 1 came back as whatever torch.empty held.
    manifest = hand_checkpoint(tmp_path / "c")
    slices = manifest["tensors"]["model/w"]["slices"]
    slices[1] = {**slices[0], "key": slices[1]["key"]}
    (tmp_path / "c" / MANIFEST).write_text(json.dumps(sealed(manifest)))
    with pytest.raises(
        CheckpointError, match=r"tensor 'model/w' has overlapping slices \(\(0, 0\), \(1, 4\)\)"
    ):
        CheckpointReader(tmp_path / "c")


def set_in(path, value):
    """A mutation of the manifest: set the entry at `path` (keys, "*" for the first slice) to `value`."""

    def mutate(manifest):
        entry = manifest
        for key in path[:-1]:
            entry = entry[key] if key != "*" else entry[0]
        entry[path[-1]] = value
        return manifest

    return mutate


def huge_shape(manifest):
    entry = manifest["tensors"]["model/w"]
    entry["shape"] = [2**20, 2**20]
    entry["slices"] = [{**entry["slices"][0], "start": [0, 0], "stop": [2**20, 2**20]}]
    return manifest


TENSOR = ("tensors", "model/w")
HOSTILE = {
    "unknown dtype": (set_in((*TENSOR, "dtype"), "complex128"), "has dtype 'complex128'; known: float32"),
    "slice past the tensor": (
        set_in((*TENSOR, "slices", "*", "stop"), [1, 9]),
        r"has a slice \[\[0, 0\], \[1, 9\]\) outside its shape \[2, 4\]",
    ),
    # 2^40 elements (4 TiB) would be allocated before any check: the file holds 32 bytes of slices.
    "huge shape": (huge_shape, "is listed with .* bytes but holds slices of 4,398,046,511,104 bytes"),
    "part of the tensor missing": (
        lambda m: set_in((*TENSOR, "slices"), m["tensors"]["model/w"]["slices"][:1])(m),
        "has slices covering 4 of its 8 elements",
    ),
    "files a list": (lambda m: {**m, "files": list(m["files"])}, '"files" is a list, not a mapping'),
    "step not a number": (set_in(("step",), "7"), "\"step\": '7' is not a whole number >= 0"),
    "absolute file name": (
        lambda m: {**m, "files": {"/etc/passwd": next(iter(m["files"].values()))}},
        "file '/etc/passwd' is not a plain file name inside the checkpoint directory",
    ),
    "file name with ..": (
        lambda m: {**m, "files": {"../secret": next(iter(m["files"].values()))}},
        "file '../secret' is not a plain file name inside the checkpoint directory",
    ),
}


def write_hostile(directory, name):
    """A hand-built checkpoint in `directory` whose manifest is `HOSTILE[name]`'s; returns the phrase."""
    mutate, phrase = HOSTILE[name]
    manifest = hand_checkpoint(directory)
    (directory / MANIFEST).write_text(json.dumps(sealed(mutate(manifest))))
    return phrase


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_manifest_is_refused_naming_the_entry(tmp_path, name):
    phrase = write_hostile(tmp_path / "c", name)
    with pytest.raises(CheckpointError, match=phrase) as info:
        CheckpointReader(tmp_path / "c")
    assert str(tmp_path / "c" / MANIFEST) in str(info.value)


def test_E5_a_huge_shape_with_a_file_size_to_match_is_refused_before_anything_is_allocated(tmp_path):
    # The manifest claims a 4 TiB tensor in a file it lists at 4 TiB: consistent on paper, so the reader
    # must check the real file's size before it allocates the tensor's box.
    manifest = huge_shape(hand_checkpoint(tmp_path / "c"))
    next(iter(manifest["files"].values()))["bytes"] = 4 * 2**40
    (tmp_path / "c" / MANIFEST).write_text(json.dumps(sealed(manifest)))
    with (
        CheckpointReader(tmp_path / "c") as reader,
        pytest.raises(CheckpointError, match="bytes but the manifest"),
    ):
        reader.read("model/w", ((0, 0), (2**20, 2**20)))


def test_deeply_nested_json_is_a_damaged_manifest_not_a_recursion_error(tmp_path):
    (tmp_path / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="is not valid JSON \\(RecursionError"):
        read_manifest(tmp_path)


def test_a_file_that_links_out_of_the_checkpoint_is_refused(tmp_path):
    hand_checkpoint(tmp_path / "c")
    outside = tmp_path / "outside.safetensors"
    (tmp_path / "c" / rank_file(0)).rename(outside)
    (tmp_path / "c" / rank_file(0)).symlink_to(outside)
    with (
        CheckpointReader(tmp_path / "c") as reader,
        pytest.raises(CheckpointError, match="outside the checkpoint"),
    ):
        reader.read("model/w", ((0, 0), (2, 4)))


def test_a_rank_file_replaces_a_link_at_its_place_instead_of_writing_through_it(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("not yours")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / rank_file(0)).symlink_to(target)
    write_rank_file(
        tmp_path / "c", 0, [Slice("model/w", (2, 4), ((0, 0), (2, 4)), VALUES)], extra={}, metadata={}
    )
    assert target.read_text() == "not yours" and not (tmp_path / "c" / rank_file(0)).is_symlink()


@pytest.mark.parametrize("name", [*HOSTILE, "nested JSON"])
def test_S2_a_hostile_manifest_is_a_clear_error_in_every_command_that_reads_one(
    tmp_path, tiny_config, capsys, name
):
    config = tiny_config("general.run=hostile", "tokens.train_steps=4")
    step = config.run_dir / "checkpoints" / "step-0000004"
    step.parent.mkdir(parents=True)
    if name == "nested JSON":
        hand_checkpoint(step)
        (step / MANIFEST).write_text("{" + '"a":{' * 50_000 + "}" * 50_001)
        phrase = "is not valid JSON"
    else:
        phrase = write_hostile(step, name)
    (step.parent / "latest").write_text(step.name + "\n")
    commands = {
        "consolidate": ["consolidate", str(step), "--out", str(tmp_path / "consolidated")],
        "reshard": ["reshard", str(step), "--out", str(tmp_path / "resharded"), "--tp", "2"],
        "export-hf": ["export-hf", str(step), "--out", str(tmp_path / "hf")],
        "auto-resume": ["train", write_yaml(config, tmp_path / "c.yaml")],
    }
    for verb, argv in commands.items():
        assert main(argv) == CheckpointError.exit_code, verb
        error = capsys.readouterr().err
        assert error.startswith("femtotron: error: ") and re.search(phrase, error), (verb, error)
        assert "Traceback" not in error


def version_1_checkpoint(directory):
    """A checkpoint as femtotron wrote it before format 2: safetensors' own writer, a sha256 per file."""
    directory.mkdir()
    path = directory / rank_file(0)
    save_file({"0:model/w": VALUES[:1].contiguous(), "1:model/w": VALUES[1:].contiguous()}, str(path))
    record = {"file": path.name, "sha256": checksum_of(path, "sha256"), "bytes": path.stat().st_size}
    rows = [
        {"tensor": "model/w", "shape": (2, 4), "dtype": "float32", "key": f"{row}:model/w", "start": (row, 0)}
        | {"stop": (row + 1, 4)}
        for row in (0, 1)
    ]
    manifest = build_manifest({"step": 1, "config": {}, "mesh": {}}, [record | {"slices": rows}])
    del manifest[MANIFEST_CHECKSUM]  # version 1 had none
    (directory / MANIFEST).write_text(json.dumps(manifest | {"version": 1}))
    return path


def test_a_version_1_checkpoint_still_reads_and_its_sha256_is_checked(tmp_path):
    path = version_1_checkpoint(tmp_path / "v1")
    with CheckpointReader(tmp_path / "v1", verify_all=True) as reader:
        assert torch.equal(reader.read("model/w", ((0, 0), (2, 4))), VALUES)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=f"checkpoint file {re.escape(str(path))} fails its sha256 checksum"
    ):
        CheckpointReader(tmp_path / "v1", verify_all=True).read("model/w", ((0, 0), (2, 4)))


def test_a_flipped_bit_in_any_tensor_fails_its_checksum_when_read(tmp_path):
    hand_checkpoint(tmp_path / "c")
    path = tmp_path / "c" / rank_file(0)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # the last element of the second row
    path.write_bytes(bytes(data))
    with CheckpointReader(tmp_path / "c") as reader:
        assert torch.equal(reader.read("model/w", ((0, 0), (1, 4))), VALUES[:1])  # the first row is sound
        with pytest.raises(CheckpointError, match="fails its checksum for its tensor '1:model/w'"):
            reader.read("model/w", ((1, 0), (2, 4)))


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text.replace('"step": 4', '"step": 6'),  # one bit: "4" is 0x34, "6" 0x36
        lambda text: text.replace('"step": 4', '"step": 1' + "0" * 400),
        lambda text: text.replace(
            MANIFEST_CHECKSUM, MANIFEST_CHECKSUM.replace("m", "l", 1)
        ),  # one bit: 0x6d 0x6c
        lambda text: text.replace('"version": 3', '"version": 2'),  # one bit: 0x33 0x32
    ],
    ids=["step 4 read as 6", "step 10^400", "its checksum's name", "version 3 read as 2"],
)
def test_a_manifest_with_a_changed_byte_fails_its_own_checksum(tmp_path, damage):
    """Every other file of a checkpoint has a checksum; the manifest had none, so a flipped bit that made step
    4 into 6 resumed with exit 0 and trained nothing."""
    directory = tmp_path / "c"
    hand_checkpoint(directory)
    manifest = json.loads((directory / MANIFEST).read_text())
    (directory / MANIFEST).write_text(json.dumps(sealed({**manifest, "step": 4}), indent=1))
    read_manifest(directory)  # intact: reads, however the file is laid out
    (directory / MANIFEST).write_text(damage((directory / MANIFEST).read_text()))
    with pytest.raises(
        CheckpointError, match=f"{re.escape(str(directory / MANIFEST))} fails its own checksum"
    ):
        read_manifest(directory)


def test_a_version_2_manifest_without_its_own_checksum_still_reads(tmp_path):
    manifest = hand_checkpoint(tmp_path / "c")
    del manifest[MANIFEST_CHECKSUM]
    (tmp_path / "c" / MANIFEST).write_text(json.dumps(manifest | {"version": 2}))
    assert read_manifest(tmp_path / "c")["version"] == 2


def test_a_number_too_long_for_python_is_a_damaged_manifest_not_a_traceback(tmp_path):
    (tmp_path / MANIFEST).write_text('{"step": ' + "7" * 5000 + "}")
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        read_manifest(tmp_path)


def test_F1_a_flipped_bit_in_the_saved_python_rng_state_fails_the_header_checksum_on_resume(tiny_config):
    """Python's and numpy's RNG states are JSON in the rank file's header (its __metadata__), which only the
    header's checksum covers: unchecked, a digit changed on disk was resumed without a word, as another
    random stream."""
    config = make(tiny_config, "rng-bit", steps=1)
    saved = save(Trainer(config, ParallelContext(), log_to_console=False).parts)
    path = saved / rank_file(0)
    data = bytearray(path.read_bytes())
    marker = b'{\\"python\\": [3, ['  # the JSON of random.getstate(), escaped in the header's JSON
    words = data.index(marker) + len(marker)  # the Mersenne Twister's 625 words
    second_word_end = data.index(b",", data.index(b", ", words) + 2)
    assert words < 8 + int.from_bytes(data[:8], "little")  # in the header
    # Its last digit's lowest bit: still a digit (0 <-> 1, ..., 8 <-> 9), the header still valid JSON.
    data[second_word_end - 1] ^= 1
    path.write_bytes(bytes(data))
    resumed = Trainer(config, ParallelContext(), log_to_console=False)
    with pytest.raises(
        CheckpointError, match=f"checkpoint file {re.escape(str(path))} fails its checksum for its header"
    ):
        load(resumed.parts, saved)


def test_F2_every_tensor_of_a_rank_file_starts_at_a_multiple_of_its_element_size(tmp_path):
    """The reader maps the file and views each tensor in place (torch.frombuffer), which needs it aligned to
    its element size: x86 forgives a misaligned float, other CPUs do not. An odd-sized uint8 tensor comes
    first here, then bfloat16 and float32 slices: written in that order, they would start at bytes 3 and 9."""
    odd = torch.arange(3, dtype=torch.uint8)
    pieces = {
        "model/h": torch.arange(3, dtype=torch.bfloat16),
        "model/f": torch.arange(2, dtype=torch.float32),
    }
    slices = [Slice(name, tuple(v.shape), ((0,), tuple(v.shape)), v) for name, v in pieces.items()]
    write_rank_file(tmp_path, 0, slices, extra={"rng/odd": odd}, metadata={})
    path = tmp_path / rank_file(0)
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    header.pop("__metadata__", None)
    for key, entry in header.items():
        itemsize = SAFETENSORS_DTYPES[entry["dtype"]].itemsize
        assert (8 + length + entry["data_offsets"][0]) % itemsize == 0, (key, entry)
    stored = load_file(path)  # the safetensors library reads the same values back
    assert torch.equal(stored["rng/odd"], odd)
    assert all(torch.equal(stored[f"{i}:{name}"], v) for i, (name, v) in enumerate(pieces.items()))
