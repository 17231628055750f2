"""`femtotron plot RUN_DIR [RUN_DIR ...]`: the curves of metrics.jsonl as PNGs, one per quantity, several runs
overlaid (matplotlib, the `plot` extra)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from femtotron.errors import FemtotronError, PathError

# file name -> (y-axis label, the record keys drawn, one line each, or a string: every key containing it).
CHARTS = {
    "loss": ("loss", ["loss", "val_loss"]),
    "lr": ("learning rate", ["lr"]),
    "grad_norm": ("gradient norm (before clipping)", ["grad_norm"]),
    "tokens_per_sec": ("tokens / s (all ranks)", ["tokens_per_sec"]),
    "mfu": ("model FLOPs utilization", ["mfu"]),
    "memory": ("GiB", "mem_"),
    # a mixture of experts: per layer, how unevenly its experts are loaded; the router losses
    "expert_load": ("tokens per expert: coefficient of variation (0 = balanced)", "/load_cv"),
    "router_losses": ("router losses (balance: 1 = balanced)", ["moe/aux_loss", "moe/z_loss"]),
}


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PathError(
            f"{path} does not exist: give run directories (logging.output_dir/general.run, e.g. runs/debug) "
            "of runs that have logged a step"
        )
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # the last line of a run killed while writing it
            continue
    return records


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def plot_runs(run_dirs: list[Path], out_dir: Path) -> list[Path]:
    """One PNG per chart with data, every run's lines on it; returns the files written."""
    runs = {str(run_dir): read_records(run_dir) for run_dir in run_dirs}  # a wrong path first: it is cheap
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise FemtotronError(
            "femtotron plot needs matplotlib: `pip install femtotron[plot]` (or `pip install matplotlib`)"
        ) from None
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (ylabel, keys) in CHARTS.items():
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for i, (label, records) in enumerate(runs.items()):
            every = isinstance(keys, str)
            drawn = sorted({k for r in records for k in r if keys in k}) if every else keys
            for j, key in enumerate(drawn):
                steps, values = series(records, key)
                style = "-" if j == 0 or every else "--"  # validation loss: dashed, same colour
                color = f"C{(i * len(drawn) + j) % 10}" if every else f"C{i}"
                if steps:
                    ax.plot(
                        steps,
                        values,
                        style,
                        color=color,
                        marker="." if len(steps) < 50 else None,
                        label=f"{label} {key}" if len(drawn) > 1 else label,
                    )
        if ax.lines:
            ax.set(xlabel="step", ylabel=ylabel, title=f"{ylabel} against step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
            fig.tight_layout()
            fig.savefig(out_dir / f"{name}.png", dpi=120)
            written.append(out_dir / f"{name}.png")
        plt.close(fig)
    if not written:
        raise PathError(f"no step records to plot in the metrics.jsonl of {', '.join(runs)}")
    return written
