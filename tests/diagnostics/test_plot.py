"""`femtotron plot`: the curves of metrics.jsonl as PNGs, several runs overlaid."""

import json
import sys

import pytest

from femtotron.cli import main
from femtotron.diagnostics.plot import plot_runs

# Every test here reaches femtotron plot's import of matplotlib, which comes before it reads the records. Its
# first import runs fc-list: at collection, not in a test.
pytest.importorskip(
    "matplotlib.font_manager",
    reason="femtotron plot draws with matplotlib, which is not installed: `pip install femtotron[plot]`",
)
PNG = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir, loss_scale=1.0, **more):
    records = [
        {
            **more,
            "step": s,
            "loss": 5.0 * loss_scale / s,
            "lr": 1e-3,
            "grad_norm": 1.0 / s,
            "tokens_per_sec": 1000.0 + s,
            "mfu": 0.01 * s,
            "mem_rss_gib": 0.5 + s / 100,
        }
        for s in range(1, 11)
    ]
    records.insert(5, {"step": 5, "val_loss": 2.0})
    run_dir.mkdir(parents=True)
    # the last line of a run killed while writing it is skipped
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records) + '{"step": 11, "lo'
    )
    return run_dir


CHARTS = {"loss.png", "lr.png", "grad_norm.png", "tokens_per_sec.png", "mfu.png", "memory.png"}


def test_plot_writes_one_png_per_chart_and_overlays_runs(tmp_path):
    one = write_run(tmp_path / "runs" / "a")
    written = plot_runs([one], one / "plots")
    assert {p.name for p in written} == CHARTS
    assert all(p.read_bytes().startswith(PNG) for p in written)
    two = plot_runs([one, write_run(tmp_path / "runs" / "b", loss_scale=2.0)], tmp_path / "both")
    assert (tmp_path / "both" / "loss.png").read_bytes() != (one / "plots" / "loss.png").read_bytes()
    assert {p.name for p in two} == CHARTS


def test_a_mixture_of_experts_run_also_gets_its_expert_loads_and_router_losses(tmp_path):
    moe = {"moe/layer0/load_cv": 0.3, "moe/layer1/load_cv": 0.1, "moe/aux_loss": 1.1, "moe/z_loss": 2.0}
    written = plot_runs([write_run(tmp_path / "moe", **moe)], tmp_path / "plots")
    assert {p.name for p in written} == CHARTS | {"expert_load.png", "router_losses.png"}


def test_plot_from_the_command_line(tmp_path, capsys):
    run = write_run(tmp_path / "debug")
    assert main(["plot", str(run)]) == 0
    assert f"wrote 6 plots to {run / 'plots'}" in capsys.readouterr().out
    assert main(["plot", str(run), "--out", str(tmp_path / "elsewhere")]) == 0
    assert (tmp_path / "elsewhere" / "mfu.png").is_file()


def test_plot_errors_name_the_fix(tmp_path, capsys, monkeypatch):
    assert main(["plot", str(tmp_path / "nowhere")]) == 1
    assert f"{tmp_path / 'nowhere' / 'metrics.jsonl'} does not exist" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert main(["plot", str(write_run(tmp_path / "run"))]) == 1
    assert "`pip install femtotron[plot]`" in capsys.readouterr().err


@pytest.mark.parametrize("content", ["", '{"step": 1, "lo'])
def test_plot_of_a_run_without_records_says_so(tmp_path, capsys, content):
    (tmp_path / "metrics.jsonl").write_text(content)
    assert main(["plot", str(tmp_path)]) == 1
    assert "no step records to plot" in capsys.readouterr().err
