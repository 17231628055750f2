"""Muon against AdamW on the CPU debug model: the loss each reaches in N steps at its best learning rate (a
small sweep), and Muon's step time over AdamW's; with --dp, Newton-Schulz once per matrix (an owner each)
against on every replica holding a piece of it.

The model, data and schedule of examples/debug.yaml (2 layers, hidden 256, the bundled Shakespeare tokens,
micro-batches of 16 x 128 tokens, warm-up 20 steps then cosine to a tenth of the peak), --steps steps from
the same initial weights and the same batches, one process, fp32. For each optimizer and each peak
learning rate of --lrs: the mean training loss of the last 20 steps (each step reads new samples, so it is
the loss on text the model has not seen yet), and the median step time. Muon steps the decoder layers'
matrices and AdamW the rest, at the same peak learning rate (optim/muon.py scales Muon's update to AdamW's
RMS, so one rate serves both: Liu et al. 2025).

    python bench/muon.py [--steps 200] [--lrs 5e-4,1e-3,2e-3,4e-3,8e-3,1.6e-2]

With --dp (comma-separated sizes): the same model and data over dp ranks (gloo, one thread each), ZeRO-1 and
without ZeRO, with buckets smaller than a matrix (--bucket-mb: every matrix gathered whole on every replica,
as an 8B model's at the default 25 MB) and at the default 25 MB (the debug model's 8 matrices in one bucket,
most of them within one rank's shard). The ranks alternate, step by step, between optim/muon.py as it is
(an owner per matrix computes it, a reduce-scatter returns the updates; without ZeRO an all-reduce) and the
redundant way it replaced (every replica holding a piece of a matrix computes all of it, nothing sent
back; its gather one bucket ahead), from the same state: --steps timed steps of each after a warm-up. Per
case: the median time of Muon's step and of the whole training step (slowest rank), owners over redundant.
Both compute the same bits (tests/optim/test_muon.py). On 2 cores dp ranks share the cores, so the
figure is Newton-Schulz's total work more than its spread over GPUs.

    python bench/muon.py --dp 2,4 [--steps 8] [--bucket-mb 0.05]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import headline, median_pair, spawn_ranks

from femtotron.config import load_config
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TAIL = 20  # steps averaged for the final loss


def redundant(muon) -> tuple[set[int], set[int], int]:
    """Muon's computed matrices, exchanged buckets and depth as before owners: every replica holding a piece
    of a matrix computes it (its tp peers hold the same pieces), no bucket exchanged, one gathered ahead."""
    return {muon.layout.pieces[i].param for i in muon.piece_indices}, set(), 1


def owners_rank(ctx, cases, args, report) -> None:
    """Each case: Muon's step and the whole step timed, alternating owners and redundant, per step."""
    for index, (zero, bucket_mb) in enumerate(cases):
        config = debug_config(
            "muon",
            1e-3,
            steps=args.steps * 2 + 1,
            runs=Path(args.runs),
            extra=[f"parallelism.dp={ctx.dp}", f"optimizer.zero_stage={zero}"]
            + [f"parallelism.dp_bucket_size_mb={bucket_mb}", f"general.run=owners-{zero}-{bucket_mb}"],
        )
        trainer = Trainer(config, ctx, log_to_console=False)
        muon = trainer.optimizer.muon
        variants = {"owners": (muon.computes, muon.exchanged, muon.ahead), "redundant": redundant(muon)}
        step = muon.step
        muon_seconds = []

        def timed(*args, step=step, muon_seconds=muon_seconds):
            start = time.perf_counter()
            step(*args)
            muon_seconds.append(time.perf_counter() - start)

        muon.step = timed
        trainer.train_step()  # warm-up
        times = {name: ([], []) for name in variants}
        for _ in range(args.steps):
            for name, (muon.computes, muon.exchanged, muon.ahead) in variants.items():
                times[name][0].append(trainer.train_step().seconds)
                times[name][1].append(muon_seconds[-1])
        report(index, times)


