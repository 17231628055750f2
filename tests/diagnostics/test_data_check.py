"""N3: `femtotron inspect-data` shows what the model is trained on."""

from femtotron.cli import main


def test_N3_inspect_data_decodes_the_first_samples_with_their_loss_mask(tiny_config, tmp_path, capsys):
    from femtotron.data.tokenizer import train_tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    tokenizer = train_tokenizer([str(corpus)], 300, str(tmp_path / "tokenizer.json"))
    config = tiny_config()
    path = tmp_path / "c.yaml"
    import yaml

    path.write_text(yaml.safe_dump(config.to_dict()))
    assert main(["inspect-data", str(path), "--n", "2", f"tokenizer.tokenizer_name_or_path={tmp_path / 'tokenizer.json'}",
                 "model.model_config.vocab_size=512"]) == 0
    out = capsys.readouterr().out
    assert out.count("target positions count in the loss") == 2
    assert f"sample 0: {config.data.dataset_folder}, sample " in out and "32 input tokens; 32 of 32" in out
    assert "  token ids: [" in out and "  text: '" in out
    assert tokenizer.get_vocab_size() <= 300
