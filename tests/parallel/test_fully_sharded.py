"""ZeRO-3 (parallel/fully_sharded.py): the units and their buckets, equality with one process in every layout,
bit-identity with ZeRO-1 at the same layout (fp16 loss scaling included), the NaN origin's re-run, and the
working set of gathered parameters. The dp-only cases (bytes held, bytes sent, a parameter without a
gradient) are in test_data_parallel.py, the MoE ones in test_expert_parallel.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from distributed import run_ranks
from helpers import BASE, FEATURES, check_layouts, held_bytes, record_steps

from femtotron.errors import TrainingDiverged
from femtotron.layout import meta_rank_model
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer

ZERO3 = "optimizer.zero_stage=3"
KEEP_FOR_BACKWARD = "optimizer.reshard_after_forward=false"
TIED = "model.model_config.tie_word_embeddings=true"
MOE = (
    "model.model_config.moe.num_experts=4",
    "model.model_config.moe.num_experts_per_tok=2",
    "model.model_config.moe.intermediate_size=32",
)


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        (TIED,),
        (TIED, "parallelism.pp=2"),
        (
            "parallelism.pp=2",
            "parallelism.pp_engine=interleaved-1f1b",
            "parallelism.pp_virtual_stages=2",
            "tokens.batch_accumulation_per_replica=2",
        ),
        (*MOE, "parallelism.dp=2", "parallelism.ep=2", "parallelism.tp=2"),
    ],
    ids=["plain", "tied", "tied-pp2", "interleaved", "moe-ep2-tp2"],
)
def test_every_bucket_belongs_to_one_unit_of_its_own_parameters(tiny_config, overrides):
    """Each unit's buckets hold its own parameters only (the buckets never span two units), every bucket is
    in a unit, and only a tied embedding at pp = 1 is in two (the embedding's and the head's)."""
    config = tiny_config(*BASE, ZERO3, *overrides)
    tied_at_pp1 = TIED in overrides and config.parallelism.pp == 1
    for rank in range(config.parallelism.world_size):
        model = meta_rank_model(config, rank)
        layout = model.data_parallel.layout
        owners: dict[int, list[str]] = {}
        for units in model.gathering.units:
            for unit in units:
                prefix = {"embedding": "embed_tokens.", "head": ""}.get(unit.name, f"layers.{unit.name[6:]}.")
                for bucket in unit.buckets:
                    owners.setdefault(bucket, []).append(unit.name)
                    names = [layout.names[p] for p in layout.buckets[bucket].params]
                    assert all(name.startswith(prefix) for name in names), (unit.name, names)
        assert sorted(owners) == list(range(len(layout.buckets)))
        shared = [names for names in owners.values() if len(names) > 1]
        assert shared == ([["embedding", "head"]] if tied_at_pp1 else [])


@pytest.mark.distributed
def test_zero3_equals_one_process_in_every_layout(tiny_config):
    """Against one process without ZeRO: dp4 (fp32, bf16 on both CPU paths, and keeping the parameters from
    forward to backward), dp2 x tp2 x pp2 under 1F1B (both tp modes, with recomputation), AFAB with a tied
    embedding (its copy on the last stage sharded too) and the interleaved schedule, and dp2 x cp2 with every
    family feature (shards over dp x cp)."""
    check_layouts(
        lambda *overrides: tiny_config(*overrides),
        {
            ("parallelism.dp=4", ZERO3): [
                ("float32", None, ()),
                ("bfloat16", True, ()),
                ("bfloat16", False, ()),
            ],
            ("parallelism.dp=4", ZERO3, KEEP_FOR_BACKWARD): [("float32", None, ())],
            ("parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2", ZERO3): [
                ("float32", None, ()),
                ("float32", None, ("parallelism.tp_mode=REDUCE_SCATTER", "parallelism.recompute_layer=true")),
            ],
            (
                "parallelism.dp=2",
                "parallelism.tp=2",
                "parallelism.pp=2",
                "parallelism.pp_engine=afab",
                ZERO3,
            ): [("float32", None, (TIED,))],
            (
                "parallelism.dp=2",
                "parallelism.pp=2",
                "parallelism.pp_engine=interleaved-1f1b",
                "parallelism.pp_virtual_stages=2",
                ZERO3,
            ): [("float32", None, ())],
            ("parallelism.dp=2", "parallelism.cp=2", ZERO3): [("float32", None, FEATURES)],
        },
    )


def _zero1_and_zero3(rank, configs):
    ctx = ParallelContext(dp=2, collective_timeout_seconds=60)
    out = [record_steps(config, ctx) for config in configs]
    ctx.close()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_zero3_is_bit_identical_to_zero1_at_the_same_layout(tiny_config, dtype):
    """The same buckets reduced the same way (one micro-batch per step: with more, ZeRO-3 sums each one's
    reduction, not the reduction of their sum): ZeRO-3 changes where the parameters live, not one bit of the
    training (fp16: the loss scale and its unscaling included)."""
    configs = [
        tiny_config(
            *BASE,
            "parallelism.dp=2",
            "tokens.batch_accumulation_per_replica=1",
            f"model.dtype={dtype}",
            f"optimizer.zero_stage={zero}",
        )
        for zero in (1, 3)
    ]
    for zero1, zero3 in run_ranks(_zero1_and_zero3, 2, configs):
        assert zero3.losses == zero1.losses and zero3.norms == zero1.norms
        for name, grad in zero1.grads.items():
            assert torch.equal(zero3.grads[name], grad), name
            assert torch.equal(zero3.updates[name], zero1.updates[name]), name


def test_a_nan_is_traced_to_its_module_under_zero3(tiny_config):
    """The NaN origin runs the step again: the units are gathered again for it, and released after."""
    trainer = Trainer(tiny_config(ZERO3, "tokens.batch_accumulation_per_replica=2"), ParallelContext())
    trainer.train_step()
    for name, module in trainer.model.chunks[0].named_modules():
        if name == "layers.1.mlp.down_proj":
            module.register_forward_hook(lambda m, i, output: output * float("nan"))
    with pytest.raises(TrainingDiverged) as info:
        trainer.train_step()
    assert "the forward output of layers.1.mlp.down_proj is the first non-finite value" in str(info.value)
    assert not any(trainer.model.gathering.whole)  # nothing left gathered


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard-after-forward", "keep-for-backward"])
def test_the_gathered_working_set_is_two_units_or_every_unit_kept_for_backward(tiny_config, reshard):
    """Resharding after forward, at most two neighbouring units are whole at once (the one running and the
    one prefetched); keeping them for backward, every unit that backward reads (all but the embedding) is
    whole at the end of the forward. Between steps nothing is: the bytes held are exactly the shards."""
    overrides = (*BASE, ZERO3, "model.dtype=bfloat16", "tokens.batch_accumulation_per_replica=2")
    trainer = Trainer(
        tiny_config(*overrides, f"optimizer.reshard_after_forward={str(reshard).lower()}"), ParallelContext()
    )
    trainer.train_step()
    layout = trainer.data_parallel.layout
    gathering = trainer.model.gathering
    units = gathering.units[0]

    def elements(buckets) -> int:
        return sum(layout.buckets[b].end - layout.buckets[b].start for b in set(buckets))

    if reshard:
        expected = max(elements(a.buckets + b.buckets) for a, b in itertools.pairwise(units))
    else:
        embedding_and_first = elements(units[0].buckets + units[1].buckets)
        expected = max(embedding_and_first, elements(b for unit in units[1:] for b in unit.buckets))
    assert gathering.peak_whole_elements == expected == gathering.working_set()  # what doctor counts
    assert held_bytes(trainer)["params"] == 2 * layout.size  # one process owns every shard
    assert gathering.whole_elements == 0


def _working_set_of_each_stage(rank, config):
    ctx = ParallelContext(pp=2, collective_timeout_seconds=60)
    trainer = Trainer(config, ctx, log_to_console=False)
    trainer.train_step()
    gathering = trainer.model.gathering
    units = gathering.units[0]
    kept = gathering.elements(b for unit in units if unit.needed_in_backward for b in unit.buckets)
    first_two = gathering.elements(units[0].buckets + units[1].buckets)
    ctx.close()
    return units[0].name, gathering.peak_whole_elements, gathering.working_set(), kept, first_two


@pytest.mark.distributed
def test_kept_for_backward_at_pp2_the_embedding_with_the_first_layer_is_the_working_set(tiny_config):
    """pp = 2 with two layers: the first stage holds the embedding and one layer. Kept for backward, the layer
    alone is whole at the end of the forward, but the embedding and the layer were whole together before
    (the layer prefetched while the embedding ran): the working set doctor counts (`working_set`) is that
    larger pair on the first stage, and every unit backward reads on the last; the step measures the same."""
    config = tiny_config(
        ZERO3, KEEP_FOR_BACKWARD, "parallelism.pp=2", "tokens.batch_accumulation_per_replica=2"
    )
    first, last = run_ranks(_working_set_of_each_stage, 2, config)
    for _, peak, working_set, _, _ in (first, last):
        assert peak == working_set
    name, peak, _, kept, embedding_and_layer = first
    assert name == "embedding" and peak == embedding_and_layer > kept
    _, peak, _, kept, _ = last
    assert peak == kept