def compare_owners(args) -> None:
    cases = [(zero, bucket_mb) for zero in (1, 0) for bucket_mb in (args.bucket_mb, 25)]
    print(f"debug model, fp32, {args.steps} steps of each; median over steps, slowest rank (ms)")
    print(f"{'dp':>3}{'zero':>5}{'bucket MB':>10}{'muon: owners':>14}{'redundant':>10}{'ratio':>7}", end="")
    print(f"{'step: owners':>14}{'redundant':>10}{'ratio':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        args.runs = tmp
        for dp in [int(d) for d in args.dp.split(",")]:

            def on_case(case, per_rank, dp=dp) -> None:
                zero, bucket_mb = case
                pairs = []
                for part in (1, 0):  # Muon's step, the whole step
                    # the slowest rank, per step
                    owners, baseline = (
                        [max(r[name][part][s] for r in per_rank) for s in range(args.steps)]
                        for name in ("owners", "redundant")
                    )
                    pairs.append(median_pair(owners, baseline))
                row = "".join(f"{o * 1e3:>14.1f}{b * 1e3:>10.1f}{o / b:>7.2f}" for o, b in pairs)
                print(f"{dp:>3}{zero:>5}{bucket_mb:>10g}{row}")
                name = f"dp={dp} ZeRO-{zero} buckets {bucket_mb:g} MB"
                headline(
                    f"Muon's step, owner per matrix / redundant, {name} (ms)", *(x * 1e3 for x in pairs[0])
                )
                headline(
                    f"training step, owner per matrix / redundant, {name} (ms)", *(x * 1e3 for x in pairs[1])
                )

            spawn_ranks({"dp": dp}, owners_rank, cases, args, on_case)


def debug_config(optimizer: str, lr: float, steps: int, runs: Path, extra: list[str]):
    return load_config(
        ROOT / "examples" / "debug.yaml",
        overrides=[
            f"optimizer.optimizer_factory.name={optimizer}",
            f"optimizer.learning_rate_scheduler.learning_rate={lr}",
            f"optimizer.learning_rate_scheduler.min_decay_lr={lr / 10}",
            f"tokens.train_steps={steps}",
            f"general.run={optimizer}-{lr}",
            f"logging.output_dir={runs}",
            f"data.dataset_folder={ROOT / 'examples' / 'data' / 'shakespeare'}",
            f"tokenizer.tokenizer_name_or_path={ROOT / 'examples' / 'tokenizer.json'}",
            "checkpoints.save_final_state=false",
            *extra,
        ],
    )


def run(optimizer: str, lr: float, steps: int, runs: Path) -> tuple[float, float]:
    """The mean loss of the last TAIL steps and the median step time (seconds)."""
    config = debug_config(optimizer, lr, steps, runs, extra=[])
    ctx = ParallelContext()
    trainer = Trainer(config, ctx, log_to_console=False)
    results = [trainer.train_step() for _ in range(steps)]
    ctx.close()
    return statistics.mean(r.loss for r in results[-TAIL:]), statistics.median(r.seconds for r in results[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--lrs", default="5e-4,1e-3,2e-3,4e-3,8e-3,1.6e-2", help="peak learning rates to sweep"
    )
    parser.add_argument("--dp", help="dp sizes, comma-separated: owners against redundant Newton-Schulz")
    parser.add_argument(
        "--bucket-mb", type=float, default=0.05, help="with --dp: buckets smaller than a matrix"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="with --dp: seconds for any case")
    args = parser.parse_args()
    if args.dp:
        compare_owners(args)
        return
    lrs = [float(lr) for lr in args.lrs.split(",")]
    best = {}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"debug model, {args.steps} steps; loss: the mean of the last {TAIL} steps")
        print(f"{'lr':>8} {'adamW loss':>11} {'muon loss':>10} {'adamW s/step':>13} {'muon s/step':>12}")
        for lr in lrs:
            row = {name: run(name, lr, args.steps, Path(tmp)) for name in ("adamW", "muon")}
            for name, (loss, seconds) in row.items():
                if name not in best or loss < best[name][0]:
                    best[name] = (loss, seconds, lr)
            adam, muon = row["adamW"], row["muon"]
            print(f"{lr:8g} {adam[0]:11.3f} {muon[0]:10.3f} {adam[1]:13.3f} {muon[1]:12.3f}")
    adam, muon = best["adamW"], best["muon"]
    print(f"best: adamW {adam[0]:.3f} at lr {adam[2]:g}, muon {muon[0]:.3f} at lr {muon[2]:g}")
    headline(f"loss after {args.steps} steps at the best lr, muon / adamW", muon[0], adam[0], ".3f")
    headline("step time at the best lrs, muon / adamW (s)", muon[1], adam[1], ".3f")


if __name__ == "__main__":
    main()
