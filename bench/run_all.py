"""`make bench`: every bench script, one table of their headline figures.

Each script runs as its own process (as a user would run it) and prints its headline figures as
`HEADLINE {json}` lines (common.headline): what was measured, femtotron's value, the baseline's measured in
the same run, and the ratio. This script collects them into the table between the markers
`<!-- make bench -->` and `<!-- /make bench -->` of runs/bench/benchmarks.md (not tracked: a run leaves
the checkout clean), with the date, the CPU (model and its bf16 flags), torch's version, the thread count
and each script's command, and prints it. `--docs` writes the table into docs/benchmarks.md instead, to
commit: only a full run, since --quick's few repeats are noise.

    python bench/run_all.py [--quick] [--only throughput,pp_bubble,...] [--docs | --out FILE]

--quick (1-2 minutes on 2 cores) runs each script on its smallest case with few repeats; the default
(full) runs their own defaults, about 5 minutes here.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from common import HEADLINE

from femtotron.atomic import atomic_path
from femtotron.metrics import processor_name
from femtotron.precision import CPU_ATTENDS_IN_BF16, cpu_has_bf16_matmul

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- make bench -->", "<!-- /make bench -->"
DEFAULT_OUT = ROOT / "runs" / "bench" / "benchmarks.md"  # runs/ is ignored by git
BF16 = "small:bf16" if cpu_has_bf16_matmul() else "small:fp32"
# script: (quick arguments, full arguments)
SCRIPTS = {
    "throughput": ([f"--cases={BF16}", "--pairs=3", "--steps=2"], []),
    "generate": (["--new-tokens=64", "--repeats=2"], []),
    "pp_bubble": (["--pp=2", "--micro-batches=1,4", "--steps=2", "--forward-ms=10"], []),
    "dp_overlap": (["--steps=3", "--layers=2"], []),
    "checkpoint_io": (["--shape=debug", "--repeats=2"], []),
    "preprocess": (["--megabytes=2", "--formats=jsonl,parquet"], []),
    "muon": (["--steps=20", "--lrs=1e-3"], ["--lrs=1e-3,8e-3"]),  # the full sweep: docs/benchmarks.md
    "muon_owners": (["--dp=2", "--steps=2"], ["--dp=2,4"]),
    "recompute_memory": (["--cases=debug", "--rounds=3"], []),
    "memory": (["--layouts=one,zero1-dp2,zero3-dp2"], []),
    "zero_stages": (["--dp=2", "--steps=2"], []),
    "torch_native_3d": (["--steps=3"], []),
    "context_parallel": (["--quick"], []),
    "moe": (["--quick"], []),
    "size": (["--longest=0"], ["--longest=0"]),
    "families": (
        ["--family=llama,qwen3,olmo2,mixtral", "--pairs=1", "--steps=1"],
        ["--family=all", "--pairs=3"],
    ),
}
# an entry that runs another entry's script with its own arguments
SCRIPT_OF = {"families": "throughput", "muon_owners": "muon"}


def run_script(name: str, arguments: list[str]) -> tuple[list[dict], str, float]:
    """Its headline figures, the command, and the seconds it took; a script that fails stops `make bench`
    with its output."""
    script = SCRIPT_OF.get(name, name)
    command = [sys.executable, str(ROOT / "bench" / f"{script}.py"), *arguments]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"bench/{name}.py failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    figures = [
        json.loads(line[len(HEADLINE) :]) for line in done.stdout.splitlines() if line.startswith(HEADLINE)
    ]
    return figures, shlex.join(["python", f"bench/{script}.py", *arguments]), seconds


def cpu_line() -> str:
    flags = ", ".join(
        f"{flag} {'yes' if present else 'no'}"
        for flag, present in (("bf16 matmul units", cpu_has_bf16_matmul()), ("AMX", CPU_ATTENDS_IN_BF16))
    )
    return f"{processor_name() or platform.processor() or 'unknown CPU'} ({flags})"


def table(results: list[tuple[str, list[dict], str, float]], quick: bool, seconds: float) -> str:
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        BEGIN,
        f"`make bench{' BENCH_ARGS=--quick' if quick else ''}` on {when}, {seconds:.0f} s: {cpu_line()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads available. Every ratio is femtotron "
        "over a baseline measured in the same run.",
        "",
        "| figure | femtotron | baseline | ratio | command |",
        "|---|---|---|---|---|",
    ]
    for _, figures, command, _ in results:
        for f in figures:
            lines.append(
                f"| {f['figure']} | {f['ours']} | {f['baseline']} | {f['ratio']:.2f}x | `{command}` |"
            )
    return "\n".join([*lines, END])


def write_table(path: Path, text: str) -> None:
    """Replace the table between the markers (or add it after the title)."""
    old = path.read_text() if path.is_file() else "# Benchmarks\n"
    if BEGIN in old:
        new = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: text, old, flags=re.S)
    else:
        title, _, rest = old.partition("\n")
        new = f"{title}\n\n## The latest `make bench`\n\n{text}\n{rest}"
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        Path(tmp).write_text(new)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the smallest case of each, few repeats")
    parser.add_argument("--only", default=",".join(SCRIPTS), help=f"scripts, from {', '.join(SCRIPTS)}")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=DEFAULT_OUT)
    where.add_argument("--docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only.split(",")) - set(SCRIPTS))
    if unknown:
        parser.error(f"--only: unknown {', '.join(unknown)}; choose from {', '.join(SCRIPTS)}")
    if args.docs and args.quick:
        parser.error("--docs with --quick: a quick run's few repeats are noise; docs take a full run")
    if args.docs:
        args.out = ROOT / "docs" / "benchmarks.md"
    start, results = time.perf_counter(), []
    for name in args.only.split(","):
        print(f"bench/{name}.py ...", flush=True)
        figures, command, seconds = run_script(name, SCRIPTS[name][0 if args.quick else 1])
        print(f"  {len(figures)} figures in {seconds:.0f} s", flush=True)
        results.append((name, figures, command, seconds))
    text = table(results, args.quick, time.perf_counter() - start)
    write_table(args.out, text)
    print(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
