"""Pipeline bubble: measured idle share of a training step against theory, per schedule, pp and micro-batches.

Theory (each engine's `bubble`, config/pipeline_engines.py): fill and drain cost pp - 1 stage-steps,
shortened v-fold by interleaving, so a stage idles (pp - 1) / v / (m + (pp - 1) / v) of a step, the same on
every stage. zb-h1 (backward split in B and W, each as long as the forward) idles (pp - 1) / 3 stage-steps
once m >= pp: a third of 1F1B's; the `idle/1f1b` column is its measured idle over 1F1B's at the same pp and m.

`--compute sleep` (default) runs the real `Pipeline` executor with real gloo point-to-point on
pp = 2 and 4 processes, but every model chunk is a stand-in whose forward sleeps F ms and whose
backward sleeps 2F ms (F / v and 2F / v per chunk when interleaved, so a rank's work per micro-batch
is the same for every engine). Sleeping rather than computing keeps 4 processes on a 2-core machine
from competing for the CPU, so what is measured is the schedule's own idle time plus real transfers
and executor overhead. Before each step the ranks meet at a barrier; the step spans from the first
rank's start to the last rank's end (one clock for all processes: CLOCK_MONOTONIC), and

    idle (rank r) = 1 - (seconds rank r spent sleeping, i.e. computing) / step span

reported as the mean over ranks (and the worst rank), median over `--steps` steps after one
warm-up step. `p2p wait` is the other way to count it: the rank's seconds blocked in pp
communication (Comm.take_seconds()["pp"]) plus the time before its start and after its end within
the span; the two differ by executor overhead (Python, autograd, starting sends).

`--compute model` trains the real debug model (examples/debug.yaml's shape, float32, 4 layers so
interleaving has 2 chunks per rank) through femtotron's `Trainer` at pp = 2: compute is then the
rank's time in `Pipeline.train_step` minus its pp communication (so idle and p2p wait coincide), and
stage imbalance (the last stage also runs the LM head and the loss) counts as idle too. It also
prints the `pp_comm_share` the trainer logs (whole step, optimizer included). Only pp = 2: two ranks
with one thread each fit the 2 cores of a small machine; at pp = 4 they would time-share the cores
and the "idle" would mostly be waiting for a CPU, not for the pipeline.

    python bench/pp_bubble.py [--compute sleep|model] [--pp 2,4] [--micro-batches 1,2,4,8]
                              [--engines afab,1f1b,interleaved-1f1b] [--steps 4] [--forward-ms 20]
                              [--activation 4,128,256]

`--micro-batches` are multiples k of pp (m = k * pp); `--activation MBS,SEQ,HIDDEN` sets the
transferred float32 tensor in sleep mode. The defaults take about 2 minutes in either mode.

Reading the numbers: the theory has free transfers and free scheduling. Here every action also pays
a fixed cost (gloo's receive latency, the executor issuing each send with the next receive after the
compute, its Python and autograd), on the critical path once per micro-batch and stage, so
`extra` grows with m while the theoretical bubble shrinks like 1/m: the ratio is close to 1 at small
m and grows with m, more so for interleaving (v times the transfers, each chunk 1/v of the compute).
A larger `--forward-ms` shrinks that fixed cost's share and the ratios tend to 1.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from common import spawn_ranks, summary_headline
from torch import nn

from femtotron.batch import MicroBatch
from femtotron.config import load_config
from femtotron.config.pipeline_engines import ENGINES as ENGINE_RECORDS
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.pipeline.p2p import PipelineP2P
from femtotron.parallel.pipeline.schedules import Pipeline
from femtotron.parallel.split_backward import defer_weight_gradients

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("afab", "1f1b", "interleaved-1f1b", "zb-h1")
INTERLEAVED_V = 2


@dataclass(frozen=True)
class Case:
    engine: str
    pp: int
    v: int
    m: int


@dataclass(frozen=True)
class StepTimes:
    start: float  # CLOCK_MONOTONIC, comparable across the processes of one machine
    end: float
    compute: float  # seconds this rank computed (slept, in sleep mode)
    pp_wait: float  # seconds in pp communication (recv waits, send starts, send waits)
    trainer_pp_share: float = float("nan")  # model mode: pp_comm_share as the trainer logs it


# --- sleep mode: stand-in chunks --------------------------------------------------------------------


class Clock:
    """Sleeps in place of compute and adds up how long they really took."""

    def __init__(self) -> None:
        self.busy = 0.0

    def sleep(self, seconds: float) -> None:
        start = time.monotonic()
        time.sleep(seconds)
        self.busy += time.monotonic() - start


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, chunk: SleepChunk) -> torch.Tensor:
        ctx.chunk = chunk
        chunk.clock.sleep(chunk.forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.chunk.backward_pass()
        return grad, None


class SleepChunk(nn.Module):
    """A model chunk that takes forward_s to run forward and backward_s to run backward: under zb-h1 half of
    it in B and half in W (its one-number weight's gradient, computed in W as the split linears' are). The
    first stage's output hangs off a fresh leaf, so nothing but the sleeps and the transfers costs."""

    def __init__(
        self,
        first: bool,
        last: bool,
        shape: tuple[int, int, int],
        forward_s: float,
        backward_s: float,
        clock: Clock,
    ) -> None:
        super().__init__()
        self.first, self.last, self.shape = first, last, shape
        self.forward_s, self.backward_s, self.clock = forward_s, backward_s, clock
        self.weight = nn.Parameter(torch.zeros(1))
        self.deferred = None  # zb-h1: where W's work goes (the Pipeline sets it: parallel/split_backward.py)

    def run_stage(self, inputs: torch.Tensor, targets: torch.Tensor, placement: None = None) -> torch.Tensor:
        # The first stage gets token ids; it makes up activations of the transferred shape instead.
        x = torch.zeros(self.shape, requires_grad=True) if self.first else inputs
        out = _Sleep.apply(x, self)
        return out.sum() if self.last else out

    def backward_pass(self) -> None:
        if self.deferred is None:
            self.clock.sleep(self.backward_s)
            return
        self.clock.sleep(self.backward_s / 2)  # B
        self.deferred.defer(self.weight, self.weight_pass)

    def weight_pass(self) -> torch.Tensor:
        self.clock.sleep(self.backward_s / 2)  # W
        return torch.zeros(1)


