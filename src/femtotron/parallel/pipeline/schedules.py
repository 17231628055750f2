"""Pipeline schedules as lists of actions (readable, testable without communication), and their executor.

A schedule is one pp rank's forward and backward passes of (micro-batch, model chunk), in order. A forward
receives its input from the previous virtual stage and sends its output on; a backward receives the output
gradient and sends the input gradient back. Sends never block: the lists' order alone decides the schedule.

- `afab`: all forwards, then all backwards (GPipe). Simple; holds every micro-batch's activations.
- `1f1b`: rank r runs pp - r - 1 forwards (warm-up), then alternates one forward and one backward, then
  drains the backwards. The same bubble, at most pp micro-batches in flight.
- `interleaved-1f1b`: v model chunks per rank (virtual stages r, r + pp, ...): a micro-batch visits the
  ranks v times, so fill and drain shrink v-fold (Megatron-LM's schedule).
- `zb-h1`: 1F1B with each backward split in two (parallel/split_backward.py): B computes the input's
  gradient, which the previous stage waits for, and W the weights' gradients, which nothing waits for but
  the optimizer step; W fills time a stage would spend waiting. A third of 1F1B's bubble when forward, B
  and W take alike (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024: ZB-H1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from femtotron.batch import MicroBatch
from femtotron.errors import FemtotronError
from femtotron.parallel.pipeline.p2p import PendingRecv, PipelineP2P, Send, Transfer
from femtotron.parallel.split_backward import (
    DeferredWeightGradients,
    DeferredWork,
    compute_weight_gradients,
)

PASSES = {"F": "forward", "B": "backward", "W": "weight gradients"}


@dataclass(frozen=True)
class Action:
    kind: str  # "F" (forward), "B" (backward; with a W of its own: of the input only) or "W" (weights)
    micro_batch: int
    chunk: int  # this rank's model chunk; its virtual stage is chunk * pp + rank

    def describe(self) -> str:
        return f"{PASSES[self.kind]} of micro-batch {self.micro_batch}"

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")


def afab(pp: int, rank: int, micro_batches: int, chunks: int = 1) -> list[Action]:
    return [Action(kind, mb, 0) for kind in "FB" for mb in range(micro_batches)]


def one_f_one_b(pp: int, rank: int, micro_batches: int, chunks: int = 1) -> list[Action]:
    warmup = min(pp - rank - 1, micro_batches)
    actions = [Action("F", mb, 0) for mb in range(warmup)]
    for mb in range(micro_batches - warmup):
        actions += [Action("F", warmup + mb, 0), Action("B", mb, 0)]
    return actions + [Action("B", mb, 0) for mb in range(micro_batches - warmup, micro_batches)]


def zero_bubble_h1(pp: int, rank: int, micro_batches: int, chunks: int = 1) -> list[Action]:
    """1F1B's forwards and backwards (B where 1F1B has its backward), and rank r's W of micro-batch k just
    after its B of micro-batch k + r; its last r W's at the end. The last stage so sends every gradient back
    as soon as it can, and stage r fills with W's the time it would wait for them: fill and drain take
    (pp - 1)(F + B - W) instead of (pp - 1)(F + B + W). Activations held are 1F1B's (at most pp - r
    micro-batches between F and B), plus what up to r + 1 micro-batches' W's keep (their linears' inputs and
    output gradients): rank 0's peak stays 1F1B's."""
    actions = []
    for action in one_f_one_b(pp, rank, micro_batches):
        actions.append(action)
        if action.kind == "B" and action.micro_batch >= rank:
            actions.append(Action("W", action.micro_batch - rank, 0))
    return actions + [Action("W", mb, 0) for mb in range(max(micro_batches - rank, 0), micro_batches)]


def interleaved_one_f_one_b(pp: int, rank: int, micro_batches: int, chunks: int) -> list[Action]:
    """Micro-batches go through the chunks in groups of pp: forwards k = 0, 1, ... run chunk
    (k // pp) % v on micro-batch (k // (pp * v)) * pp + k % pp; backwards visit the chunks in reverse."""
    if micro_batches % pp:
        raise ValueError(f"interleaved-1f1b needs micro-batches ({micro_batches}) divisible by pp ({pp})")
    total = micro_batches * chunks

    def micro_batch(k: int) -> int:
        return (k // (pp * chunks)) * pp + k % pp

    def chunk(k: int) -> int:
        return (k // pp) % chunks

    def forward(k: int) -> Action:
        return Action("F", micro_batch(k), chunk(k))

    def backward(k: int) -> Action:
        return Action("B", micro_batch(k), chunks - 1 - chunk(k))

    # Deeper warm-up than plain 1F1B: the first backward needs the micro-batch to have passed all
    # pp * v virtual stages.
    warmup = min((pp - rank - 1) * 2 + (chunks - 1) * pp, total)
    actions = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [forward(warmup + k), backward(k)]
    return actions + [backward(k) for k in range(total - warmup, total)]


# Each engine's schedule, by its name in config/pipeline_engines.py's ENGINES. Every one takes the model
# chunks per rank, so `schedule` calls them alike; those that do not interleave run one.
SCHEDULES: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "afab": afab,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_one_f_one_b,
    "zb-h1": zero_bubble_h1,
}


def schedule(engine: str, pp: int, rank: int, micro_batches: int, chunks: int = 1) -> list[Action]:
    """The actions of pp rank `rank` under the engine named `engine`, with `chunks` model chunks per rank."""
    return SCHEDULES[engine](pp, rank, micro_batches, chunks)  # KeyError: an unknown pp_engine


def forward_only(micro_batches: int, chunks: int) -> list[Action]:
    """Evaluation: every micro-batch through every chunk in order, nothing kept for backward."""
    return [Action("F", mb, chunk) for mb in range(micro_batches) for chunk in range(chunks)]


class Pipeline:
    """Runs one rank's part of a schedule: its model chunks, the transfers, the loss on the last stage.
    At pp = 1 too (forward and backward per micro-batch, no transfers): the trainer has one code path."""

    def __init__(
        self,
        chunks: list[nn.Module],
        engine: str,
        pp: int,
        pp_rank: int,
        p2p: PipelineP2P,
        *,
        deferred: DeferredWeightGradients | None,
    ) -> None:
        """`deferred`: under a zero-bubble engine, the store where each backward leaves the weight gradients
        for its W action (split_backward.defer_weight_gradients on `chunks`); else None."""
        self.chunks = chunks
        self.engine = engine
        self.pp = pp
        self.pp_rank = pp_rank
        self.p2p = p2p
        self.stages = pp * len(chunks)
        self.current = Action("F", 0, 0)
        self.deferred = deferred
        # Stage s talks to stages s - 1 and s + 1: with interleaving that wraps around the pp ranks.
        neighbours = [pp_rank - 1, pp_rank + 1]
        if len(chunks) > 1:
            neighbours = [p % pp for p in neighbours]
        p2p.handshake([p for p in neighbours if 0 <= p < pp])

    def stage_of(self, chunk: int) -> int:
        return chunk * self.pp + self.pp_rank

    def tag(self, micro_batch: int, boundary: int, gradient: bool) -> int:
        """A distinct tag per transfer: the micro-batch, the stage boundary it crosses, and its direction."""
        return (micro_batch * self.stages + boundary) * 2 + int(gradient)

    def receive_for(self, action: Action) -> Transfer | None:
        """What `action` receives, if anything: its input (forward) or its output's gradient (backward)."""
        stage = self.stage_of(action.chunk)
        mb = action.micro_batch
        if action.kind == "F" and stage > 0:
            tag = self.tag(mb, boundary=stage - 1, gradient=False)
            return Transfer(pp_rank=(stage - 1) % self.pp, tag=tag, what="activations")
        if action.kind == "B" and stage < self.stages - 1:
            tag = self.tag(mb, boundary=stage, gradient=True)
            return Transfer(pp_rank=(stage + 1) % self.pp, tag=tag, what="gradients")
        return None

    def run(self, actions: list[Action], step: Callable[[Action, PendingRecv | None], Send | None]) -> None:
        """Execute `actions` in order. The next action's receive is posted before this action computes, so
        its data can arrive meanwhile; the output goes out as soon as it is computed."""
        received = self.p2p.exchange(None, self.receive_for(actions[0])) if actions else None
        for i, action in enumerate(actions):
            self.current = action  # for diagnostics: the micro-batch and chunk being computed
            following = self.receive_for(actions[i + 1]) if i + 1 < len(actions) else None
            posted = self.p2p.exchange(None, following)
            self.p2p.exchange(step(action, received), None)
            received = posted
        self.p2p.wait_sends()

    def train_step(self, micro_batches: list[MicroBatch], global_tokens: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns this rank's summed loss (0 off the last stage).
        Backward runs from each loss / the global batch's token count: the token-weighted mean
        (docs/architecture.md, "Invariants")."""
        loss_sum = torch.zeros((), device=global_tokens.device)
        saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        weight_gradients: dict[tuple[int, int], list[DeferredWork]] = {}
        if self.deferred is not None:
            self.deferred.take()  # what a step that raised part-way through a backward left behind

        def step(action: Action, received: PendingRecv | None) -> Send | None:
            nonlocal loss_sum
            key = (action.micro_batch, action.chunk)
            if action.kind == "W":
                compute_weight_gradients(weight_gradients.pop(key))
                return None
            if action.kind == "B":
                inputs, output = saved.pop(key)
                send = self.backward(action, inputs, output, received)
                if self.deferred is not None:
                    weight_gradients[key] = self.deferred.take()
                return send
            inputs, output, send = self.forward(action, micro_batches[action.micro_batch], received)
            if self.stage_of(action.chunk) == self.stages - 1:
                loss_sum += output.detach()
                output = output / global_tokens
            saved[key] = (inputs, output)
            return send

        actions = schedule(
            self.engine,
            pp=self.pp,
            rank=self.pp_rank,
            micro_batches=len(micro_batches),
            chunks=len(self.chunks),
        )
        self.run(actions, step)
        if weight_gradients:
            raise FemtotronError(
                f"pp_engine={self.engine}: the weight gradients of {sorted(weight_gradients)} (micro-batch, "
                "chunk) were never computed: the schedule has no W for them. This is a bug in femtotron."
            )
        return loss_sum

    @torch.no_grad()
    def evaluate(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """Summed loss over the micro-batches, on the last stage (0 elsewhere)."""
        loss_sum = torch.zeros((), device=micro_batches[0].inputs.device)

        def step(action: Action, received: PendingRecv | None) -> Send | None:
            nonlocal loss_sum
            _, output, send = self.forward(action, micro_batches[action.micro_batch], received)
            if self.stage_of(action.chunk) == self.stages - 1:
                loss_sum += output
            return send

        self.run(forward_only(len(micro_batches), len(self.chunks)), step)
        return loss_sum

    def forward(
        self, action: Action, batch: MicroBatch, received: PendingRecv | None
    ) -> tuple[torch.Tensor, torch.Tensor, Send | None]:
        stage = self.stage_of(action.chunk)
        if received is None:  # the first stage reads the tokens
            inputs = batch.inputs
        else:
            inputs = self.p2p.take(received).requires_grad_(torch.is_grad_enabled())
        output = self.chunks[action.chunk].run_stage(inputs, batch.targets, batch.placement)
        if stage == self.stages - 1:
            return inputs, output, None
        tag = self.tag(action.micro_batch, boundary=stage, gradient=False)
        to = Transfer(pp_rank=(stage + 1) % self.pp, tag=tag, what="activations")
        return inputs, output, (output, to)

    def backward(
        self, action: Action, inputs: torch.Tensor, output: torch.Tensor, received: PendingRecv | None
    ) -> Send | None:
        stage = self.stage_of(action.chunk)
        # The last stage starts from its loss (no gradient received).
        gradient = None if received is None else self.p2p.take(received)
        torch.autograd.backward(output, gradient)
        if stage == 0:
            return None
        tag = self.tag(action.micro_batch, boundary=stage - 1, gradient=True)
        to = Transfer(pp_rank=(stage - 1) % self.pp, tag=tag, what="gradients")
        return inputs.grad, to
