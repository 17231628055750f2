"""M1: the memory estimate (meta-device simulation, no memory used) against a real step's peak on CPU."""

from __future__ import annotations

import pytest
from distributed import run_ranks
from helpers import precision_path

from femtotron.diagnostics.memory import (
    NCCL_COMMUNICATOR_BYTES,
    NCCL_LINK_BYTES,
    LiveMemory,
    communicators,
    estimate_rank,
    links,
)
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer

BASE = (
    "model.model_config.num_hidden_layers=4",
    "model.model_config.num_key_value_heads=4",
    "model.model_config.vocab_size=2048",
    "tokens.sequence_length=64",
)
MOE = ("model.model_config.moe.num_experts=4", "model.model_config.moe.intermediate_size=128")
LAYOUTS = {  # (overrides, bf16 path: native or upcast matmuls, None for fp32)
    "one process, fp32": ((), None),
    "one process, bf16 native, recompute": (
        ("model.dtype=bfloat16", "parallelism.recompute_layer=true"),
        True,
    ),
    "one process, bf16 upcast, recompute": (
        ("model.dtype=bfloat16", "parallelism.recompute_layer=true"),
        False,
    ),
    "tp=2 sequence parallel": (("parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"), None),
    "pp=2 1F1B, 4 micro-batches": (("parallelism.pp=2", "tokens.batch_accumulation_per_replica=4"), None),
    "pp=2 zb-h1, 4 micro-batches": (
        ("parallelism.pp=2", "parallelism.pp_engine=zb-h1", "tokens.batch_accumulation_per_replica=4"),
        None,
    ),
    "dp=2 ZeRO-1 bf16 native": (("parallelism.dp=2", "optimizer.zero_stage=1", "model.dtype=bfloat16"), True),
    "cp=2 ZeRO-1 over the cp ranks": (("parallelism.cp=2", "optimizer.zero_stage=1"), None),
    "cp=2 with tp=2 sequence parallel": (
        ("parallelism.cp=2", "parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"),
        None,
    ),
    "mixture of experts, one process": (MOE, None),
    "mixture of experts, dp=2 ep=2 ZeRO-1": (
        (*MOE, "parallelism.dp=2", "parallelism.ep=2", "optimizer.zero_stage=1"),
        None,
    ),
    "dp=2 ZeRO-1 bf16 upcast": (
        ("parallelism.dp=2", "optimizer.zero_stage=1", "model.dtype=bfloat16"),
        False,
    ),
}


def measured_and_estimated(rank, config):
    """This rank's real peak during a (second) training step: the model state it holds plus the peak of the
    storage the step allocates; and the estimate for its pipeline position."""
    par = config.parallelism
    ctx = ParallelContext(par.dp, par.tp, par.pp, par.cp, par.ep, collective_timeout_seconds=60)
    trainer = Trainer(config, ctx, log_to_console=False)
    trainer.train_step()  # Adam's moments exist from here on
    with LiveMemory() as memory:
        trainer.train_step()
    measured = sum(trainer.data_parallel.state.model_state_bytes().values()) + memory.peak
    estimated = estimate_rank(config, ctx.pp_rank, on_this_cpu=True).total
    ctx.close()
    return measured, estimated


@pytest.mark.parametrize(
    "layout",
    [pytest.param(name, marks=pytest.mark.distributed) if "=2" in name else name for name in LAYOUTS],
)
def test_M1_the_estimate_is_within_10_percent_of_the_measured_peak(tiny_config, layout):
    overrides, native = LAYOUTS[layout]
    config = tiny_config(
        *BASE,
        *overrides,
        "tokens.micro_batch_size=4",
        "tokens.batch_accumulation_per_replica=2"
        if "micro-batches" not in layout
        else "tokens.micro_batch_size=4",
    )
    world = config.parallelism.world_size
    with precision_path(native):  # the estimate follows the path too (fp32 copies of bf16 tensors, or none)
        results = (
            [measured_and_estimated(0, config)]
            if world == 1
            else run_ranks(measured_and_estimated, world, config)
        )
    for measured, estimated in results:
        assert estimated == pytest.approx(measured, rel=0.10), (layout, measured, estimated)


def test_M1_with_a_sliding_window_the_estimate_counts_the_one_mask_all_layers_share(tiny_config):
    """Sequence 2048, window 256, 4 layers: on the CPU each layer attends with the one (2048 x 2048) fp32
    mask, 16 MiB that the model's forward keeps until its backward, as large as all its other activations;
    were it counted per layer, or not at all, the estimate would be off by half the peak."""
    config = tiny_config(
        *BASE,
        "tokens.sequence_length=2048",
        "model.model_config.max_position_embeddings=2048",
        "model.model_config.sliding_window=256",
        "tokens.micro_batch_size=1",
    )
    measured, estimated = measured_and_estimated(0, config)
    assert estimated == pytest.approx(measured, rel=0.10), (measured, estimated)