def sleep_rank(ctx: ParallelContext, cases: list[Case], args: argparse.Namespace, report) -> None:
    shape = tuple(int(n) for n in args.activation.split(","))
    mbs, seq, _ = shape
    clock = Clock()
    forward_s = args.forward_ms / 1000
    for index, case in enumerate(cases):
        stages = case.pp * case.v
        chunks = [
            SleepChunk(
                stage == 0, stage == stages - 1, shape, forward_s / case.v, 2 * forward_s / case.v, clock
            )
            for stage in (c * case.pp + ctx.pp_rank for c in range(case.v))
        ]
        p2p = PipelineP2P(ctx.comm, ctx.pp_links, ctx.pp_rank, ctx.device, shape, torch.float32)
        engine = ENGINE_RECORDS[case.engine]
        deferred = defer_weight_gradients(chunks) if engine.splits_backward else None
        pipeline = Pipeline(chunks, case.engine, case.pp, ctx.pp_rank, p2p, deferred=deferred)
        micro_batches = [
            MicroBatch.from_tokens(torch.zeros(mbs, seq + 1, dtype=torch.int64)) for _ in range(case.m)
        ]
        global_tokens = torch.tensor(float(mbs * seq * case.m))
        steps = []
        for _ in range(args.steps + 1):
            ctx.comm.barrier(ctx.pp_group)
            ctx.comm.take_seconds()
            clock.busy = 0.0
            start = time.monotonic()
            pipeline.train_step(micro_batches, global_tokens)
            end = time.monotonic()
            steps.append(StepTimes(start, end, clock.busy, ctx.comm.take_seconds().get("pp", 0.0)))
        report(index, steps[1:])


# --- model mode: the real model through the Trainer ---------------------------------------------------


