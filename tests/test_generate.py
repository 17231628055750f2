"""`femtotron generate`: a key/value cache, greedy decoding equal to transformers' token for token, and
Hugging Face directories read as they are."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from femtotron.cli import main
from femtotron.generate import load_run, sample
from femtotron.serialize.hf import import_hf

TOKENIZER = Path(__file__).resolve().parents[1] / "examples" / "tokenizer.json"


def hf_directory(path, vocab=128):
    """A random LlamaForCausalLM (GQA, 64 positions) saved by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).float().eval()
    model.save_pretrained(path)
    return model


def test_greedy_decoding_equals_transformers_generate_token_for_token(tmp_path):
    hf = hf_directory(tmp_path / "hf")
    _, ours = load_run(tmp_path / "hf")  # an HF directory, read as it is
    prompt = torch.randint(0, 128, (6,)).tolist()
    theirs = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(
            1, len(prompt), dtype=torch.long
        ),  # else a token equal to the pad id is masked
        max_new_tokens=40,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    with torch.no_grad():
        assert sample(ours, prompt, 40, temperature=0) == theirs


def uncached_greedy(model, ids, new):
    """The loop without a cache: the whole context through the model for every token; once it outgrows the
    window it starts again from its last half (as `sample` does)."""
    ids = list(ids)
    window = model.cfg.max_position_embeddings
    start = max(0, len(ids) - window)
    for _ in range(new):
        if len(ids) - start > window:
            start = len(ids) - window // 2
        context = torch.tensor([ids[start:]])
        ids.append(int(model.logits(context)[0, -1].argmax()))
    return ids


def test_the_cache_gives_the_uncached_tokens_also_past_the_context_window(tmp_path):
    """64 positions: 10 prompt tokens and 150 new ones run past the window twice, where the context is
    cropped to its last 32 tokens and the cache rebuilt, as the loop without a cache crops it; the model
    sees each token about once (cropping to the whole window ran 64 tokens through it for every new one)."""
    hf_directory(tmp_path / "hf")
    _, model = load_run(tmp_path / "hf")
    prompt = torch.randint(0, 128, (10,)).tolist()
    fed = []
    forward = model.logits

    def counting(inputs, cache=None):
        fed.append(inputs.shape[1])
        return forward(inputs, cache)

    with torch.no_grad():
        reference = uncached_greedy(model, prompt, 150)
        model.logits = counting
        assert prompt + sample(model, prompt, 150, temperature=0) == reference
    assert len(fed) == 150 and sum(fed) <= 10 + 150 + 32 * 5


def test_generate_reads_a_hugging_face_directory(tmp_path, capsys):
    hf_directory(tmp_path / "hf", vocab=2048)
    shutil.copyfile(TOKENIZER, tmp_path / "hf" / "tokenizer.json")
    args = [
        "generate",
        str(tmp_path / "hf"),
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
    ]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert first.startswith("ROMEO:") and main(args) == 0 and capsys.readouterr().out == first  # greedy


@pytest.mark.parametrize(
    "change, message",
    [
        ("intermediate_size: 96", r"down_proj.weight in .* has shape \(64, 96\), but config.yaml makes it"),
        ("num_hidden_layers: 2", "config.yaml has num_hidden_layers=1000, but the weights in .* hold 2"),
    ],
)
def test_E3_a_config_larger_than_its_weights_is_refused_from_the_headers_before_a_model_is_built(
    tmp_path, capsys, change, message
):
    hf_directory(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "run")
    config = tmp_path / "run" / "config.yaml"
    key = change.split(":")[0]
    # 300 MB of weights for intermediate_size 400,000
    config.write_text(config.read_text().replace(change, f"{key}: {400_000 if 'inter' in key else 1000}"))
    started = time.monotonic()
    assert main(["generate", str(tmp_path / "run"), "--prompt", "hi"]) == 1
    assert re.search(message, capsys.readouterr().err)
    assert time.monotonic() - started < 10


def test_a_negative_temperature_is_refused(tmp_path, capsys):
    """It behaved as greedy; a user who typed it meant something else."""
    assert main(["generate", str(tmp_path), "--temperature", "-1"]) == 2
    assert "--temperature -1 is negative: give 0 (greedy) or more" in capsys.readouterr().err
