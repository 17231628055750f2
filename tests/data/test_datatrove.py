"""Datatrove-tokenized folders, checked against datatrove itself: its DocumentTokenizer writes the folders
and its DatatroveFolderDataset is the reference for what a sample is."""

import json
import math
import os
import shutil
import signal
import subprocess

import numpy as np
import pytest
import torch
from datatrove.pipeline.tokens.tokenizer import TokenizedFile
from datatrove.utils.dataset import DatatroveFolderDataset
from helpers import preprocess_command

from femtotron.cli import main
from femtotron.data.datatrove import DatatroveFolder
from femtotron.data.indexed import IndexedDataset
from femtotron.data.nanoset import open_nanoset
from femtotron.data.preprocess import preprocess
from femtotron.data.run_data import check_token_range, data_identity
from femtotron.errors import DataError
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer


def _write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def _reference(folder, sequence_length, token_size=2):
    return DatatroveFolderDataset(
        str(folder), sequence_length, filename_pattern="*.ds", recursive=False, token_size=token_size
    )


def _copy(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / "copy")


@pytest.mark.parametrize("sequence_length", [7, 32])
def test_samples_are_datatrove_folder_dataset_items(datatrove_folder, sequence_length):
    ours = DatatroveFolder(datatrove_folder)
    reference = _reference(datatrove_folder, sequence_length)
    assert len([f for f in ours.files if f.endswith(".ds")]) == 2
    assert ours.num_samples(sequence_length) == len(reference) > 10
    for i in range(len(reference)):
        assert ours.sample(i, sequence_length).tolist() == reference[i]["input_ids"].tolist()
    names = sorted(n for n in os.listdir(datatrove_folder) if n.endswith(".ds.index"))
    ends = [np.fromfile(datatrove_folder / n, dtype="<u8").tolist() for n in names]
    assert [e.tolist() for e in ours.document_ends] == ends
    assert ours.num_documents == 120 and ours.num_tokens == sum(e[-1] for e in ends)


def test_nanoset_draws_every_datatrove_sample_once_an_epoch(datatrove_folder):
    """The resumable sampler's epoch is a permutation of datatrove's items; any g is the same on reopening."""
    nanoset = open_nanoset(str(datatrove_folder), 16, seed=5)
    reference = _reference(datatrove_folder, 16)
    drawn = sorted(nanoset[g].tolist() for g in range(nanoset.samples_per_epoch))
    assert drawn == sorted(reference[i]["input_ids"].tolist() for i in range(len(reference)))
    again = open_nanoset(str(datatrove_folder), 16, seed=5)
    assert all(np.array_equal(nanoset[g], again[g]) for g in (0, 17, 3 * nanoset.samples_per_epoch + 2))
    assert nanoset.num_documents == 120


def test_blended_by_weight_with_a_megatron_dataset(tmp_path, datatrove_folder, texts, tokenizer_path):
    source = _write_jsonl(tmp_path / "c.jsonl", texts)
    preprocess(source, tokenizer_path, tmp_path / "megatron" / "corpus", progress=False)
    blend = {str(datatrove_folder): 3.0, str(tmp_path / "megatron" / "corpus"): 1.0}
    nanoset = open_nanoset(blend, 16, seed=1)
    assert isinstance(nanoset.datasets[0], DatatroveFolder) and isinstance(
        nanoset.datasets[1], IndexedDataset
    )
    counts = np.bincount([nanoset.locate(g)[0] for g in range(400)], minlength=2)
    assert counts.tolist() == [300, 100]


def test_preprocess_format_datatrove_is_read_back_by_datatrove(tmp_path, texts, tokenizer_path, capsys):
    """The same tokens as the Megatron format, in datatrove's layout, and datatrove reads them identically."""
    source = _write_jsonl(tmp_path / "c.jsonl", texts)
    preprocess(source, tokenizer_path, tmp_path / "megatron" / "corpus", progress=False)
    arguments = ["preprocess", "--input", str(source), "--tokenizer", str(tokenizer_path), "--workers", "1"]
    main([*arguments, "--output-prefix", str(tmp_path / "dt" / "corpus"), "--format", "datatrove"])
    assert f"wrote {tmp_path / 'dt' / 'corpus'}.ds/.ds.index: 40 documents" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "dt")) == ["corpus.ds", "corpus.ds.index"]
    megatron = IndexedDataset(tmp_path / "megatron" / "corpus")
    ours = DatatroveFolder(tmp_path / "dt")
    assert ours.tokens(0, ours.num_tokens).tolist() == megatron.tokens(0, megatron.num_tokens).tolist()
    assert ours.document_ends[0].tolist() == np.cumsum(megatron.sequence_lengths).tolist()
    reference = _reference(tmp_path / "dt", 9)
    assert [ours.sample(i, 9).tolist() for i in range(ours.num_samples(9))] == [
        reference[i]["input_ids"].tolist() for i in range(len(reference))
    ]


