"""Activation recomputation (`parallelism.recompute_layer`): the activation memory it saves, the time it
costs.

For each shape the same fp32 model is built twice, recomputation off and on, in the same run:

- saved-activation bytes per micro-batch: one forward pass under a `saved_tensors_hooks` pack hook
  that adds up the storage of every tensor autograd keeps for backward, each storage once,
  parameters and buffers not at all (they are held anyway). With recomputation each decoder layer
  keeps only its input; the embedding output, the final norm, the logits and the loss keep theirs.
- step time: a whole `Trainer.train_step` (forward, backward, clipping, AdamW) on one micro-batch.
  The machine is noisy, so steps alternate (off, on, off, on, ...) after a warm-up step each, and
  both the median and the fastest step of each are reported, with their ratios.

    python bench/recompute_memory.py [--cases debug,deep] [--rounds 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import DEBUG_SHAPE, headline, median_pair, shape_trainer, write_random_tokens

from femtotron.diagnostics.activation_memory import saved_activation_bytes

SHAPES = {
    "debug": DEBUG_SHAPE,
    "deep": {**DEBUG_SHAPE, "num_hidden_layers": 8},  # the same layers, more of them
}


def seconds(run) -> float:
    start = time.perf_counter()
    run.train_step()
    return time.perf_counter() - start


def bench_case(name: str, rounds: int) -> None:
    shape = SHAPES[name]
    tokens_per_step = shape["micro_batch_size"] * shape["sequence_length"]
    print(
        f"\n[{name}] hidden {shape['hidden_size']}, intermediate {shape['intermediate_size']}, "
        f"{shape['num_hidden_layers']} layers, {shape['num_attention_heads']} heads, vocab "
        f"{shape['vocab_size']}, micro-batch {shape['micro_batch_size']} x {shape['sequence_length']}, "
        f"fp32, {torch.get_num_threads()} threads, {rounds} steps each",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "random"
        write_random_tokens(prefix, shape["vocab_size"], 64 * tokens_per_step)
        runs = {
            on: shape_trainer(
                shape,
                "float32",
                prefix,
                Path(tmp) / "runs",
                run=f"recompute-{on}",
                parallelism={"recompute_layer": on},
            )
            for on in (False, True)
        }
        ids = torch.randint(
            1,
            shape["vocab_size"],
            (shape["micro_batch_size"], shape["sequence_length"] + 1),
            generator=torch.Generator().manual_seed(0),
        )
        saved = {
            on: saved_activation_bytes(run.model.chunks[0], ids[:, :-1], ids[:, 1:])
            for on, run in runs.items()
        }
        layer_input = tokens_per_step * shape["hidden_size"] * 4
        per_layer_off = (saved[False] - saved[True]) / shape["num_hidden_layers"] + layer_input
        print(
            f"  saved activations per micro-batch: off {saved[False] / 2**20:7.1f} MiB, "
            f"on {saved[True] / 2**20:7.1f} MiB, on/off {saved[True] / saved[False]:.3f} "
            f"(saves {1 - saved[True] / saved[False]:.0%})"
        )
        print(
            f"  per decoder layer: off {per_layer_off / 2**20:.1f} MiB, on {layer_input / 2**20:.1f} MiB "
            f"(its input), {layer_input / per_layer_off:.3f}",
            flush=True,
        )
        headline(
            f"recompute_layer, {name}: saved activations per micro-batch (MiB), on / off",
            saved[True] / 2**20,
            saved[False] / 2**20,
        )
        times: dict[bool, list[float]] = {False: [], True: []}
        for run in runs.values():
            run.train_step()  # warm-up
        for _ in range(rounds):
            for on, run in runs.items():
                times[on].append(seconds(run))
    on, off = median_pair(times[True], times[False])
    headline(
        f"recompute_layer, {name}: step time (ms, the median round), on / off",
        on * 1e3,
        off * 1e3,
        number_format=".0f",
    )
    for label, stat in (("median", statistics.median), ("fastest", min)):
        off, on = stat(times[False]), stat(times[True])
        print(
            f"  step time, {label:>7}: off {off * 1e3:5.0f} ms, on {on * 1e3:5.0f} ms, on/off "
            f"{on / off:.2f}x",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="debug,deep", help=f"shapes, from {', '.join(SHAPES)}")
    parser.add_argument("--rounds", type=int, default=10, help="timed steps with each setting")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.cases.split(","):
        bench_case(name, args.rounds)


if __name__ == "__main__":
    main()
