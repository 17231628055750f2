import gzip
import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from femtotron.data.tokenizer import eos_token_id, load_tokenizer, train_tokenizer
from femtotron.errors import DataError, UsageError, WriteError


def test_trained_tokenizer_round_trips_and_has_eos(tokenizer_path, texts):
    tokenizer = load_tokenizer(tokenizer_path)
    assert 257 < tokenizer.get_vocab_size() <= 400  # the tiny corpus runs out of merges before 400
    assert eos_token_id(tokenizer) == 0
    for text in texts:
        ids = tokenizer.encode(text).ids
        assert 0 not in ids
        assert tokenizer.decode(ids) == text
    # BPE merged something: common words are single tokens, far shorter than bytes.
    assert len(tokenizer.encode(texts[0]).ids) < len(texts[0].encode()) / 2


def test_trains_from_txt_and_gzipped_jsonl(tmp_path, texts):
    txt = tmp_path / "a.txt"
    txt.write_text("\n".join(texts[:20]), encoding="utf-8")
    gz = tmp_path / "b.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"body": t}) + "\n" for t in texts[20:])
    out = tmp_path / "sub" / "tokenizer.json"
    tokenizer = train_tokenizer([txt, gz], vocab_size=300, output_path=out, min_frequency=1, text_key="body")
    assert out.is_file() and not list(out.parent.glob("*.tmp*"))
    assert load_tokenizer(out.parent).decode(tokenizer.encode(texts[25]).ids) == texts[25]


def test_vocab_too_small_is_explained_as_a_bad_argument(tmp_path, texts):
    with pytest.raises(UsageError, match="at least 257") as info:
        train_tokenizer([], vocab_size=100, output_path=tmp_path / "t.json")
    assert info.value.exit_code == 2  # like argparse's own errors, not 3 (data)


def test_missing_or_unreadable_tokenizer_names_the_file(tmp_path):
    with pytest.raises(DataError, match=r"missing\.json does not exist.*femtotron train-tokenizer"):
        load_tokenizer(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(DataError, match=r"broken\.json cannot be read"):
        load_tokenizer(broken)


def test_eos_missing_is_explained():
    with pytest.raises(DataError, match=r"no end-of-document token.*<\|endoftext\|>"):
        eos_token_id(Tokenizer(models.BPE()))


def test_eos_found_under_other_names():
    tokenizer = Tokenizer(models.BPE())
    tokenizer.add_special_tokens(["<s>", "</s>"])
    assert eos_token_id(tokenizer) == 1


def test_a_full_disk_names_the_tokenizer_file(small_disk, tmp_path, texts):
    """The tokenizers library reports the OS error as a bare Exception: it reached the user as a traceback."""
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    (small_disk / "filler").write_bytes(b"x" * 60_000)
    output = small_disk / "tokenizer.json"
    with pytest.raises(WriteError, match=f"cannot write {output}: No space left on device. Fix: free space"):
        train_tokenizer([source], vocab_size=300, output_path=output)
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


@pytest.mark.parametrize("name", ["gpt2", "HuggingFaceTB/SmolLM2-135M"])
def test_a_hub_name_is_refused_with_the_download_command(name, tmp_path, monkeypatch):
    """nanotron configs name hub tokenizers; femtotron never fetches during a run."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=f"`huggingface-cli download {name} tokenizer.json --local-dir DIR`"):
        load_tokenizer(name)


def test_a_missing_file_path_is_not_taken_for_a_hub_name(tmp_path):
    with pytest.raises(DataError, match="does not exist; train one with"):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_a_local_hf_tokenizer_directory_is_read(tmp_path):
    (tmp_path / "model").mkdir()
    shutil.copyfile(
        Path(__file__).parents[2] / "examples" / "tokenizer.json", tmp_path / "model" / "tokenizer.json"
    )
    assert load_tokenizer(tmp_path / "model").get_vocab_size() == 2048
