"""`make size`: how big the code is, measured so that line breaks and docstrings do not change it.

The measure is syntax-tree nodes: every node of a module's tree except its docstrings and the load/store
markers Python attaches to each name (they count names twice). Joining two lines, splitting a call over
five, or writing a longer docstring leaves it unchanged; adding a branch, an argument or a helper shows. The
line cap that came before it was met by pressing code into fewer, wider lines, which made it harder to read.

The training path is every femtotron module the `femtotron` command can import: cli.py, everything it
imports (the train verb's and the other verbs', since one module holds them all; lazy imports inside
functions included, imports for type checking only not, since no run executes them) and everything those
import in turn. That is the whole package but `python -m femtotron`'s entry and what only tests and bench
scripts import. Its size is reported per room (a package directory, or the top-level modules together),
with code lines beside the nodes and the count of packed tuple assignments per 1,000 code lines (see
`packed_assignments`).

    python bench/size.py [--src src] [--longest 10] [--all]

--all reports every module, not only the training path; --longest lists the largest functions by nodes.
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The size the training path may have, in nodes. A feature issue declares in its note what it adds
# (measured before and after with this script) and raises this by that much; a review reads the change.
TRAINING_PATH_BUDGET = 90_300


@dataclass(frozen=True)
class ModuleSize:
    name: str
    room: str
    nodes: int
    code_lines: int
    packed: int


def module_name(path: Path, src: Path) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, src: Path) -> bool:
    path = src.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported_modules(tree: ast.AST, src: Path, *, type_only_too: bool) -> list[str]:
    """Every femtotron or outside module the tree imports, lazy ones inside functions included; `from a import
    b` is a.b when b is a module. `if TYPE_CHECKING:` blocks count only with type_only_too."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if is_type_checking_block(node) and not type_only_too:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                names.append(candidate if is_module(candidate, src) else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def import_graph(src: Path, *, type_only_too: bool) -> dict[str, set[str]]:
    """Module name to the names it imports, for every module of the femtotron package under src."""
    return {
        module_name(path, src): set(
            imported_modules(ast.parse(path.read_text()), src, type_only_too=type_only_too)
        )
        for path in sorted((src / "femtotron").rglob("*.py"))
    }


def with_parent_packages(name: str) -> list[str]:
    """Importing femtotron.a.b runs femtotron/__init__ and femtotron/a/__init__ first."""
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts) + 1)]


def training_path(src: Path) -> set[str]:
    """The modules the `femtotron` command can import: cli.py's imports and their closure."""
    graph = import_graph(src, type_only_too=False)
    reached: set[str] = set()
    waiting = ["femtotron.cli"]
    while waiting:
        name = waiting.pop()
        for module in with_parent_packages(name):
            if module in graph and module not in reached:
                reached.add(module)
                waiting.extend(other for other in graph[module] if other in graph)
    return reached


def without_docstrings(tree: ast.Module) -> ast.Module:
    """The tree with the docstring of the module and of every class and function taken out."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body = node.body
        first = body[0] if body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            if isinstance(first.value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def node_count(tree: ast.AST) -> int:
    return sum(1 for node in ast.walk(tree) if not isinstance(node, ast.expr_context))


def docstring_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def code_lines(text: str, tree: ast.Module) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    with_code: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            continue
        if token.type == tokenize.ENDMARKER:
            continue
        with_code.update(range(token.start[0], token.end[0] + 1))
    return len(with_code - docstring_lines(tree))


def is_swap(targets: ast.Tuple, values: ast.Tuple) -> bool:
    """`a, b = b, a`: the same names on both sides, only reordered."""
    return sorted(ast.unparse(t) for t in targets.elts) == sorted(ast.unparse(v) for v in values.elts)


def packed_assignments(tree: ast.AST) -> list[ast.Assign]:
    """Assignments binding a tuple of names to a tuple of separately computed values (`a, b = f(x), g(y)`),
    swaps excepted: each value deserves its own line and name. A chained `a, b = self.a, self.b = pair`
    packs too."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        tuples = [target for target in node.targets if isinstance(target, ast.Tuple | ast.List)]
        if not tuples:
            continue
        if len(node.targets) > 1:
            found.append(node)
        elif isinstance(node.value, ast.Tuple | ast.List) and not is_swap(tuples[0], node.value):
            found.append(node)
    return found


def dataclass_options(node: ast.ClassDef) -> dict[str, str] | None:
    """The keyword options of a class's @dataclass decorator (empty for a bare one), None if it has none."""
    for decorator in node.decorator_list:
        call = decorator if isinstance(decorator, ast.Call) else None
        name = ast.unparse(call.func if call else decorator)
        if name in ("dataclass", "dataclasses.dataclass"):
            return {keyword.arg: ast.unparse(keyword.value) for keyword in call.keywords} if call else {}
    return None


def dataclass_fields(node: ast.ClassDef) -> list[str]:
    return [
        ast.unparse(statement.target)
        for statement in node.body
        if isinstance(statement, ast.AnnAssign) and "ClassVar" not in ast.unparse(statement.annotation)
    ]