def model_rank(ctx: ParallelContext, cases: list[Case], args: argparse.Namespace, report) -> None:
    from femtotron.trainer import Trainer  # only this mode needs the model stack

    with tempfile.TemporaryDirectory() as tmp:
        for index, case in enumerate(cases):
            config = load_config(
                ROOT / "examples" / "debug.yaml",
                overrides=[
                    f"general.run=bubble-{case.engine}-{case.m}",
                    "model.model_config.num_hidden_layers=4",
                    f"tokenizer.tokenizer_name_or_path={ROOT / 'examples' / 'tokenizer.json'}",
                    f"data.dataset_folder={ROOT / 'examples' / 'data' / 'shakespeare'}",
                    f"logging.output_dir={tmp}",
                    "checkpoints.save_final_state=false",
                    f"tokens.batch_accumulation_per_replica={case.m}",
                    "tokens.train_steps=1000000",
                    f"parallelism.pp={case.pp}",
                    f"parallelism.pp_engine={case.engine}",
                    f"parallelism.pp_virtual_stages={case.v}",
                ],
            )
            trainer = Trainer(config, ctx, log_to_console=False)
            inner = trainer.pipeline.train_step
            timed: list[tuple[float, float, float, float]] = []

            def train_step(micro_batches, global_tokens, inner=inner, timed=timed):
                before = ctx.comm.take_seconds().get("pp", 0.0)  # nothing in this step's pp so far
                ctx.comm.barrier(ctx.pp_group)
                ctx.comm.take_seconds()  # the barrier is the bench's, not the trainer's
                start = time.monotonic()
                loss = inner(micro_batches, global_tokens)
                end = time.monotonic()
                wait = ctx.comm.take_seconds().get("pp", 0.0)
                timed.append((start, end, wait, before + wait))
                return loss

            trainer.pipeline.train_step = train_step
            steps = []
            for _ in range(args.steps + 1):
                result = trainer.train_step()
                start, end, wait, pp_seconds = timed[-1]
                pp_share = (pp_seconds + result.comm_seconds.get("pp", 0.0)) / result.seconds
                steps.append(StepTimes(start, end, end - start - wait, wait, pp_share))
            report(index, steps[1:])


# --- ranks, and the table ----------------------------------------------------------------------------