def test_four_byte_tokens_as_datatrove_writes_them(tmp_path):
    """A vocabulary above 65,536 ids: datatrove writes uint32 tokens, read in the size they were written."""
    documents = [[70_000, 1, 2, 3], [65_536, 4], [99_999, 5, 6, 7, 8, 9, 10]]
    written = TokenizedFile(str(tmp_path / "big"), "part.ds", token_size=4)
    for document in documents:
        written.write(document, None)
    written.close()
    ours = DatatroveFolder(tmp_path / "big")
    reference = _reference(tmp_path / "big", 3, token_size=4)
    assert ours.token_size == 4 and ours.num_samples(3) == len(reference) == 3
    assert [ours.sample(i, 3).tolist() for i in range(3)] == [
        reference[i]["input_ids"].tolist() for i in range(3)
    ]


def test_a_token_size_the_vocabulary_does_not_imply_is_refused(datatrove_folder):
    nanoset = open_nanoset(str(datatrove_folder), 16, seed=1)
    check_token_range(nanoset, 448)
    with pytest.raises(
        DataError, match=r"holds 2-byte tokens, but model.model_config.vocab_size=70000 means 4"
    ):
        check_token_range(nanoset, 70_000)


def test_token_ids_beyond_the_vocabulary_name_the_folder(datatrove_folder):
    nanoset = open_nanoset(str(datatrove_folder), 16, seed=1)
    with pytest.raises(DataError, match=rf"{datatrove_folder}/\*.ds \(data.dataset_folder\) holds token id"):
        check_token_range(nanoset, 100)


def test_a_truncated_token_file_is_refused(tmp_path, datatrove_folder):
    folder = _copy(datatrove_folder, tmp_path)
    path = folder / "00000_00000_doc_shuffled.ds"
    os.truncate(path, os.path.getsize(path) - 2)
    with pytest.raises(
        DataError, match=r"00000_00000_doc_shuffled.ds: size \d+ bytes, but .* truncated"
    ) as error:
        open_nanoset(str(folder), 16, seed=1)
    assert "femtotron preprocess --format datatrove" in str(error.value)


def test_a_missing_or_truncated_index_is_refused(tmp_path, datatrove_folder):
    folder = _copy(datatrove_folder, tmp_path)
    index = folder / "00001_00000_doc_shuffled.ds.index"
    os.truncate(index, os.path.getsize(index) - 3)
    with pytest.raises(DataError, match="ds.index: size .* not a whole number of uint64 ends"):
        open_nanoset(str(folder), 16, seed=1)
    os.remove(index)
    with pytest.raises(DataError, match=r"doc_shuffled.ds: its document index .*ds.index is missing"):
        open_nanoset(str(folder), 16, seed=1)


def test_metadata_naming_another_token_size_is_refused(tmp_path, datatrove_folder):
    folder = _copy(datatrove_folder, tmp_path)
    (folder / "00000_00000_doc_shuffled.ds.metadata").write_text("gpt2|4\n100\n100 T")
    with pytest.raises(DataError, match="metadata: names 4-byte tokens, but .* holds 2-byte tokens"):
        DatatroveFolder(folder)


def test_metadata_that_is_not_utf8_is_read_for_its_size_or_named(tmp_path, datatrove_folder):
    """It was read as UTF-8, and a byte that is not raised a UnicodeDecodeError. Only the token size is read:
    a tokenizer name that is not UTF-8 does not matter; a size that cannot be read names the file."""
    folder = _copy(datatrove_folder, tmp_path)
    metadata = folder / "00000_00000_doc_shuffled.ds.metadata"
    metadata.write_bytes(b"gpt\xff\xfe2|2\n100\n")
    assert DatatroveFolder(folder).token_size == 2
    metadata.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff")
    with pytest.raises(DataError, match=rf"{metadata}: first line names token size .*, expected 2 or 4"):
        DatatroveFolder(folder)


def test_a_folder_mixing_token_sizes_is_refused(tmp_path, datatrove_folder):
    folder = _copy(datatrove_folder, tmp_path)
    written = TokenizedFile(str(folder), "zz.ds", token_size=4)
    written.write([70_000, 1, 2], None)
    written.close()
    with pytest.raises(DataError, match="its .ds files mix 2- and 4-byte tokens"):
        DatatroveFolder(folder)


