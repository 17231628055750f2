"""D4/D5: the code stays small and legible and laid out as the guide's rooms, so reading it is how one debugs;
and its imports run one way: no cycles (imports for type checking included: a circle of types is a circle
of concepts), nothing but the command line imports the trainer, and only the door modules touch
torch.distributed. Imports are read from the source (ast), so lazy imports inside functions count too.

Size is syntax-tree nodes over the modules `femtotron train` imports (bench/size.py, `make size`), which line
breaks and docstrings do not change: a cap on lines was met by cramming, and made the code worse.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import size  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "femtotron"
# The only modules that may call torch.distributed: collectives, process groups, store messages, the launcher.
DISTRIBUTED_DOORS = {
    "femtotron.parallel.comm",
    "femtotron.parallel.context",
    "femtotron.store",
    "femtotron.launch",
}


def import_graph(*, type_only_too: bool = True) -> dict[str, set[str]]:
    return size.import_graph(SRC, type_only_too=type_only_too)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a cycle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in graph:
                continue
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_the_package_has_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def folder_of(module: str) -> str:
    """The package directory holding a module (`femtotron.parallel.pipeline.p2p` -> `femtotron.parallel`),
    or the module itself at the top level: the units a reader sees in the tree."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else module


def test_folders_import_one_way():
    """A folder holds rooms of neighbouring tiers, so folders import one way too: no folder imports one that
    imports it back, directly or round a longer circle (parallel/ once held the tier-0 mesh that config/
    imports, while its tier-3 rooms import config/)."""
    folders: dict[str, set[str]] = {}
    for module, imports in import_graph().items():
        here = folder_of(module)
        folders.setdefault(here, set()).update(folder_of(i) for i in imports if folder_of(i) != here)
    assert cycles(folders) == []


def test_constructors_of_many_parameters_document_each_one():
    """A constructor of more than 6 parameters says what each is in an `Args:` block: at a call site of
    that many, the names alone do not tell a reader which is which."""
    undocumented = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or node.name not in ("__init__", "build"):
                continue
            names = [a.arg for a in (*node.args.args, *node.args.kwonlyargs) if a.arg not in ("self", "cls")]
            docstring = ast.get_docstring(node) or ""
            args = docstring.split("Args:")[1] if "Args:" in docstring else ""
            missing = [name for name in names if f"{name}:" not in args]
            if len(names) > 6 and missing:
                undocumented.append(f"{path.relative_to(SRC)}:{node.lineno} {missing}")
    assert undocumented == []


def test_only_the_command_line_imports_the_trainer():
    graph = import_graph(type_only_too=False)
    importers = {module for module, imports in graph.items() if "femtotron.trainer" in imports}
    assert importers <= {"femtotron.cli"}, importers


def test_only_the_door_modules_touch_torch_distributed():
    touching = {
        module
        for module, imports in import_graph(type_only_too=False).items()
        if any(name == "torch.distributed" or name.startswith("torch.distributed.") for name in imports)
    }
    assert touching <= DISTRIBUTED_DOORS, touching - DISTRIBUTED_DOORS


def test_D5_the_package_maps_onto_the_guides_rooms():
    for room in (
        "trainer.py",
        "parallel/context.py",
        "parallel/comm.py",
        "parallel/tensor_parallel.py",
        "parallel/pipeline/schedules.py",
        "parallel/data_parallel.py",
        "models/llama.py",
        "optim/zero.py",
        "config/config.py",
        "serialize/saving.py",
        "serialize/restore.py",
    ):
        assert (PACKAGE / room).is_file(), room


def test_D4_the_training_path_stays_within_its_node_budget():
    """Syntax-tree nodes without docstrings over every module `femtotron train` imports. The budget grows only
    by what an issue declares in its note, measured with `make size` before and after; docs/architecture.md
    ("Size and style") lists each raise and what it paid for."""
    nodes = sum(module.nodes for module in size.sizes(SRC))
    assert nodes <= size.TRAINING_PATH_BUDGET, (
        f"the training path has {nodes} syntax-tree nodes, over its budget of {size.TRAINING_PATH_BUDGET}: "
        "take out repetition or dead code, or raise bench/size.py TRAINING_PATH_BUDGET by what the feature "
        "costs and say why in the issue's note (`make size` reports it per room)"
    )


def test_the_training_path_is_what_the_command_imports():
    path = size.training_path(SRC)
    for module in ("femtotron.trainer", "femtotron.parallel.context", "femtotron.data.run_data"):
        assert module in path
    # the other verbs' modules too: one cli.py imports them all
    assert {"femtotron.diagnostics.doctor", "femtotron.serialize.manager"} <= path
    assert "femtotron.__main__" not in path  # `python -m femtotron` only


def test_tuples_are_not_packed_on_the_training_path():
    """At most 10 packed tuple assignments (`a, b = f(x), g(y)`) per 1,000 code lines: each value on its own
    line with its own name (picotron has ~10, nanoGPT ~7, torchtitan ~1)."""
    measured = size.sizes(SRC)
    packed = sum(module.packed for module in measured)
    lines = sum(module.code_lines for module in measured)
    assert size.per_thousand(packed, lines) <= 10, f"{packed} packed assignments in {lines} code lines"


