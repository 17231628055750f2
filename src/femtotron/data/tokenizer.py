"""Byte-level BPE tokenizers with HF `tokenizers`: train one, load one, find its end-of-document token."""

from __future__ import annotations

import os
from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from femtotron.atomic import atomic_path, write_error
from femtotron.data.documents import iter_documents
from femtotron.errors import ConfigError, DataError, UsageError

EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>")
_TRAIN_HINT = (
    "train one with: femtotron train-tokenizer --input corpus.jsonl --vocab-size 8192 --output tokenizer.json"
)


def train_tokenizer(
    input_paths: Sequence[str | os.PathLike],
    vocab_size: int,
    output_path: str | os.PathLike,
    min_frequency: int = 2,
    text_key: str = "text",
    show_progress: bool = False,
) -> Tokenizer:
    """Train byte-level BPE (every string encodable, `decode(encode(s)) == s`; `<|endoftext|>` is id 0) on
    the documents in `input_paths` and save it (atomically) as tokenizer.json."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise UsageError(
            f"--vocab-size {vocab_size} is too small: byte-level BPE needs at least {len(alphabet) + 1} "
            f"({len(alphabet)} bytes + {EOS_TOKENS[0]}). Fix: --vocab-size {len(alphabet) + 1} or more "
            "(8192 or more for real text)."
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKENS[0]],
        initial_alphabet=alphabet,
        show_progress=show_progress,
    )
    texts = (text for path in input_paths for text in iter_documents(path, text_key))
    tokenizer.train_from_iterator(texts, trainer=trainer)
    with atomic_path(output_path) as tmp:
        try:
            tokenizer.save(tmp)
        except Exception as e:  # the Rust side reports an OS error as text: "... (os error 28)"
            raise write_error(e, output_path) or DataError(f"cannot write {output_path}: {e}") from None
    return tokenizer


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer.json (or a directory holding one, as HF model folders do)."""
    path = os.fspath(path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        if _looks_like_a_hub_name(path):
            raise DataError(
                f"tokenizer {path} is not a file or directory here; it looks like a Hugging Face Hub name, "
                "and femtotron reads tokenizers from local files only (a training run fetches nothing). "
                f"Download it once: `huggingface-cli download {path} tokenizer.json --local-dir DIR`, then "
                "set tokenizer.tokenizer_name_or_path=DIR."
            )
        raise DataError(f"tokenizer file {path} does not exist; {_TRAIN_HINT}")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the Rust side raises a plain Exception for any parse problem
        raise DataError(
            f"tokenizer file {path} cannot be read as a HF tokenizers JSON file ({e}); {_TRAIN_HINT}"
        ) from e


def _looks_like_a_hub_name(path: str) -> bool:
    """`gpt2`, `HuggingFaceTB/SmolLM2-135M`: no file suffix, at most one slash, not absolute or relative."""
    parts = path.split("/")
    plain = len(parts) <= 2 and all(part and part not in (".", "..") for part in parts)
    return plain and not path.startswith(("/", "~")) and not os.path.splitext(path)[1]


def eos_token_id(tokenizer: Tokenizer) -> int:
    """The id of the end-of-document token, looked up among the tokenizer's special tokens."""
    special = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    for token in EOS_TOKENS:
        if token in special:
            return special[token]
    raise DataError(
        f"the tokenizer has no end-of-document token: looked for {', '.join(EOS_TOKENS)} among its special "
        f"tokens {sorted(special) or '(none)'}. Documents need one to be separated; add one as a special "
        f"token, or {_TRAIN_HINT}"
    )


def tokenizer_for_model(path: str | None, vocab_size: int) -> Tokenizer | None:
    """The run's tokenizer (tokenizer.tokenizer_name_or_path), refused if it has ids the model can't embed."""
    if path is None:
        return None
    tokenizer = load_tokenizer(path)
    size = tokenizer.get_vocab_size()
    if size > vocab_size:
        raise ConfigError(
            f"tokenizer.tokenizer_name_or_path={path} has {size} tokens but model.model_config.vocab_size="
            f"{vocab_size}: ids {vocab_size}..{size - 1} would have no embedding. Set "
            f"model.model_config.vocab_size >= {size}, or use the tokenizer the data was preprocessed with."
        )
    return tokenizer