def test_a_folder_holding_megatron_files_too_is_refused(tmp_path, datatrove_folder):
    folder = _copy(datatrove_folder, tmp_path)
    (folder / "corpus.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"holds datatrove .ds files and Megatron files \(corpus.bin\)"):
        open_nanoset(str(folder), 16, seed=1)


def test_an_empty_folder_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"holds no usable dataset: .* zero .bin/.idx pairs.*datatrove"):
        open_nanoset(str(tmp_path / "empty"), 16, seed=1)
    empty = TokenizedFile(str(tmp_path / "nodata"), "part.ds")
    empty.close()
    with pytest.raises(DataError, match="0 tokens is too few for one sample"):
        open_nanoset(str(tmp_path / "nodata"), 16, seed=1)


def test_train_on_a_datatrove_folder(tiny_config, datatrove_folder):
    """The tokenizer has 400 ids: the tiny model's vocabulary is raised to hold them."""
    config = tiny_config(
        f"data.dataset_folder={datatrove_folder}", "model.model_config.vocab_size=448", "tokens.train_steps=2"
    )
    trainer = Trainer(config, ParallelContext(), log_to_console=False)
    first = trainer.batches.step_at(0)[0]
    reference = _reference(datatrove_folder, 32)
    items = {tuple(reference[i]["input_ids"].tolist()) for i in range(len(reference))}
    for inputs, targets in zip(first.inputs, first.targets, strict=True):
        assert (*inputs.tolist(), targets[-1].item()) in items
        assert torch.equal(inputs[1:], targets[:-1])
    assert all(math.isfinite(result.loss) for result in trainer.train())


@pytest.mark.distributed
def test_killed_while_replacing_a_datatrove_file_leaves_it_refused_then_rewritten(
    tmp_path, texts, tokenizer_path
):
    """Killed between the renames, the new .ds stands without its index: refused, never read with the old."""
    source = _write_jsonl(tmp_path / "c.jsonl", texts)
    prefix = tmp_path / "out" / "corpus"
    command = preprocess_command(source, tokenizer_path, prefix, "--format", "datatrove")
    assert subprocess.run(command, capture_output=True).returncode == 0
    environment = {**os.environ, "FEMTOTRON_CRASH_AT": "preprocess.bin_renamed"}
    killed = subprocess.run(command, env=environment, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with pytest.raises(DataError, match=r"corpus.ds: its document index .*corpus.ds.index is missing"):
        open_nanoset(str(tmp_path / "out"), 16, seed=1)
    finished = subprocess.run(command, capture_output=True, text=True)
    assert "left by a preprocess that was killed" in finished.stderr
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus.ds", "corpus.ds.index"]
    assert DatatroveFolder(tmp_path / "out").num_documents == len(texts)


def _train(config):
    trainer = Trainer(config, ParallelContext(), log_to_console=False)
    return trainer, [result.loss for result in trainer.train()]


def test_a_run_on_a_datatrove_folder_resumes_with_the_uninterrupted_losses(tiny_config, datatrove_folder):
    def config(run, *overrides):
        data = f"data.dataset_folder={datatrove_folder}"
        return tiny_config(f"general.run={run}", data, "model.model_config.vocab_size=448", *overrides)

    _, whole = _train(config("whole", "tokens.train_steps=4"))
    first, half = _train(config("first", "tokens.train_steps=2", "checkpoints.checkpoint_interval=2"))
    saved = f"checkpoints.resume_checkpoint_path={first.run_dir / 'checkpoints'}"
    _, rest = _train(config("rest", "tokens.train_steps=4", saved))
    assert half + rest == whole and len(whole) == 4


def test_the_data_identity_covers_every_datatrove_file(tmp_path, datatrove_folder):
    """A checkpoint refuses a resume on other data: changing a token of any .ds changes the digest."""
    folder = _copy(datatrove_folder, tmp_path)
    before = data_identity(open_nanoset(str(folder), 16, seed=1), None)
    assert before["datasets"] == [str(folder)]
    with open(folder / "00001_00000_doc_shuffled.ds", "r+b") as f:
        f.seek(4)
        token = f.read(2)
        f.seek(4)
        f.write(bytes([token[0] ^ 1, token[1]]))
    after = data_identity(open_nanoset(str(folder), 16, seed=1), None)
    assert after["digest"] != before["digest"]
