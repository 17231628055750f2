"""Text tokenized at start (data.text_dataset, nanotron's hf_dataset_or_datasets): a Hugging Face datasets
directory written by `datasets` itself, or text files; tokenized once into data.cache_dir and reused."""

import json
import os
import threading

import numpy as np
import pytest
from datasets import Dataset, DatasetDict
from helpers import femtotron, write_yaml

from femtotron.config import load_config_dict
from femtotron.data import text_cache
from femtotron.data.documents import iter_documents
from femtotron.data.indexed import IndexedDataset
from femtotron.data.preprocess import preprocess
from femtotron.data.run_data import open_run_data
from femtotron.data.text_cache import cached_prefix, tokenize_text_data, tokenized_by_rank_0, tokenizer_digest
from femtotron.errors import ConfigError, DataError
from femtotron.parallel.context import ParallelContext
from femtotron.store import Store
from femtotron.trainer import Trainer


@pytest.fixture
def hf_dataset(tmp_path, texts):
    """A datasets directory as `save_to_disk` writes it, with a second column that is not the text."""
    path = tmp_path / "hf_text"
    Dataset.from_dict({"text": texts, "id": list(range(len(texts)))}).save_to_disk(str(path))
    return path


def text_config(tmp_path, tokenizer_path, source, **data):
    raw = {
        "general": {"run": "text"},
        "model": {
            "model_config": {
                "vocab_size": 448,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "max_position_embeddings": 64,
            },
            "dtype": "float32",
        },
        "tokenizer": {"tokenizer_name_or_path": str(tokenizer_path)},
        "tokens": {"sequence_length": 16, "micro_batch_size": 2, "train_steps": 2},
        "data": {"text_dataset": source, "cache_dir": str(tmp_path / "cache"), **data},
        "logging": {"output_dir": str(tmp_path / "runs")},
    }
    return load_config_dict(raw)


def test_a_datasets_directory_is_read_row_by_row_as_datasets_stores_it(hf_dataset, texts):
    assert list(iter_documents(hf_dataset)) == texts
    with pytest.raises(DataError, match=r"no column 'content' \(it has text, id\)"):
        list(iter_documents(hf_dataset, text_key="content"))


def test_a_dataset_dict_is_read_from_its_train_split(tmp_path, texts):
    both = DatasetDict(
        {"train": Dataset.from_dict({"text": texts}), "test": Dataset.from_dict({"text": ["x"]})}
    )
    both.save_to_disk(str(tmp_path / "dict"))
    assert list(iter_documents(tmp_path / "dict")) == texts
    DatasetDict({"validation": Dataset.from_dict({"text": ["x"]})}).save_to_disk(str(tmp_path / "no_train"))
    with pytest.raises(DataError, match="without a 'train' split .* e.g. .*no_train/validation"):
        list(iter_documents(tmp_path / "no_train"))


def test_text_is_tokenized_once_into_the_cache_as_preprocess_would(
    tmp_path, tokenizer_path, hf_dataset, texts
):
    config = text_config(tmp_path, tokenizer_path, str(hf_dataset))
    with pytest.raises(DataError, match="is not tokenized yet"):
        open_run_data(config)
    lines = tokenize_text_data(config)
    assert len(lines) == 1 and f"tokenized {len(texts)} documents" in lines[0]
    prefix = cached_prefix(
        str(hf_dataset), "text", tokenizer_digest(str(tokenizer_path)), str(tmp_path / "cache")
    )
    jsonl = tmp_path / "same.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    preprocess(jsonl, tokenizer_path, tmp_path / "reference", progress=False)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"reference{suffix}").read_bytes() == open(prefix + suffix, "rb").read()
    assert "tokenized already" in tokenize_text_data(config)[0]  # the next run reads the same copy
    data, _, _ = open_run_data(config)
    assert data.nanosets[0].prefixes == [prefix]


def test_changing_the_text_or_the_tokenizer_tokenizes_again(tmp_path, tokenizer_path, texts):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"body": texts[0]}) + "\n", encoding="utf-8")
    (folder / "b.txt").write_text(texts[1], encoding="utf-8")
    config = text_config(tmp_path, tokenizer_path, str(folder), text_column="body")
    tokenize_text_data(config)
    digest = tokenizer_digest(str(tokenizer_path))
    first = cached_prefix(str(folder), "body", digest, str(tmp_path / "cache"))
    assert IndexedDataset(first).num_documents == 2
    (folder / "b.txt").write_text(texts[2] + " more", encoding="utf-8")
    second = cached_prefix(str(folder), "body", digest, str(tmp_path / "cache"))
    assert second != first
    assert "tokenized 2 documents" in tokenize_text_data(config)[0]
    assert cached_prefix(str(folder), "text", digest, str(tmp_path / "cache")) != second


