"""bench/run_all.py (`make bench`): the scripts' headline figures collected into the table of
docs/benchmarks.md, between its markers, the rest of the file untouched."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import run_all  # noqa: E402


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
