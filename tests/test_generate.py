"""`femtotron generate`: a key/value cache, greedy decoding equal to transformers' token for token, and
Hugging Face directories read as they are."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from femtotron.cli import main
from femtotron.generate import load_run, sample

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
    """The loop without a cache: the whole (cropped) context through the model for every token."""
    ids = list(ids)
    window = model.cfg.max_position_embeddings
    for _ in range(new):
        context = torch.tensor([ids[-window:]])
        ids.append(int(model.logits(context)[0, -1].argmax()))
    return ids


def test_the_cache_gives_the_uncached_tokens_also_past_the_context_window(tmp_path):
    """64 positions: 10 prompt tokens and 80 new ones run past the window, where the context is cropped to
    the last 64 tokens and the cache rebuilt, as the loop without a cache crops it."""
    hf_directory(tmp_path / "hf")
    _, model = load_run(tmp_path / "hf")
    prompt = torch.randint(0, 128, (10,)).tolist()
    with torch.no_grad():
        assert prompt + sample(model, prompt, 80, temperature=0) == uncached_greedy(model, prompt, 80)


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
