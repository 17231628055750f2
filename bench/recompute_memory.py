"""Activation recomputation (`parallelism.recompute_layer`): the activation memory it saves, the time it costs.

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
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from femtotron.config import load_config_dict
from femtotron.data.indexed import IndexedDatasetWriter
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer

DEBUG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=2048, sequence_length=128, micro_batch_size=16)
SHAPES = {
    "debug": DEBUG,  # examples/debug.yaml
    "deep": {**DEBUG, "num_hidden_layers": 8},  # the same layers, more of them
}


def write_random_tokens(prefix: Path, vocab: int, tokens: int) -> None:
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(8):
        writer.add_document(rng.integers(1, vocab, tokens // 8, dtype=np.uint16))
    writer.finalize()


def trainer(shape: dict, recompute: bool, data_prefix: Path, run_dir: Path) -> Trainer:
    model_keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size")
    config = load_config_dict({
        "general": {"run": f"recompute-{recompute}"},
        "model": {"model_config": {**{k: shape[k] for k in model_keys},
                                   "max_position_embeddings": shape["sequence_length"]},
                  "dtype": "float32"},
        "parallelism": {"recompute_layer": recompute},
        "tokens": {"sequence_length": shape["sequence_length"], "micro_batch_size": shape["micro_batch_size"],
                   "train_steps": 10**6},
        "data": {"dataset_folder": str(data_prefix)},
        "logging": {"output_dir": str(run_dir)},
        "checkpoints": {"save_final_state": False},
    })
    return Trainer(config, ParallelContext(), log_to_console=False)


def saved_activation_bytes(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> int:
    """Bytes autograd holds for backward after one forward pass (each storage once, no parameters)."""
    state = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        if storage.data_ptr() not in state and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, targets)  # the graph is dropped unused: the trainer's gradient hooks must not fire
    return total


def seconds(run: Trainer) -> float:
    start = time.perf_counter()
    run.train_step()
    return time.perf_counter() - start


def bench_case(name: str, rounds: int) -> None:
    shape = SHAPES[name]
    tokens_per_step = shape["micro_batch_size"] * shape["sequence_length"]
    print(f"\n[{name}] hidden {shape['hidden_size']}, intermediate {shape['intermediate_size']}, "
          f"{shape['num_hidden_layers']} layers, {shape['num_attention_heads']} heads, vocab {shape['vocab_size']}, "
          f"micro-batch {shape['micro_batch_size']} x {shape['sequence_length']}, fp32, "
          f"{torch.get_num_threads()} threads, {rounds} steps each", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "random"
        write_random_tokens(prefix, shape["vocab_size"], 64 * tokens_per_step)
        runs = {on: trainer(shape, on, prefix, Path(tmp) / "runs") for on in (False, True)}
        ids = torch.randint(1, shape["vocab_size"], (shape["micro_batch_size"], shape["sequence_length"] + 1),
                            generator=torch.Generator().manual_seed(0))
        saved = {on: saved_activation_bytes(run.chunks[0], ids[:, :-1], ids[:, 1:]) for on, run in runs.items()}
        layer_input = tokens_per_step * shape["hidden_size"] * 4
        per_layer_off = (saved[False] - saved[True]) / shape["num_hidden_layers"] + layer_input
        print(f"  saved activations per micro-batch: off {saved[False] / 2**20:7.1f} MiB, "
              f"on {saved[True] / 2**20:7.1f} MiB, on/off {saved[True] / saved[False]:.3f} "
              f"(saves {1 - saved[True] / saved[False]:.0%})")
        print(f"  per decoder layer: off {per_layer_off / 2**20:.1f} MiB, on {layer_input / 2**20:.1f} MiB "
              f"(its input), {layer_input / per_layer_off:.3f}", flush=True)
        times: dict[bool, list[float]] = {False: [], True: []}
        for run in runs.values():
            run.train_step()  # warm-up
        for _ in range(rounds):
            for on, run in runs.items():
                times[on].append(seconds(run))
    for label, stat in (("median", statistics.median), ("fastest", min)):
        off, on = stat(times[False]), stat(times[True])
        print(f"  step time, {label:>7}: off {off * 1e3:5.0f} ms, on {on * 1e3:5.0f} ms, on/off {on / off:.2f}x",
              flush=True)


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