def style_problems(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, rule) for each place that reads worse than it needs to. A dataclass of more than 4 fields is
    built by keyword (kw_only=True), so two same-typed fields cannot be swapped silently; a NamedTuple of more
    than 4 fields is a kw_only dataclass instead, for the same reason. A conditional expression is not an
    element of a tuple (`a, b = x if c else y, z` binds the condition to half the tuple). A slice is not
    splatted into a call (`f(*q[:2], *k, *q[2:])` hides which value lands in which parameter). And
    a tuple is not packed (see packed_assignments), counted apart by the caller."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            options = dataclass_options(node)
            fields = dataclass_fields(node)
            named_tuple = any(ast.unparse(base).endswith("NamedTuple") for base in node.bases)
            if named_tuple and len(fields) > 4:
                found.append(
                    (node.lineno, f"NamedTuple {node.name} has {len(fields)} fields: a kw_only dataclass")
                )
            if options is not None and len(fields) > 4 and options.get("kw_only") != "True":
                found.append((node.lineno, f"dataclass {node.name} has {len(fields)} fields: kw_only=True"))
        elif isinstance(node, ast.Tuple) and any(isinstance(element, ast.IfExp) for element in node.elts):
            found.append((node.lineno, "a conditional expression inside a tuple: parenthesise or name it"))
        elif isinstance(node, ast.Call):
            for argument in node.args:
                value = argument.value if isinstance(argument, ast.Starred) else None
                if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Slice):
                    found.append((node.lineno, "a slice splatted into a call: pass each argument by name"))
    return sorted(found)


def measure(path: Path, src: Path) -> ModuleSize:
    text = path.read_text()
    tree = ast.parse(text)
    lines = code_lines(text, tree)
    packed = len(packed_assignments(tree))
    return ModuleSize(
        name=module_name(path, src),
        room=room_of(path, src),
        nodes=node_count(without_docstrings(tree)),
        code_lines=lines,
        packed=packed,
    )


def room_of(path: Path, src: Path) -> str:
    """The package directory a module lives in (`parallel/pipeline`), or `femtotron` for the top level."""
    return path.parent.relative_to(src).as_posix().removeprefix("femtotron/")


def sizes(src: Path, *, everything: bool = False) -> list[ModuleSize]:
    chosen = None if everything else training_path(src)
    measured = []
    for path in sorted((src / "femtotron").rglob("*.py")):
        if chosen is None or module_name(path, src) in chosen:
            measured.append(measure(path, src))
    return measured


def per_thousand(packed: int, lines: int) -> float:
    return 1000 * packed / max(lines, 1)


def longest_functions(src: Path, modules: set[str], count: int) -> list[tuple[int, str]]:
    """The largest functions and methods by nodes (docstrings out), each named module:qualified name."""
    found = []
    for path in sorted((src / "femtotron").rglob("*.py")):
        name = module_name(path, src)
        if name not in modules:
            continue
        tree = without_docstrings(ast.parse(path.read_text()))
        for parent in ast.walk(tree):
            for node in ast.iter_child_nodes(parent):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    owner = f"{parent.name}." if isinstance(parent, ast.ClassDef) else ""
                    found.append((node_count(node), f"{name}:{owner}{node.name}"))
    return sorted(found, reverse=True)[:count]


def report(measured: list[ModuleSize]) -> str:
    rooms: dict[str, list[ModuleSize]] = defaultdict(list)
    for size in measured:
        rooms[size.room].append(size)
    lines = [f"{'room':<22}{'modules':>8}{'nodes':>9}{'code lines':>12}{'packed/1k':>11}"]
    for room in sorted(rooms):
        members = rooms[room]
        nodes = sum(size.nodes for size in members)
        code = sum(size.code_lines for size in members)
        packed = sum(size.packed for size in members)
        lines.append(f"{room:<22}{len(members):>8}{nodes:>9}{code:>12}{per_thousand(packed, code):>11.1f}")
    nodes = sum(size.nodes for size in measured)
    code = sum(size.code_lines for size in measured)
    packed = sum(size.packed for size in measured)
    lines.append(f"{'total':<22}{len(measured):>8}{nodes:>9}{code:>12}{per_thousand(packed, code):>11.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", type=Path, default=ROOT / "src", help="the directory holding femtotron/")
    parser.add_argument("--longest", type=int, default=10, help="list this many largest functions")
    parser.add_argument("--all", action="store_true", help="every module, not only the training path")
    parser.add_argument("--style", action="store_true", help="list style problems and packed assignments")
    args = parser.parse_args(argv)
    if args.style:
        for path in sorted((args.src / "femtotron").rglob("*.py")):
            tree = ast.parse(path.read_text())
            where = path.relative_to(args.src)
            for line, rule in style_problems(tree):
                print(f"{where}:{line}: {rule}")
            for node in packed_assignments(tree):
                print(f"{where}:{node.lineno}: packed: {ast.unparse(node)[:90]}")
        return
    measured = sizes(args.src, everything=args.all)
    what = "every femtotron module" if args.all else "the training path (what the femtotron command imports)"
    print(f"{what}: syntax-tree nodes without docstrings, per room\n")
    print(report(measured))
    if args.longest:
        print(f"\nthe {args.longest} largest functions (nodes):")
        for nodes, name in longest_functions(args.src, {size.name for size in measured}, args.longest):
            print(f"{nodes:>7}  {name}")
    nodes = sum(size.nodes for size in measured)
    if not args.all:
        from common import headline

        print(f"\nbudget {TRAINING_PATH_BUDGET} nodes: {nodes / TRAINING_PATH_BUDGET:.0%} used")
        headline(
            "training path size (syntax-tree nodes) / its budget (bench/size.py)",
            nodes,
            TRAINING_PATH_BUDGET,
            number_format=",d",
        )


if __name__ == "__main__":
    main()