def test_M1_on_gpus_the_estimate_adds_each_nccl_communicator_the_rank_belongs_to(tiny_config):
    """tp=2 pp=4: every rank has a tp group, a pp group and the default group; the first and last stage share
    the tied embedding in one more; and 4 one-way links, to and from each neighbouring stage (the last and
    the first are neighbours for the interleaved schedule). On this CPU (gloo) none is counted."""
    config = tiny_config(*BASE, "parallelism.tp=2", "parallelism.pp=4")
    on_gpus = [estimate_rank(config, p) for p in range(4)]
    assert [e.communicators for e in on_gpus] == [4, 3, 3, 4] and [e.links for e in on_gpus] == [4] * 4
    on_cpu = estimate_rank(config, 0, on_this_cpu=True)
    assert on_cpu.communicators == on_cpu.links == 0
    assert on_gpus[0].total - on_cpu.total == 4 * NCCL_COMMUNICATOR_BYTES + 4 * NCCL_LINK_BYTES
    assert communicators(2, 2, 2, 0) == 5  # tp, dp, pp (= embedding), mp, the default group
    assert communicators(8, 1, 1, 3) == 1 and communicators(1, 1, 1, 0) == 0  # dp = the world; alone
    assert links(2, 2, 2, 0) == 2 and links(1, 1, 1, 0, cp=4) == 2 and links(1, 1, 1, 0, cp=2) == 2
    assert links(8, 1, 1, 3) == 0


class WorkingMemory(LiveMemory):
    """`LiveMemory`, also following op by op what ZeRO-2/3 hold beyond the state kept between steps: the
    buckets' whole gradients (filling, or being reduce-scattered) and the parameters gathered whole, which
    `LiveMemory` does not see (their storage is resized in place, not allocated)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.working_peak = 0  # whole gradients + gathered parameters, at once
        self.peak_with_gathered = 0  # what `LiveMemory` sees + gathered parameters, at once

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        data_parallel = self.model.data_parallel
        whole = sum(grads.nbytes for grads in data_parallel.state.bucket_grads if grads is not None)
        whole += sum(grads.nbytes for grads, _ in data_parallel.in_transit.values())
        gathering = self.model.gathering
        gathered = gathering.whole_elements * data_parallel.state.param_dtype.itemsize if gathering else 0
        self.working_peak = max(self.working_peak, whole + gathered)
        self.peak_with_gathered = max(self.peak_with_gathered, self.live + gathered)
        return out


def zero_memory(rank, configs):
    """Per config: this rank's measured peak of a (second) step, gathered parameters included, its peak of
    whole gradients and gathered parameters, and the estimate of both."""
    ctx = ParallelContext(dp=2, collective_timeout_seconds=60)
    out = []
    for config in configs:
        trainer = Trainer(config, ctx, log_to_console=False)
        trainer.train_step()  # Adam's moments exist from here on
        with WorkingMemory(trainer.model) as memory:
            trainer.train_step()
        measured = sum(trainer.data_parallel.state.model_state_bytes().values()) + memory.peak_with_gathered
        estimate = estimate_rank(config, ctx.pp_rank, on_this_cpu=True)
        out.append((measured, estimate.total, memory.working_peak, estimate.working))
    ctx.close()
    return out


ZERO_LAYOUTS = {
    "ZeRO-2": ("optimizer.zero_stage=2",),
    "ZeRO-3": ("optimizer.zero_stage=3",),
    "ZeRO-3 kept for backward": ("optimizer.zero_stage=3", "optimizer.reshard_after_forward=false"),
    "ZeRO-3 zb-h1": ("optimizer.zero_stage=3", "parallelism.pp_engine=zb-h1"),
    "ZeRO-3 reduced once per step": ("optimizer.zero_stage=3", "optimizer.reduce_every_micro_batch=false"),
}


@pytest.mark.distributed
def test_M1_under_zero_2_and_3_the_estimate_counts_the_whole_gradients_and_gathered_parameters(tiny_config):
    """dp=2, two micro-batches: the estimate within 10% of the measured peak, and its working memory (whole
    gradients and gathered parameters, `RankEstimate.working`) at least what the step held of them at once.
    Under zb-h1 every layer's whole gradients are held from its B (its norms' gradients open its bucket) to
    its W, so all of them at once: an estimate counting only the largest layer's falls below; reduced once
    per step, every unit's whole gradients are held through the step, as ZeRO-2's. The tiny
    vocabulary keeps the layers most of the model, and of that memory."""
    configs = [
        tiny_config(
            *BASE,
            "model.model_config.vocab_size=256",
            "parallelism.dp=2",
            "tokens.micro_batch_size=4",
            "tokens.batch_accumulation_per_replica=2",
            *overrides,
        )
        for overrides in ZERO_LAYOUTS.values()
    ]
    for per_layout in run_ranks(zero_memory, 2, configs):
        for layout, results in zip(ZERO_LAYOUTS, per_layout, strict=True):
            measured, estimated, working, estimated_working = results
            assert estimated == pytest.approx(measured, rel=0.10), (layout, measured, estimated)
            assert working <= estimated_working, (layout, working, estimated_working)
