"""ZeRO stages on CPU processes (gloo): step time of ZeRO-2 and ZeRO-3 against ZeRO-1 at dp = 2 and 4, and the
share of ZeRO-3's all-gather time that prefetching hides.

The debug model's shape with 4 layers, bf16, micro-batches of 4 x 128 tokens, 2 per step. Each stage of a
layout trains in the same processes, in turn, for --steps steps after a warm-up step; a step's time is the
median over them (worst rank). ZeRO-3 runs twice: as it is, and with prefetching switched off (each unit's
gather starts when the unit needs it). Its exposed gather time is the time ranks spend waiting for
all-gathers to finish; the hidden share is 1 - exposed with prefetch / exposed without.

What a CPU can and cannot show: gloo's collectives run on the host's own cores, the ones the model computes
on (2 here for up to 4 ranks), so communication competes with compute instead of running beside it on a
network engine as NCCL's does; the ratios here are an upper bound of ZeRO-3's cost, not a GPU prediction.

    python bench/zero_stages.py [--dp 2,4] [--steps 4] [--timeout 600]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import DEBUG_SHAPE, headline, shape_config, spawn_ranks, write_random_tokens

from femtotron.trainer import Trainer

SHAPE = {**DEBUG_SHAPE, "num_hidden_layers": 4, "num_key_value_heads": 4, "micro_batch_size": 4}
# case: (zero stage, prefetch)
CASES = [(1, True), (2, True), (3, True), (3, False)]


def stage_rank(ctx, cases, args, report) -> None:
    for index, (zero, prefetch) in enumerate(cases):
        config = shape_config(
            SHAPE,
            "bfloat16",
            Path(args.data),
            Path(args.runs),
            f"zero{zero}-{prefetch}-dp{ctx.dp}",
            tokens={"batch_accumulation_per_replica": 2},
            parallelism={"dp": ctx.dp},
            optimizer={"zero_stage": zero},
        )
        trainer = Trainer(config, ctx, log_to_console=False)
        state = trainer.data_parallel.state
        waited = [0.0]
        if trainer.model.gathering is not None:
            if not prefetch:
                trainer.model.gathering.prefetch = lambda unit: None
            wait_gather = state.wait_gather

            def timed_wait(bucket, work, wait_gather=wait_gather, waited=waited):
                start = time.perf_counter()
                wait_gather(bucket, work)
                waited[0] += time.perf_counter() - start

            state.wait_gather = timed_wait
        trainer.train_step()  # warm-up: Adam's moments, first allocations
        waited[0] = 0.0
        seconds = [trainer.train_step().seconds for _ in range(args.steps)]
        report(index, (statistics.median(seconds), waited[0] / args.steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", default="2,4", help="dp sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per stage")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for any stage")
    args = parser.parse_args()
    print("debug shape with 4 layers, bf16, micro-batches of 4 x 128 tokens, 2 per step (worst rank)")
    print(f"{'dp':>3}{'stage':>7}{'prefetch':>10}{'step ms':>10}{'/ ZeRO-1':>10}{'gather wait ms':>16}")
    with tempfile.TemporaryDirectory() as tmp:
        args.data, args.runs = str(Path(tmp) / "tokens"), str(Path(tmp) / "runs")
        write_random_tokens(Path(args.data), SHAPE["vocab_size"], 200_000)
        for dp in [int(d) for d in args.dp.split(",")]:
            results = {}

            def on_case(case, per_rank, dp=dp, results=results) -> None:
                results[case] = (max(s for s, _ in per_rank), max(w for _, w in per_rank))

            spawn_ranks({"dp": dp}, stage_rank, CASES, args, on_case)
            baseline = results[1, True][0]
            for (zero, prefetch), (step, waited) in results.items():
                print(
                    f"{dp:>3}{zero:>7}{str(prefetch):>10}{step * 1e3:>10.1f}{step / baseline:>9.2f}x"
                    f"{waited * 1e3:>16.1f}"
                )
            for zero in (2, 3):
                headline(
                    f"step time ZeRO-{zero} / ZeRO-1, dp={dp} bf16 (ms)",
                    results[zero, True][0] * 1e3,
                    baseline * 1e3,
                )
            exposed = results[3, True][1]
            unhidden = results[3, False][1]
            headline(
                f"ZeRO-3 all-gather wait with prefetch / without, dp={dp} (ms per step; 1 - ratio is hidden)",
                exposed * 1e3,
                unhidden * 1e3,
            )


if __name__ == "__main__":
    main()
