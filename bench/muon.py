"""Muon against AdamW on the CPU debug model: the loss each reaches in N steps at its best learning rate (a
small sweep), and Muon's step time over AdamW's.

The model, data and schedule of examples/debug.yaml (2 layers, hidden 256, the bundled Shakespeare tokens,
micro-batches of 16 x 128 tokens, warm-up 20 steps then cosine to a tenth of the peak), --steps steps from
the same initial weights and the same batches, one process, fp32. For each optimizer and each peak
learning rate of --lrs: the mean training loss of the last 20 steps (each step reads new samples, so it is
the loss on text the model has not seen yet), and the median step time. Muon steps the decoder layers'
matrices and AdamW the rest, at the same peak learning rate (optim/muon.py scales Muon's update to AdamW's
RMS, so one rate serves both: Liu et al. 2025).

    python bench/muon.py [--steps 200] [--lrs 5e-4,1e-3,2e-3,4e-3,8e-3,1.6e-2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import headline

from femtotron.config import load_config
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TAIL = 20  # steps averaged for the final loss


def run(optimizer: str, lr: float, steps: int, runs: Path) -> tuple[float, float]:
    """The mean loss of the last TAIL steps and the median step time (seconds)."""
    config = load_config(
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
        ],
    )
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
    args = parser.parse_args()
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
