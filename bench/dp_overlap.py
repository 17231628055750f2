"""Data parallelism: step time and exposed dp communication, buckets overlapped with backward vs one
reduction after it, for zero_stage 0 and 1.

Two ranks (dp=2, one thread each: they fit 2 cores) train the debug model's shape at fp32 through
femtotron's Trainer. Cases:

    one bucket   dp_bucket_size_mb=100000: a rank's whole gradient buffer is one bucket, so its
                 reduction starts when the last gradient of the step exists (no overlap); the baseline
    buckets      dp_bucket_size_mb=--bucket-mb: buckets start reducing while backward still runs

For each, over --steps steps after one warm-up step: the median step time (slower rank), and the dp
share: seconds blocked in dp collectives (launching them and waiting for them, from
Comm.take_seconds) over the step time. Overlap shows as a smaller dp share. Each case's step time is
printed as a ratio to the baseline, measured in the same run.

    python bench/dp_overlap.py [--steps 6] [--bucket-mb 1] [--layers 4] [--micro-batches 2]

On gloo the reduction runs on CPU threads that compete with backward's compute, so the gain here is
a lower bound of what NCCL (separate streams and copy engines) gives on GPUs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import DEBUG_SHAPE, headline, shape_config, spawn_ranks, write_random_tokens

from femtotron.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
SHAPE = {**DEBUG_SHAPE, "micro_batch_size": 4}  # num_hidden_layers: --layers


def make_config(case: dict, args, data: Path, runs: Path):
    return shape_config(
        {**SHAPE, "num_hidden_layers": args.layers},
        "float32",
        data,
        runs,
        f"dp-{case['name']}",
        parallelism={"dp": 2, "dp_bucket_size_mb": case["bucket_mb"]},
        optimizer={"zero_stage": case["zero"]},
        tokens={"batch_accumulation_per_replica": args.micro_batches},
    )


def dp_rank(ctx, cases, args, report) -> None:
    for index, case in enumerate(cases):
        trainer = Trainer(
            make_config(case, args, Path(args.data), Path(args.runs)), ctx, log_to_console=False
        )
        trainer.train_step()  # warm-up
        steps = []
        for _ in range(args.steps):
            result = trainer.train_step()
            steps.append((result.seconds, result.comm_seconds.get("dp", 0.0)))
        report(index, (steps, len(trainer.data_parallel.layout.buckets)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    cases = [
        {"name": f"{kind}-zero{zero}", "bucket_mb": bucket, "zero": zero}
        for zero in (0, 1)
        for kind, bucket in (("one-bucket", 100000.0), ("buckets", args.bucket_mb))
    ]
    with tempfile.TemporaryDirectory() as tmp:
        args.data, args.runs = str(Path(tmp) / "tokens"), str(Path(tmp) / "runs")
        write_random_tokens(Path(args.data), SHAPE["vocab_size"], 400_000)
        rows = []

        def on_case(case, per_rank) -> None:
            step_times = [max(rank[0][i][0] for rank in per_rank) for i in range(args.steps)]
            shares = [
                statistics.fmean(rank[0][i][1] / rank[0][i][0] for rank in per_rank)
                for i in range(args.steps)
            ]
            rows.append((case, per_rank[0][1], statistics.median(step_times), statistics.median(shares)))

        spawn_ranks({"dp": 2}, dp_rank, cases, args, on_case)
    print(
        f"dp=2, {args.layers} layers of the debug shape, fp32, {args.micro_batches} micro-batches of "
        f"{SHAPE['micro_batch_size']} x {SHAPE['sequence_length']} tokens; medians over {args.steps} steps"
    )
    print(f"{'case':<22}{'buckets':>8}{'step ms':>10}{'dp share':>10}{'vs one bucket':>15}")
    baseline = {
        case["zero"]: seconds for case, _, seconds, _ in rows if case["name"].startswith("one-bucket")
    }
    for case, buckets, seconds, share in rows:
        ratio = seconds / baseline[case["zero"]]
        print(f"{case['name']:<22}{buckets:>8}{seconds * 1e3:>10.1f}{share:>10.1%}{ratio:>14.2f}x")
        if case["name"].startswith("buckets"):
            headline(
                f"dp=2 step time (ms, median), zero_stage {case['zero']}: {buckets} buckets / one bucket",
                seconds * 1e3,
                baseline[case["zero"]] * 1e3,
            )


if __name__ == "__main__":
    main()
