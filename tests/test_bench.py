"""bench/run_all.py (`make bench`): the scripts' headline figures collected into the table of
docs/benchmarks.md, between its markers, the rest of the file untouched."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import run_all  # noqa: E402
from common import HEADLINE, headline, median_pair  # noqa: E402


def test_the_table_replaces_the_last_one_and_nothing_else(tmp_path):
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\nintro\n\n## Other\n\ntext\n")
    run_all.write_table(out, f"{run_all.BEGIN}\nfirst\n{run_all.END}")
    assert out.read_text() == (
        f"# Benchmarks\n\n## The latest `make bench`\n\n{run_all.BEGIN}\nfirst\n{run_all.END}\n"
        "\nintro\n\n## Other\n\ntext\n"
    )
    run_all.write_table(out, f"{run_all.BEGIN}\nsecond\n{run_all.END}")
    assert "first" not in out.read_text() and out.read_text().count(run_all.BEGIN) == 1
    assert out.read_text().endswith(f"{run_all.END}\n\nintro\n\n## Other\n\ntext\n")


def test_a_row_s_ratio_is_made_of_the_figures_it_shows(capsys):
    """Rounds measured in turn are paired: the row shows the round whose ratio is the median, so its two
    figures give its ratio (medians taken apart once showed 5,067 against 14,344 beside "1.04x")."""
    ours = [5067.0, 9000.0, 14000.0]
    theirs = [4900.0, 14344.0, 13000.0]
    assert median_pair(ours, theirs) == (5067.0, 4900.0)  # ratios 0.63, 1.03, 1.08
    assert median_pair([1.0, 2.0], [1.0, 1.0]) == (1.0, 1.0)  # even counts: the lower middle
    headline("tokens/s", *median_pair(ours, theirs), number_format=",.0f")
    row = json.loads(capsys.readouterr().out.removeprefix(HEADLINE))
    assert (row["ours"], row["baseline"]) == ("5,067", "4,900")
    assert row["ratio"] == pytest.approx(5067 / 4900)


def test_make_bench_writes_outside_the_tracked_tree_and_only_a_full_run_into_the_docs(capsys):
    written = run_all.DEFAULT_OUT.relative_to(run_all.ROOT).as_posix()
    assert written.startswith("runs/") and "runs/" in (run_all.ROOT / ".gitignore").read_text().splitlines()
    with pytest.raises(SystemExit):
        run_all.main(["--quick", "--docs"])
    assert "a quick run's few repeats are noise" in capsys.readouterr().err


def test_an_unknown_script_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit):
        run_all.main(["--only", "throughput,nope"])
    assert "--only: unknown nope; choose from throughput, generate, pp_bubble" in capsys.readouterr().err


@pytest.mark.distributed  # the script runs as a process of its own
def test_a_script_runs_and_its_headline_figures_become_rows(tmp_path):
    out = tmp_path / "benchmarks.md"
    run_all.main(["--quick", "--only", "checkpoint_io", "--out", str(out)])
    text = out.read_text()
    assert "`make bench BENCH_ARGS=--quick` on " in text and "(bf16 matmul units " in text
    rows = [line for line in text.splitlines() if line.startswith("| checkpoint ")]
    assert [row.split(",")[0] for row in rows] == ["| checkpoint save", "| checkpoint load"]
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert float(cells[1]) > 0 and float(cells[2]) > 0 and cells[3].endswith("x")
        assert cells[4] == "`python bench/checkpoint_io.py --shape=debug --repeats=2`"
