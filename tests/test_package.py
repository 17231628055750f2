"""D4/D5: the code stays small and laid out as the guide's rooms, so reading it is how one debugs."""

from pathlib import Path

import femtotron

SOURCE = Path(femtotron.__file__).parent


def test_D5_the_package_maps_onto_the_guides_rooms():
    for room in ("trainer.py", "parallel/context.py", "parallel/comm.py", "parallel/tensor_parallel.py",
                 "parallel/pipeline/schedules.py", "parallel/data_parallel.py", "models/llama.py", "optim/zero.py",
                 "config/config.py", "serialize/checkpoint.py"):
        assert (SOURCE / room).is_file(), room


def test_D4_the_core_stays_small_enough_to_read():
    """Everything but diagnostics and the command line: code lines (not blank, not comments) near 5,000."""
    lines = 0
    for path in SOURCE.rglob("*.py"):
        if "diagnostics" in path.parts or path.name == "cli.py":
            continue
        lines += sum(1 for line in path.read_text().splitlines() if line.strip() and not line.strip().startswith("#"))
    assert lines < 5500, lines


def test_every_failure_mode_has_a_test_named_after_it():
    """docs/errors.md lists the guide's failure modes (L1 ... D5); each has a test whose name starts with its id."""
    root = Path(__file__).parent
    rows = {line.split("|")[1].strip() for line in (root.parent / "docs" / "errors.md").read_text().splitlines()
            if line.startswith("| ") and line.split("|")[1].strip()[:1] in "LMNTPCD"
            and line.split("|")[1].strip()[1:].isdigit()}
    tests = "\n".join(path.read_text() for path in root.rglob("test_*.py"))
    assert len(rows) == 25
    assert sorted(row for row in rows if f"def test_{row}_" not in tests) == []
