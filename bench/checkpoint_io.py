"""Checkpoint save and load time against writing and reading the same tensors as one safetensors file.

One process builds femtotron's Trainer for a model shape, takes one training step (so Adam's moments
exist), then, --repeats times each, alternating:

    baseline save   safetensors.torch.save_file of the same tensors (weights, masters if not fp32, both
                    moments) as one file, plus an fsync: the raw cost of the bytes
    femtotron save  checkpoint.save: slices, per-file sha256, manifest, fsyncs, atomic rename, `latest`
    baseline load   safetensors.torch.load_file of that file, every tensor copied out (load_file maps the
                    file lazily; the copy makes it read the bytes)
    femtotron load  checkpoint.load into the live trainer: checksum check, slice reads, placement

and prints median seconds, MB/s and the ratio to the baseline. The checksums read every file once
more, so expect femtotron's save and load to cost about 1.5-2x the raw I/O.

    python bench/checkpoint_io.py [--shape debug|wide] [--dtype float32|bfloat16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from common import headline, shape_trainer, write_random_tokens
from safetensors.torch import load_file, save_file

from femtotron.serialize import checkpoint
from femtotron.serialize.checkpoint import rank_slices

SHAPES = {
    "debug": {
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 2048,
        "sequence_length": 128,
        "micro_batch_size": 2,
    },
    "wide": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 8000,
        "sequence_length": 64,
        "micro_batch_size": 1,
    },
}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="wide")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_random_tokens(root / "tokens", shape["vocab_size"], 200_000)
        trainer = shape_trainer(shape, args.dtype, root / "tokens", root / "runs")
        trainer.config.checkpoints.keep_last_n = 1
        trainer.train_step()
        tensors = {
            f"{i}:{name}": values.contiguous()
            for i, (name, _, _, values) in enumerate(rank_slices(trainer.model, trainer.optimizer))
        }
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        raw = root / "raw.safetensors"

        def raw_save() -> None:
            save_file(tensors, str(raw))
            with open(raw, "rb") as f:
                os.fsync(f.fileno())

        times: dict[str, list[float]] = {
            key: [] for key in ("baseline save", "femtotron save", "baseline load", "femtotron load")
        }
        saved = None
        for repeat in range(args.repeats):
            times["baseline save"].append(timed(raw_save))
            trainer.state.step = repeat + 1  # a new checkpoint directory each time
            start = time.perf_counter()
            saved = checkpoint.save(trainer.parts)
            times["femtotron save"].append(time.perf_counter() - start)
            times["baseline load"].append(timed(lambda: [t.clone() for t in load_file(str(raw)).values()]))
            times["femtotron load"].append(timed(lambda path=saved: checkpoint.load(trainer.parts, path)))
    print(
        f"shape {args.shape}, {args.dtype}: {size / 2**20:.1f} MiB of weights, master weights and moments; "
        f"medians of {args.repeats}"
    )
    for key, values in times.items():
        seconds = statistics.median(values)
        baseline = statistics.median(times[key.replace("femtotron", "baseline")])
        print(f"  {key:<16}{seconds:8.3f} s {size / 2**20 / seconds:9.0f} MiB/s {seconds / baseline:7.2f}x")
        if key.startswith("femtotron"):
            what = f"checkpoint {key.split()[1]}, {args.shape} {args.dtype} ({size / 2**20:.0f} MiB): seconds"
            headline(
                f"{what}, femtotron / one safetensors file",
                seconds,
                baseline,
                number_format=".3f",
            )


if __name__ == "__main__":
    main()
