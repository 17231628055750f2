"""Is the model trained on what the user thinks (N3)? The first loss against ln(vocab), and `femtotron
inspect-data`: samples decoded with the positions that count in the loss. The checks every run makes of its
data (token ids against the vocabulary) are data/run_data.py's."""

from __future__ import annotations

import math

from tokenizers import Tokenizer

from femtotron.batch import IGNORE_INDEX
from femtotron.data.nanoset import MicroBatchIterator, Nanoset
from femtotron.data.tokenizer import eos_token_id
from femtotron.errors import DataError

DOCUMENT_END = "[end of document]"  # the end token decodes to nothing: shown, so packing can be seen


def first_loss_warning(loss: float, vocab_size: int) -> str | None:
    """A freshly initialised model predicts nearly uniformly: its first loss is close to ln(vocab_size)."""
    expected = math.log(vocab_size)
    if abs(loss - expected) <= max(1.0, 0.25 * expected):
        return None
    why = (
        "far below: the targets are too easy to predict (repeated or constant data, or inputs leaking into "
        "the targets)"
        if loss < expected
        else "far above: the initialisation is too large (model.init_method.std, usually 0.02) or the "
        "logits are scaled wrongly"
    )
    return (
        f"step 1: loss {loss:.3f}, but a freshly initialised model should start near ln(vocab_size) = "
        f"ln({vocab_size}) = {expected:.3f}; {why}. Look at the data with `femtotron inspect-data CONFIG`."
    )


def inspect_samples(nanoset: Nanoset, tokenizer: Tokenizer | None, sequence_length: int, n: int) -> str:
    """The first `n` samples of training, as the model sees them: where each comes from, the decoded input
    with its documents' ends marked, and which target positions count in the loss."""
    lines = []
    end_id = _end_of_document_id(tokenizer)
    batches = MicroBatchIterator(nanoset, micro_batch_size=n, batch_accumulation=1, dp_rank=0, dp_size=1)
    batch = batches.step_at(0)[0]
    for g, (inputs, targets) in enumerate(zip(batch.inputs.tolist(), batch.targets.tolist(), strict=True)):
        dataset, index = nanoset.locate(g)
        sample = inputs[:1] + targets
        counted = sum(t != IGNORE_INDEX for t in targets)
        lines.append(
            f"sample {g}: {nanoset.datasets[dataset].path_prefix}, sample {index} of that dataset, "
            f"{sequence_length} input tokens; {counted} of {len(targets)} target positions count in the "
            "loss" + ("" if counted == len(targets) else " (masked positions shown as [masked])")
        )
        lines.append(f"  token ids: {sample[:16]}{' ...' if len(sample) > 16 else ''}")
        if end_id is not None:
            ends = [position for position, token in enumerate(sample) if token == end_id]
            lines.append(
                f"  {len(ends)} document end(s), at positions {ends[:16]}{' ...' * (len(ends) > 16)}"
            )
        if tokenizer is not None:
            pieces = [_piece(tokenizer, token, end_id) for token in sample]
            lines.append("  text: " + repr("".join(pieces))[:2000])
        if counted == 0:
            lines.append("  WARNING: no target position counts in the loss: this sample teaches nothing")
    if tokenizer is None:
        lines.append("(set tokenizer.tokenizer_name_or_path to see the text)")
    return "\n".join(lines)


def _end_of_document_id(tokenizer: Tokenizer | None) -> int | None:
    if tokenizer is None:
        return None
    try:
        return eos_token_id(tokenizer)
    except DataError:  # a tokenizer without one: nothing to mark
        return None


def _piece(tokenizer: Tokenizer, token: int, end_id: int | None) -> str:
    if token == IGNORE_INDEX:
        return "[masked]"
    if token == end_id:
        return DOCUMENT_END
    return tokenizer.decode([token])