def summarize(per_rank: list[list[StepTimes]]) -> dict[str, float]:
    """Medians over steps of: step span, compute (mean over ranks), idle (mean and worst rank), p2p-wait
    share (mean), the trainer's pp share (mean)."""
    rows = []
    for step in zip(*per_rank, strict=True):
        first, last = min(t.start for t in step), max(t.end for t in step)
        span = last - first
        idles = [1 - t.compute / span for t in step]
        rows.append(
            {
                "span": span,
                "compute": statistics.fmean(t.compute for t in step),
                "idle": statistics.fmean(idles),
                "worst": max(idles),
                "wait": statistics.fmean(
                    (t.pp_wait + (t.start - first) + (last - t.end)) / span for t in step
                ),
                "share": statistics.fmean(t.trainer_pp_share for t in step),
            }
        )
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compute", choices=("sleep", "model"), default="sleep")
    parser.add_argument("--pp", default=None, help="pp sizes (default 2,4 with sleep, 2 with model)")
    parser.add_argument(
        "--micro-batches",
        default=None,
        help="micro-batch counts as multiples k of pp, m = k * pp "
        "(default 1,2,4,8 with sleep, 1,2,4 with model)",
    )
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--steps", type=int, default=4, help="measured steps per case, after a warm-up step")
    parser.add_argument(
        "--forward-ms", type=float, default=20.0, help="sleep mode: forward per stage, ms (backward 2x)"
    )
    parser.add_argument(
        "--activation", default="4,128,256", help="sleep mode: MBS,SEQ,HIDDEN of the float32 transfers"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for any case")
    args = parser.parse_args()
    sleep = args.compute == "sleep"
    pps = [int(p) for p in (args.pp or ("2,4" if sleep else "2")).split(",")]
    factors = [int(k) for k in (args.micro_batches or ("1,2,4,8" if sleep else "1,2,4")).split(",")]
    engines = args.engines.split(",")

    if sleep:
        shape = tuple(map(int, args.activation.split(",")))
        print(
            f"--compute sleep: forward {args.forward_ms:g} ms, backward {2 * args.forward_ms:g} ms per "
            f"stage (per chunk: / v), float32 {shape} transfers over gloo; median of {args.steps} steps "
            "after a warm-up"
        )
    else:
        print(
            f"--compute model: debug model (4 layers, hidden 256, micro-batch 16 x 128, float32) through "
            f"the Trainer; median of {args.steps} steps after a warm-up"
        )
    print(
        "idle = 1 - compute / step span, mean over ranks (worst rank in brackets); p2p wait = time blocked "
        "in pp communication\nor outside the rank's own step, as a share of the span; extra = span - what "
        "the theory predicts for the compute done (compute / (1 - theory)); ratio = measured / theory"
    )
    header = (
        f"{'engine':<17} {'pp':>2} {'v':>2} {'m':>3} {'step':>8} {'extra':>8} {'theory':>7} "
        f"{'idle':>7} {'(worst)':>8} {'ratio':>6} {'p2p wait':>8} {'ratio':>6} {'idle/1f1b':>9}"
    )
    header += "" if sleep else f" {'trainer pp share':>16}"
    print(header)
    print("-" * len(header))
    ratios: list[tuple[float, float, Case]] = []
    idle_of_1f1b: dict[tuple[int, int], float] = {}  # (pp, m) -> 1F1B's measured idle share

    def on_case(case: Case, per_rank: list[list[StepTimes]]) -> None:
        s = summarize(per_rank)
        theory = ENGINE_RECORDS[case.engine].bubble(case.pp, case.m, case.v)
        ratio, wait_ratio = s["idle"] / theory, s["wait"] / theory
        ratios.append((ratio, wait_ratio, case))
        if case.engine == "1f1b":
            idle_of_1f1b[case.pp, case.m] = s["idle"]
        plain = idle_of_1f1b.get((case.pp, case.m))
        against_1f1b = f"{s['idle'] / plain:>8.2f}x" if plain else f"{'-':>9}"
        extra = s["span"] - s["compute"] / (1 - theory)
        worst = f"({s['worst']:.1%})"
        row = (
            f"{case.engine:<17} {case.pp:>2} {case.v:>2} {case.m:>3} {s['span'] * 1000:>6.0f}ms "
            f"{extra * 1000:>6.1f}ms {theory:>7.1%} {s['idle']:>7.1%} {worst:>8} {ratio:>5.2f}x "
            f"{s['wait']:>8.1%} {wait_ratio:>5.2f}x {against_1f1b}"
        )
        print(row + ("" if sleep else f" {s['share']:>16.1%}"), flush=True)

    start = time.monotonic()
    for pp in pps:
        cases = [
            Case(engine, pp, INTERLEAVED_V if engine == "interleaved-1f1b" else 1, k * pp)
            for engine in engines
            for k in factors
        ]
        spawn_ranks({"pp": pp}, sleep_rank if args.compute == "sleep" else model_rank, cases, args, on_case)
    elapsed = time.monotonic() - start
    for name, index in (("idle", 0), ("p2p wait", 1)):
        values = [r[index] for r in ratios]
        case = max(ratios, key=lambda r, index=index: r[index])[2]
        summary_headline(
            f"pipeline {name} / theory ({args.compute} compute, pp {','.join(map(str, pps))}, "
            f"{len(values)} cases): median; worst {max(values):.2f}x ({case.engine}, pp={case.pp}, "
            f"m={case.m})",
            "measured idle share",
            "(pp-1)/v/(m+(pp-1)/v)",
            statistics.median(values),
        )
        print(
            f"{name}/theory: max {max(values):.2f}x ({case.engine}, pp={case.pp}, m={case.m}), "
            f"median {statistics.median(values):.2f}x, min {min(values):.2f}x (goal: <= 1.1x)"
        )
    print(f"{elapsed:.0f} s")


if __name__ == "__main__":
    main()