def test_an_edit_keeping_size_and_modification_time_tokenizes_again(tmp_path, tokenizer_path):
    """The key was path, size and modification time: a same-size edit with its time kept (cp -p, rsync -t,
    touch -r) reused the stale tokens. The ends of each file are digested too, as the data identity does."""
    source = tmp_path / "book.txt"
    source.write_text("the model")
    kept = source.stat()
    config = text_config(tmp_path, tokenizer_path, str(source))
    tokenize_text_data(config)
    source.write_text("the layer")
    os.utime(source, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    assert source.stat().st_size == kept.st_size and source.stat().st_mtime_ns == kept.st_mtime_ns
    assert "tokenized 1 documents" in tokenize_text_data(config)[0]


def test_links_out_of_a_text_directory_are_refused(tmp_path, tokenizer_path, hf_dataset):
    """A link in the directory to a file elsewhere (a system file) was tokenized with the rest."""
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("the model")
    (tmp_path / "secret").write_text("secret")
    (folder / "passwd.txt").symlink_to(tmp_path / "secret")
    with pytest.raises(DataError, match=r"texts/passwd\.txt leads to .*/secret, outside .*texts"):
        tokenize_text_data(text_config(tmp_path, tokenizer_path, str(folder)))
    arrow = next(hf_dataset.glob("*.arrow"))
    arrow.rename(tmp_path / "elsewhere.arrow")
    arrow.symlink_to(tmp_path / "elsewhere.arrow")
    with pytest.raises(DataError, match=r"\.arrow leads to .*/elsewhere\.arrow, outside .*hf_text"):
        list(iter_documents(hf_dataset))
    with pytest.raises(DataError, match=r"\.arrow leads to .*/elsewhere\.arrow, outside .*hf_text"):
        tokenize_text_data(text_config(tmp_path, tokenizer_path, str(hf_dataset)))
    assert not os.path.exists(tmp_path / "cache")


def test_a_bad_record_of_a_text_source_is_named_by_file_and_line(tmp_path, tokenizer_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "the model"}\n{"text": "x", "n": ' + "9" * 5000 + "}\n")
    with pytest.raises(DataError, match=r"texts/a\.jsonl, line 2: a JSON number of more than 4,300 digits"):
        tokenize_text_data(text_config(tmp_path, tokenizer_path, str(folder)))


def test_a_hub_name_or_missing_tokenizer_is_refused_with_the_fix(tmp_path, tokenizer_path):
    config = text_config(tmp_path, tokenizer_path, "HuggingFaceFW/fineweb-edu")
    with pytest.raises(DataError) as caught:
        tokenize_text_data(config)
    assert "datasets.load_dataset('HuggingFaceFW/fineweb-edu', split='train').save_to_disk" in str(
        caught.value
    )
    assert f"femtotron preprocess --input data/fineweb-edu --tokenizer {tokenizer_path}" in str(caught.value)
    raw = text_config(tmp_path, tokenizer_path, "x").to_dict()
    raw["tokenizer"]["tokenizer_name_or_path"] = None
    with pytest.raises(ConfigError) as caught:
        load_config_dict(raw)
    assert caught.value.problems[0].fields == ("data.text_dataset", "tokenizer.tokenizer_name_or_path")


def test_a_run_trains_on_tokenized_text_blended_with_other_text(tmp_path, tokenizer_path, hf_dataset, texts):
    other = tmp_path / "other.txt"
    other.write_text(" ".join(texts * 3), encoding="utf-8")
    config = text_config(tmp_path, tokenizer_path, {str(hf_dataset): 0.7, str(other): 0.3})
    tokenize_text_data(config)
    trainer = Trainer(config, ParallelContext(), log_to_console=False)
    assert np.allclose(trainer.train_data.nanosets[0].weights, [0.7, 0.3])
    assert len(trainer.train()) == 2


@pytest.mark.distributed
def test_train_tokenizes_before_its_ranks_start_and_they_read_the_copy(tmp_path, tokenizer_path, hf_dataset):
    config = text_config(tmp_path, tokenizer_path, str(hf_dataset))
    path = write_yaml(config, tmp_path / "config.yaml")
    done = femtotron("train", path, "parallelism.dp=2")
    assert done.returncode == 0, done.stderr
    assert "tokenized 40 documents" in done.stderr
    assert os.listdir(tmp_path / "cache") and (tmp_path / "runs" / "text" / "model.safetensors").is_file()
    again = femtotron("train", path, "parallelism.dp=2", "general.run=again")
    assert again.returncode == 0, again.stderr
    assert "tokenized already" in again.stderr


class RankZeroDone(Store):
    """The store as a rank other than 0 finds it once rank 0 has tokenized: its word is "done"."""

    def collect(self, keys, timeout, remove=False):
        return dict.fromkeys(keys, "done")


def _tokenized_but_hidden(tmp_path, tokenizer_path, texts):
    """A config whose text rank 0 has tokenized, and its cached index as another node sees it: not yet."""
    source = tmp_path / "book.txt"
    source.write_text(" ".join(texts))
    config = text_config(tmp_path, tokenizer_path, str(source))
    tokenize_text_data(config)
    prefix = cached_prefix(
        str(source), "text", tokenizer_digest(str(tokenizer_path)), str(tmp_path / "cache")
    )
    os.rename(f"{prefix}.idx", tmp_path / "hidden.idx")
    return config, f"{prefix}.idx"


def test_another_node_reads_the_text_cache_once_its_shared_file_system_shows_it(
    tmp_path, tokenizer_path, texts
):
    config, index = _tokenized_but_hidden(tmp_path, tokenizer_path, texts)
    shown = threading.Timer(0.3, os.rename, (tmp_path / "hidden.idx", index))
    shown.start()
    tokenized_by_rank_0(config, RankZeroDone(), rank=1)
    assert os.path.isfile(index)  # it returned once the index showed up, not before
    shown.join()
    assert open_run_data(config)[0].nanosets[0].prefixes == [index.removesuffix(".idx")]


def test_a_text_cache_another_node_never_sees_is_named_with_the_fix(
    tmp_path, tokenizer_path, texts, monkeypatch
):
    config, index = _tokenized_but_hidden(tmp_path, tokenizer_path, texts)
    monkeypatch.setattr(text_cache, "VISIBLE_SECONDS", 0.2)
    with pytest.raises(DataError, match=f"rank 1: {index} is not visible here 0.2 s after rank 0") as caught:
        tokenized_by_rank_0(config, RankZeroDone(), rank=1)
    assert "data.cache_dir to a directory every node shares" in str(caught.value)
    assert "femtotron inspect-data CONFIG" in str(caught.value)
