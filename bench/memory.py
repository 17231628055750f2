"""Memory: ZeRO's bytes per parameter against its formula (ZeRO-1 2 + 4 + 12/dp, ZeRO-2 2 + (4 + 12)/dp,
ZeRO-3 (2 + 4 + 12)/dp), and `femtotron doctor`'s estimate against the measured peak of a step, in several
layouts, on CPU processes (gloo).

The debug model's shape with 4 layers (hidden 256, vocabulary 2048), micro-batches of 4 x 128 tokens, two
per step. For each layout every rank builds femtotron's Trainer, takes one step (Adam's moments exist from
then on), then a second under `LiveMemory` (every storage tensor ops allocate, and their peak):

    held      the model state the rank holds: parameters, gradient buffers, master weights, Adam moments
              (`DataParallel.model_state_bytes()`, padding included)
    measured  held + the second step's peak of storage allocated (+ under ZeRO-3 the peak of gathered
              parameters, which LiveMemory does not see: their storage is resized in place, not allocated;
              the two peaks are added, so this is at most what was alive at once)
    estimate  `estimate_rank` (what `femtotron doctor` prints), simulated on the meta device for this CPU

It prints, per layout, held bytes per parameter against the formula (bf16 weights 2, fp32 gradients 4, master
weights and both moments 12 bytes, divided over dp by ZeRO-1) and the estimate over the measured peak (worst
rank). Each rank's ratios are measured in the same run.

    python bench/memory.py [--layouts all|one,zero1-dp2,...] [--timeout 300]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import DEBUG_SHAPE, headline, shape_config, spawn_ranks, write_random_tokens

from femtotron.diagnostics.memory import LiveMemory, estimate_rank
from femtotron.trainer import Trainer

SHAPE = {**DEBUG_SHAPE, "num_hidden_layers": 4, "num_key_value_heads": 4, "micro_batch_size": 4}
# name: (ParallelContext layout, config overrides)
LAYOUTS = {
    "one": ({}, {}),
    "zero1-dp2": ({"dp": 2}, {"parallelism": {"dp": 2}, "optimizer": {"zero_stage": 1}}),
    "zero1-dp4": ({"dp": 4}, {"parallelism": {"dp": 4}, "optimizer": {"zero_stage": 1}}),
    "zero2-dp2": ({"dp": 2}, {"parallelism": {"dp": 2}, "optimizer": {"zero_stage": 2}}),
    "zero3-dp2": ({"dp": 2}, {"parallelism": {"dp": 2}, "optimizer": {"zero_stage": 3}}),
    "zero3-dp4": ({"dp": 4}, {"parallelism": {"dp": 4}, "optimizer": {"zero_stage": 3}}),
    "tp2-sp": ({"tp": 2}, {"parallelism": {"tp": 2, "tp_mode": "REDUCE_SCATTER"}}),
    "pp2-1f1b": ({"pp": 2}, {"parallelism": {"pp": 2}}),
}


def layout_config(name: str, data: Path, runs: Path):
    tokens = {"batch_accumulation_per_replica": 2}
    return shape_config(SHAPE, "bfloat16", data, runs, f"memory-{name}", tokens=tokens, **LAYOUTS[name][1])


def memory_rank(ctx, cases, args, report) -> None:
    for index, name in enumerate(cases):
        config = layout_config(name, Path(args.data), Path(args.runs))
        trainer = Trainer(config, ctx, log_to_console=False)
        trainer.train_step()
        with LiveMemory() as live:
            trainer.train_step()
        plan = trainer.data_parallel.state.model_state_bytes()
        params = sum(p.numel() for _, p in trainer.model.named_parameters())
        estimate = estimate_rank(config, ctx.pp_rank, on_this_cpu=True).total
        gathering = trainer.model.gathering
        gathered = 2 * gathering.peak_whole_elements if gathering else 0  # bf16
        report(index, (sum(plan.values()), sum(plan.values()) + live.peak + gathered, estimate, params))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default="all", help=f"all, or some of {', '.join(LAYOUTS)}")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for any layout")
    args = parser.parse_args()
    names = list(LAYOUTS) if args.layouts == "all" else args.layouts.split(",")
    print(
        "debug shape with 4 layers, bf16, micro-batches of 4 x 128 tokens, 2 per step; held = parameters, "
        "gradients, master weights and moments of the rank"
    )
    columns = ("held B/param", 14), ("formula", 9), ("ratio", 8), ("measured MiB", 14), ("estimate", 10)
    print(f"{'layout':<12}" + "".join(f"{name:>{width}}" for name, width in columns) + f"{'ratio':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        args.data, args.runs = str(Path(tmp) / "tokens"), str(Path(tmp) / "runs")
        write_random_tokens(Path(args.data), SHAPE["vocab_size"], 200_000)
        for name in names:

            def on_case(case, per_rank, name=name) -> None:
                dp = LAYOUTS[name][0].get("dp", 1)
                zero = LAYOUTS[name][1].get("optimizer", {}).get("zero_stage", 0)
                formula = {0: 2 + 4 + 12, 1: 2 + 4 + 12 / dp, 2: 2 + (4 + 12) / dp, 3: (2 + 4 + 12) / dp}[
                    zero
                ]
                per_param = max(held / params for held, _, _, params in per_rank)
                measured, estimate = max((m, e) for _, m, e, _ in per_rank)
                print(
                    f"{name:<12}{per_param:>14.2f}{formula:>9.2f}{per_param / formula:>7.3f}x"
                    f"{measured / 2**20:>14.1f}{estimate / 2**20:>10.1f}{estimate / measured:>7.3f}x",
                    flush=True,
                )
                if zero:
                    shown = {1: "2 + 4 + 12/dp", 2: "2 + (4 + 12)/dp", 3: "(2 + 4 + 12)/dp"}[zero]
                    headline(
                        f"ZeRO-{zero} model state per parameter, dp={dp} bf16: bytes held / {shown}",
                        per_param,
                        formula,
                        number_format=".2f",
                    )
                headline(
                    f"doctor's memory estimate / measured peak, {name} bf16 (worst rank, MiB)",
                    estimate / 2**20,
                    measured / 2**20,
                )

            spawn_ranks(LAYOUTS[name][0] or {"dp": 1}, memory_rank, [name], args, on_case)


if __name__ == "__main__":
    main()
