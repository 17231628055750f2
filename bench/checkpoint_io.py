"""Checkpoint save and load time against writing and reading the same tensors as one safetensors file, and
what checkpoints.async_save costs training.

One process builds femtotron's Trainer for a model shape, takes one training step (so Adam's moments
exist), then, --repeats times each, alternating:

    baseline save   safetensors.torch.save_file of the same tensors (weights, masters if not fp32, both
                    moments) as one file, plus an fsync: the raw cost of the bytes
    femtotron save  saving.save: slices, checksums computed while writing, manifest, fsyncs, atomic
                    rename, `latest`
    async stall     checkpoints.async_save: the time training stops (barrier, copy into the staging
                    buffers); the write that follows in the background is waited for before the next round
    baseline load   safetensors.torch.load_file of that file, every tensor copied out (load_file maps the
                    file lazily; the copy makes it read the bytes)
    femtotron load  restore.load into the live trainer: slice reads, each tensor's checksum checked as it
                    is read, placement

and prints median seconds, MB/s and the ratio to the baseline (the stall's to femtotron's synchronous save).
Then it times --steps training steps alone and steps while a background write runs, and prints their ratio:
what the writer thread costs the training thread. Files go to --dir (default: a temporary directory; the
page cache serves the loads, as it does a resume soon after a save).

    python bench/checkpoint_io.py [--shape debug|wide|large[,...]] [--dtype float32|bfloat16] [--repeats 3]
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

from femtotron.serialize import restore, saving
from femtotron.serialize.background import BackgroundSaves

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
    "large": {  # about 233M parameters: ~3 GiB of checkpoint in bf16 with fp32 masters and moments
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 8000,
        "sequence_length": 64,
        "micro_batch_size": 1,
    },
}


# What each figure is divided by: the raw safetensors file; the stall by the synchronous save it replaces.
BASELINE = {
    "femtotron save": "baseline save",
    "async stall": "femtotron save",
    "femtotron load": "baseline load",
}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_shape(name: str, args: argparse.Namespace, root: Path) -> None:
    shape = SHAPES[name]
    write_random_tokens(root / "tokens", shape["vocab_size"], 200_000)
    trainer = shape_trainer(shape, args.dtype, root / "tokens", root / "runs")
    trainer.config.checkpoints.keep_last_n = 1
    trainer.train_step()
    tensors = {
        f"{i}:{name}": values.contiguous()
        for i, (name, _, _, values) in enumerate(saving.rank_slices(trainer.model, trainer.optimizer))
    }
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    raw = root / "raw.safetensors"

    def raw_save() -> None:
        save_file(tensors, str(raw))
        with open(raw, "rb") as f:
            os.fsync(f.fileno())

    background = BackgroundSaves(trainer.ctx)
    background.reserve(trainer.parts)  # as the trainer does before step 1
    times: dict[str, list[float]] = {
        key: []
        for key in ("baseline save", "femtotron save", "async stall", "baseline load", "femtotron load")
    }
    saved = None
    for repeat in range(args.repeats):
        times["baseline save"].append(timed(raw_save))
        trainer.state.step = 2 * repeat + 1  # a new checkpoint directory each time
        start = time.perf_counter()
        saved = saving.save(trainer.parts)
        times["femtotron save"].append(time.perf_counter() - start)
        trainer.state.step += 1
        times["async stall"].append(background.start(trainer.parts))
        background.wait()
        times["baseline load"].append(timed(lambda: [t.clone() for t in load_file(str(raw)).values()]))
        times["femtotron load"].append(timed(lambda path=saved.parent: restore.load(trainer.parts, path)))
    print(
        f"shape {name}, {args.dtype}: {size / 2**20:.1f} MiB of weights, master weights and moments; "
        f"medians of {args.repeats}"
    )
    for key, values in times.items():
        seconds = statistics.median(values)
        baseline = statistics.median(times[BASELINE.get(key, key)])
        print(f"  {key:<16}{seconds:8.3f} s {size / 2**20 / seconds:9.0f} MiB/s {seconds / baseline:7.2f}x")
    what = f"{name} {args.dtype} ({size / 2**20:.0f} MiB)"
    for kind in ("save", "load"):
        ours = statistics.median(times[f"femtotron {kind}"])
        raw_seconds = statistics.median(times[f"baseline {kind}"])
        headline(
            f"checkpoint {kind}, {what}: seconds, femtotron / one safetensors file", ours, raw_seconds, ".3f"
        )
    stall = statistics.median(times["async stall"])
    synchronous = statistics.median(times["femtotron save"])
    headline(
        f"async checkpoint, {what}: seconds training stops, async / synchronous save",
        stall,
        synchronous,
        ".3f",
    )
    normal, overlapped, write = step_times(trainer, background, args.steps)
    synchronous = statistics.median(times["femtotron save"])
    print(
        f"  steps alone {normal:.3f} s, during a background write {overlapped:.3f} s; the write took "
        f"{write:.3f} s while training ({synchronous:.3f} s for a synchronous save)"
    )
    headline(
        f"steps during an async checkpoint write, {what}: seconds, overlapped / alone",
        overlapped,
        normal,
        ".3f",
    )


def step_times(trainer, background: BackgroundSaves, steps: int) -> tuple[float, float, float]:
    """Median seconds of `steps` training steps alone, of the steps taken while background writes run (a
    write is started again whenever one finishes, until `steps` steps overlapped one), and of those writes."""
    alone = [timed(trainer.train_step) for _ in range(steps)]
    overlapped = []
    writes = []
    while len(overlapped) < steps:
        trainer.state.step += 1
        background.start(trainer.parts)
        while background.thread.is_alive() and len(overlapped) < steps:
            seconds = timed(trainer.train_step)
            if background.thread.is_alive():  # the write ran through the whole step
                overlapped.append(seconds)
        writes.append(background.wait().write_seconds)
    return statistics.median(alone), statistics.median(overlapped), statistics.median(writes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="wide,large", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps timed alone and during writes")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the files go (default: a temporary one)"
    )
    args = parser.parse_args()
    for name in args.shape.split(","):
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            measure_shape(name, args, Path(tmp))


if __name__ == "__main__":
    main()
