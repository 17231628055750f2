"""Context parallelism and document masking on CPU processes (gloo): memory per rank against cp, step time
against cp = 1 for the same global tokens, how long the ring waits on its transfers, and what document
masking costs against plain causal attention.

For cp = 1, 2, 4 the same fp32 model trains on the same samples (a long sequence, so attention matters):

- activation peak per rank: a step under `LiveMemory` (every storage tensor ops allocate while it runs:
  activations, their gradients, transient buffers; the model state existed before), after a warm-up step;
  `femtotron doctor`'s estimate of the same is printed beside it. Goal: proportional to 1/cp within 10%.
- step time (median of the timed steps); cp = 1 runs as one process with as many threads as the cp = 2
  run has processes, so both use the same cores.
- the ring's waits: the seconds Comm records on the cp group (waits for a block of keys and values, or
  of their gradients, not yet arrived) over the seconds spent in ring attention (forward and backward).

Document masking: the same model at cp = 1 on data with a document end every ~100 tokens, masked (the ring's
blocks with a mask) against unmasked (causal SDPA).

`--placement`: only the host work document masking adds per micro-batch (`place_tokens`: each token's
document and position, and which ring blocks any query sees), in CPU seconds per cp rank, for a micro-batch
of 4 x 16384 tokens in documents of about 1000 tokens, at cp = 1, 2 and 4.

    python bench/context_parallel.py [--sequence 2048] [--steps 4] [--quick] [--placement]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import DEBUG_SHAPE, headline, shape_config, spawn_ranks
from tokenizers import Tokenizer, models

from femtotron.batch import MicroBatch
from femtotron.data.indexed import IndexedDatasetWriter
from femtotron.diagnostics.memory import LiveMemory, estimate_rank
from femtotron.parallel import context_parallel
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer

EOS = 0


def write_data(prefix: Path, vocab: int, tokens: int, document: int) -> None:
    """Random tokens in documents of about `document` tokens, each ended by EOS."""
    rng = np.random.default_rng(0)
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    while tokens > 0:
        length = int(rng.integers(document // 2, 3 * document // 2))
        writer.add_document(np.append(rng.integers(1, vocab, length - 1), EOS).astype(np.uint16))
        tokens -= length
    writer.finalize()


def write_tokenizer(path: Path, vocab: int) -> Path:
    tokenizer = Tokenizer(
        models.WordLevel({"<|endoftext|>": EOS, **{f"t{i}": i for i in range(1, vocab)}}, "t1")
    )
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(path))
    return path


class RingTimer:
    """Seconds spent inside ring attention, forward and backward, on this rank."""

    def __init__(self) -> None:
        self.seconds = 0.0
        ring = context_parallel._RingAttention
        for name in ("forward", "backward"):
            setattr(ring, name, staticmethod(self.timed(getattr(ring, name))))

    def timed(self, function):
        def run(*args):
            start = time.perf_counter()
            try:
                return function(*args)
            finally:
                self.seconds += time.perf_counter() - start

        return run


def measure(trainer: Trainer, steps: int) -> dict:
    trainer.train_step()  # warm-up
    with LiveMemory() as live:
        trainer.train_step()
    timer, times, waits = RingTimer(), [], 0.0
    for _ in range(steps):
        start = time.perf_counter()
        result = trainer.train_step()  # its comm_seconds: the seconds in each group's ops, waits included
        times.append(time.perf_counter() - start)
        waits += result.comm_seconds.get("cp", 0.0)
    return {"peak": live.peak, "step": statistics.median(times), "waits": waits, "ring": timer.seconds}


def placement_seconds(sequence: int, micro_batch: int, cp: int, document: int = 1000) -> float:
    """CPU seconds of `place_tokens` for one micro-batch, per cp rank (the mean over the ranks)."""
    rng = np.random.default_rng(0)
    tokens = torch.from_numpy(rng.integers(1, 2048, (micro_batch, sequence + 1)))
    tokens[torch.from_numpy(rng.random((micro_batch, sequence + 1)) < 1 / document)] = EOS
    batch = MicroBatch.from_tokens(tokens)
    context_parallel.place_tokens(batch, cp, 0, EOS)  # warm-up: torch's first calls set themselves up
    start = time.process_time()
    for rank in range(cp):
        context_parallel.place_tokens(batch, cp, rank, EOS)
    return (time.process_time() - start) / cp


def rank_fn(ctx, cases, args, report) -> None:
    for index, config in enumerate(cases):
        report(index, measure(Trainer(config, ctx, log_to_console=False), args.steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequence", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per layout")
    parser.add_argument("--quick", action="store_true", help="a 1024-token sequence and 2 timed steps")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--placement", action="store_true", help="only document masking's host work")
    args = parser.parse_args()
    if args.placement:
        for cp in (1, 2, 4):
            seconds = placement_seconds(16384, 4, cp)
            print(f"  place_tokens, 4 x 16384 tokens, cp={cp}: {seconds:.3f} CPU s per rank", flush=True)
        return
    if args.quick:
        args.sequence, args.steps = 1024, 2
    shape = {**DEBUG_SHAPE, "sequence_length": args.sequence, "micro_batch_size": 2}
    print(
        f"hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, {shape['num_attention_heads']} "
        f"heads ({shape['num_key_value_heads']} KV), vocab {shape['vocab_size']}, micro-batch 2 x "
        f"{args.sequence} tokens, fp32, {args.steps} timed steps",
        flush=True,
    )
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "documents"
        write_data(prefix, shape["vocab_size"], 64 * 2 * args.sequence, document=100)
        tokenizer = write_tokenizer(Path(tmp) / "tokenizer.json", shape["vocab_size"])

        def config(cp: int, masking: bool = False):
            return shape_config(
                shape,
                "float32",
                prefix,
                Path(tmp) / "runs",
                run=f"cp{cp}-{masking}",
                parallelism={"cp": cp},
                model={"document_masking": masking},
                tokenizer={"tokenizer_name_or_path": str(tokenizer)},
            )

        torch.set_num_threads(2)
        results[1] = measure(Trainer(config(1), ParallelContext(), log_to_console=False), args.steps)
        for cp in (2, 4):
            spawn_ranks(
                {"cp": cp}, rank_fn, [config(cp)], args, lambda _, values, cp=cp: results.update({cp: values})
            )
        masked = measure(
            Trainer(config(1, masking=True), ParallelContext(), log_to_console=False), args.steps
        )
        estimates = {cp: estimate_rank(config(cp), 0, on_this_cpu=True).micro_batch_peak for cp in (1, 2, 4)}
    base = results[1]
    for cp in (1, 2, 4):
        ranks = results[cp] if cp > 1 else [base]
        peak = max(rank["peak"] for rank in ranks)
        step = statistics.median(rank["step"] for rank in ranks)
        waits = sum(rank["waits"] for rank in ranks) / len(ranks)
        ring = sum(rank["ring"] for rank in ranks) / len(ranks)
        print(
            f"  cp={cp}: activation peak {peak / 2**20:7.1f} MiB per rank ({peak / base['peak']:.3f} of "
            f"cp=1, 1/cp = {1 / cp:.3f}; doctor {estimates[cp] / 2**20:.1f} MiB), step {step * 1e3:6.0f} ms "
            f"({step / base['step']:.2f}x cp=1)"
            + (
                f", ring waits {waits * 1e3:.0f} ms of {ring * 1e3:.0f} ms in ring attention"
                if cp > 1
                else ""
            ),
            flush=True,
        )
        if cp > 1:
            headline(
                f"cp={cp}: activation peak per rank x cp / cp=1's (MiB)",
                peak * cp / 2**20,
                base["peak"] / 2**20,
            )
            headline(
                f"cp={cp}: step time / cp=1's, same global tokens (ms)",
                step * 1e3,
                base["step"] * 1e3,
                number_format=".0f",
            )
            headline(
                f"cp={cp}: ring waits / time in ring attention (ms)",
                waits * 1e3,
                ring * 1e3,
                number_format=".0f",
            )
    print(
        f"  document masking (documents of ~100 tokens), cp=1: step {masked['step'] * 1e3:.0f} ms against "
        f"{base['step'] * 1e3:.0f} ms causal ({masked['step'] / base['step']:.2f}x)",
        flush=True,
    )
    headline(
        "document masking: step time / causal, cp=1 (ms)",
        masked["step"] * 1e3,
        base["step"] * 1e3,
        number_format=".0f",
    )


if __name__ == "__main__":
    main()