def test_no_style_problem_in_the_package():
    """Dataclasses of more than 4 fields are kw_only, no conditional expression inside a tuple, no slice
    splatted into a call (bench/size.py style_problems says why for each)."""
    problems = [
        f"{path.relative_to(SRC)}:{line}: {rule}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, rule in size.style_problems(ast.parse(path.read_text()))
    ]
    assert problems == []


def test_the_style_checks_find_what_they_look_for():
    code = """
from dataclasses import dataclass

@dataclass
class Five:
    a: int
    b: int
    c: int
    d: int
    e: int

def f(q, k):
    x, y = 1 if q else 2, 3
    low, high = 0, len(q)
    q, k = k, q
    one, two = pair = (1, 2)
    return g(*q[:2], *k)
"""
    tree = ast.parse(code)
    rules = [rule for _, rule in size.style_problems(tree)]
    assert any("Five has 5 fields" in rule for rule in rules)
    assert any("conditional expression" in rule for rule in rules)
    assert any("slice splatted" in rule for rule in rules)
    packed = [ast.unparse(node) for node in size.packed_assignments(tree)]
    assert packed == ["x, y = (1 if q else 2, 3)", "low, high = (0, len(q))", "one, two = pair = (1, 2)"]


def test_node_counts_ignore_docstrings_and_line_breaks():
    one = "def f(a, b):\n    return g(a, b)\n"
    other = 'def f(a, b):\n    """Why f exists."""\n    return g(\n        a,\n        b,\n    )\n'
    count = [size.node_count(size.without_docstrings(ast.parse(text))) for text in (one, other)]
    assert count[0] == count[1]


def test_every_failure_mode_has_a_test_named_after_it():
    """docs/errors.md lists the guide's failure modes (L1 ... D5); each has a test whose name starts with its
    id."""
    root = Path(__file__).parent
    rows = {
        line.split("|")[1].strip()
        for line in (root.parent / "docs" / "errors.md").read_text().splitlines()
        if line.startswith("| ")
        and line.split("|")[1].strip()[:1] in "LMNTPCD"
        and line.split("|")[1].strip()[1:].isdigit()
    }
    tests = "\n".join(path.read_text() for path in root.rglob("test_*.py"))
    assert len(rows) == 25
    assert sorted(row for row in rows if f"def test_{row}_" not in tests) == []


@pytest.mark.distributed
def test_the_code_is_formatted_and_lint_clean():
    """`ruff format` at the declared 110 columns and `ruff check` (E501 too) hold for src, tests, bench."""
    root, ruff = Path(__file__).resolve().parents[1], Path(sys.executable).parent / "ruff"
    for command in (["format", "--check"], ["check"]):
        result = subprocess.run(
            [str(ruff), *command, "src", "tests", "bench"], cwd=root, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout + result.stderr


# Package markers holding only rooms: femtotron/__init__.py (the version) and parallel/__init__.py (empty).
PACKAGE_MARKERS = {"femtotron", "femtotron.parallel"}


def documented_tiers() -> dict[str, int]:
    """docs/architecture.md's room table: each room (a module or a package directory) and its tier."""
    text = (SRC.parent / "docs" / "architecture.md").read_text()
    table = text.split("<!-- rooms")[1].split("<!-- /rooms -->")[0]
    tiers = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        if len(cells) > 2 and cells[1].isdigit():
            for room in cells[2].split(","):
                tiers[room.strip().strip("`").removesuffix("/")] = int(cells[1])
    return tiers


def room_of(module: str, tiers: dict[str, int]) -> str | None:
    """The most specific documented room holding the module (parallel/pipeline before parallel)."""
    path = module.removeprefix("femtotron").lstrip(".").replace(".", "/")
    for room in sorted(tiers, key=len, reverse=True):
        if path == room.removesuffix(".py") or path.startswith(room + "/"):
            return room
    return None


def test_the_architecture_rooms_exist_and_hold_every_module():
    tiers = documented_tiers()
    assert len(tiers) > 20
    for room in tiers:
        assert (PACKAGE / room).exists(), f"docs/architecture.md names {room}, which is not in src/femtotron"
    unplaced = [
        module
        for module in import_graph()
        if module not in PACKAGE_MARKERS and room_of(module, tiers) is None
    ]
    assert unplaced == [], f"modules in no room of docs/architecture.md: {unplaced}"


def test_rooms_import_only_their_own_tier_or_lower():
    tiers = documented_tiers()
    upward = []
    for module, imports in import_graph().items():
        if module in PACKAGE_MARKERS:
            continue
        here = tiers[room_of(module, tiers)]
        for imported in imports:
            if imported.startswith("femtotron.") and room_of(imported, tiers) is not None:
                if tiers[room_of(imported, tiers)] > here:
                    upward.append(f"{module} (tier {here}) imports {imported}")
    assert upward == []
