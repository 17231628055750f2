"""Pipeline parallelism equals one process: loss, full-shape gradients, 3 optimizer steps, p2p bytes."""

from __future__ import annotations

import functools

import pytest
import torch
from distributed import RankFailed, run_ranks
from helpers import SMOOTH_ADAM, Steps, assert_steps_match, precision_path, record_cases, record_steps

from femtotron.errors import DistributedError
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.pipeline.p2p import PipelineP2P, Transfer
from femtotron.trainer import Trainer


def case_config(
    tiny_config,
    layers,
    engine="1f1b",
    virtual=1,
    tied=False,
    dtype="float32",
    tp_mode="ALL_REDUCE",
    accumulation=4,
    zero=0,
    native=None,
    **parallel,
):
    """`native`: the bf16 path of a bf16 case (None for fp32); its fp32 counterpart gets the same."""
    overrides = [
        f"model.model_config.num_hidden_layers={layers}",
        f"model.model_config.tie_word_embeddings={tied}",
        f"model.dtype={dtype}",
        f"tokens.batch_accumulation_per_replica={accumulation}",
        "tokens.micro_batch_size=2",
        "model.model_config.num_key_value_heads=4",
        "optimizer.clip_grad=0.5",
        f"optimizer.zero_stage={zero}",
        "parallelism.dp_bucket_size_mb=0.02",  # several buckets per stage
        *([SMOOTH_ADAM] if native is not None else []),
        f"general.run={engine}-{layers}-{tied}-{dtype}-{tp_mode}-{zero}-{native}-"
        + "-".join(map(str, parallel.values())),
    ]
    overrides += [f"parallelism.{key}={value}" for key, value in parallel.items()]
    if parallel:
        overrides += [
            f"parallelism.pp_engine={engine}",
            f"parallelism.pp_virtual_stages={virtual}",
            f"parallelism.tp_mode={tp_mode}",
        ]
    return tiny_config(*overrides)


def references(tiny_config, layers, tied, dtype, native, accumulation=4) -> tuple[Steps, Steps | None]:
    """One process's steps, and for bf16 the same in fp32."""
    with precision_path(native):
        config = case_config(
            tiny_config, layers, tied=tied, dtype=dtype, accumulation=accumulation, native=native
        )
        reference = record_steps(config, ParallelContext())
    if native is None:
        return reference, None
    in_fp32 = case_config(tiny_config, layers, tied=tied, accumulation=accumulation, native=native)
    return reference, record_steps(in_fp32, ParallelContext())


PP_CASES = {
    # (pp, tp): [(layers, engine, virtual stages, tied, dtype, tp_mode, bf16 path)]
    (2, 1): [
        (5, "afab", 1, False, "float32", "ALL_REDUCE", None),
        (4, "1f1b", 1, True, "float32", "ALL_REDUCE", None),
        (5, "interleaved-1f1b", 2, False, "float32", "ALL_REDUCE", None),
        (5, "1f1b", 1, True, "bfloat16", "ALL_REDUCE", True),
        (5, "1f1b", 1, True, "bfloat16", "ALL_REDUCE", False),
    ],
    (4, 1): [
        (5, "afab", 1, True, "float32", "ALL_REDUCE", None),
        (8, "1f1b", 1, False, "float32", "ALL_REDUCE", None),
        (9, "interleaved-1f1b", 2, True, "float32", "ALL_REDUCE", None),
    ],
    (2, 2): [
        (5, "1f1b", 1, True, "float32", "REDUCE_SCATTER", None),
        (4, "interleaved-1f1b", 2, False, "float32", "ALL_REDUCE", None),
    ],
}


@pytest.mark.distributed
@pytest.mark.parametrize("pp, tp", list(PP_CASES))
def test_P3_pipeline_equals_one_process(tiny_config, pp, tp):
    """Every schedule at pp = 2 and 4 (interleaved with 2 virtual stages), layer counts that do and do not
    divide pp, tied and untied embeddings, bf16 on both CPU paths, and pp x tp = 2 x 2: the loss and
    full-shape gradients of one step, then losses, grad norms and weight changes over 3 steps equal one
    process; every rank logs the same loss (P3)."""
    expected = []
    cases = []
    for layers, engine, virtual, tied, dtype, tp_mode, native in PP_CASES[pp, tp]:
        expected.append(references(tiny_config, layers, tied=tied, dtype=dtype, native=native))
        config = case_config(
            tiny_config,
            layers,
            engine=engine,
            virtual=virtual,
            tied=tied,
            dtype=dtype,
            tp_mode=tp_mode,
            native=native,
            pp=pp,
            tp=tp,
        )
        cases.append((config, native))
    per_rank = run_ranks(record_cases, pp * tp, cases, timeout=300)
    for index, ((config, _), (reference, exact)) in enumerate(zip(cases, expected, strict=True)):
        merged = functools.reduce(Steps.merge, [rank[index] for rank in per_rank])
        assert_steps_match(merged, reference, exact, label=config.general.run)
        for rank in per_rank:
            assert (rank[index].loss, rank[index].losses) == (
                per_rank[0][index].loss,
                per_rank[0][index].losses,
            )


def _p2p_bytes(rank, config):
    ctx = ParallelContext(pp=config.parallelism.pp, collective_timeout_seconds=60)
    trainer = Trainer(config, ctx, log_to_console=False)
    trainer.train_step()  # the first step also sends the one-off shape descriptions
    before = dict(ctx.comm.bytes_sent)
    trainer.train_step()
    pipeline_bytes = {op: n for (kind, op), n in ctx.comm.bytes_sent.items() if kind == "pp"}
    sent = {op: n - before.get(("pp", op), 0) for op, n in pipeline_bytes.items()}
    ctx.close()
    return sent


@pytest.mark.distributed
@pytest.mark.parametrize("engine, virtual", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_p2p_bytes_per_step_equal_the_analytic_count(tiny_config, engine, virtual):
    pp = 2
    layers = 4
    config = case_config(tiny_config, layers, engine=engine, virtual=virtual, pp=pp)
    tok = config.tokens
    hidden = config.model.model_config_.hidden_size
    activation = tok.micro_batch_size * tok.sequence_length * hidden * 4  # fp32
    micro_batches = tok.batch_accumulation_per_replica
    boundaries = pp * virtual - 1
    # Each micro-batch crosses every stage boundary once forward (activation) and once backward
    # (gradient); a rank sends across the boundaries it sits before (forward) or after (backward).
    sent = run_ranks(_p2p_bytes, pp, config)
    assert sum(s["send"] for s in sent) == 2 * micro_batches * boundaries * activation
    # Besides the transfers, one fp32 number: the last stage's loss, summed over pp so every rank logs it.
    assert all(s["all_reduce"] == 2 * (pp - 1) / pp * 4 for s in sent)
    for rank, s in enumerate(sent):
        forward_boundaries = sum(1 for stage in range(pp * virtual - 1) if stage % pp == rank)
        backward_boundaries = sum(1 for stage in range(1, pp * virtual) if stage % pp == rank)
        assert s["send"] == micro_batches * (forward_boundaries + backward_boundaries) * activation


def _mismatch(rank):
    ctx = ParallelContext(pp=2, collective_timeout_seconds=20)
    hidden = 64 if rank == 0 else 32  # as if rank 1 had been started with hidden_size 32 instead of 64
    try:
        p2p = PipelineP2P(
            comm=ctx.comm,
            links=ctx.pp_links,
            pp_rank=ctx.pp_rank,
            device=ctx.device,
            shape=(2, 16, hidden),
            dtype=torch.float32,
        )
        p2p.handshake([1 - rank])
    finally:
        ctx.close()


@pytest.mark.distributed
def test_P1_ranks_that_disagree_on_the_transfer_shape_stop_before_the_first_step():
    with pytest.raises(RankFailed) as failed:
        run_ranks(_mismatch, 2, timeout=60)
    message = str(failed.value)
    assert DistributedError.__name__ in message
    assert "pipeline stages disagree on the activations they exchange: rank" in message
    assert "shape (2, 16, 64) torch.float32" in message and "shape (2, 16, 32) torch.float32" in message


def test_a_stage_returning_the_wrong_shape_is_stopped_before_it_sends():
    p2p = PipelineP2P(
        comm=None, links=None, pp_rank=0, device=torch.device("cpu"), shape=(2, 16, 64), dtype=torch.float32
    )
    to = Transfer(pp_rank=1, tag=0, what="activations")
    with pytest.raises(DistributedError, match=r"would send activations of shape \(2, 16, 32\)"):
        p2p.exchange((torch.zeros(2, 16, 32), to), None)


THREE_D_CASES = [  # (layers, engine, virtual stages, tied, dtype, tp_mode, zero_stage, bf16 path)
    (4, "interleaved-1f1b", 2, True, "float32", "REDUCE_SCATTER", 0, None),
    (5, "1f1b", 1, False, "bfloat16", "ALL_REDUCE", 0, True),
    (5, "1f1b", 1, True, "float32", "REDUCE_SCATTER", 1, None),
    (4, "interleaved-1f1b", 2, True, "bfloat16", "ALL_REDUCE", 1, False),
]


@pytest.mark.distributed
def test_dp_tp_pp_2x2x2_on_8_ranks_equals_one_process(tiny_config):
    """The full 3D mesh: dp=2 x tp=2 x pp=2 with zero_stage 0 and 1, each in fp32 and bf16 (both schedules,
    both tp modes, both bf16 paths, tied embeddings shared across stages and sharded over dp), trains exactly
    like one process with the same global batch (accumulation over the dp split): losses, grad norms, weight
    changes."""
    expected = []
    cases = []
    for layers, engine, virtual, tied, dtype, tp_mode, zero, native in THREE_D_CASES:
        expected.append(
            references(tiny_config, layers, tied=tied, dtype=dtype, native=native, accumulation=8)
        )
        config = case_config(
            tiny_config,
            layers,
            engine=engine,
            virtual=virtual,
            tied=tied,
            dtype=dtype,
            tp_mode=tp_mode,
            zero=zero,
            native=native,
            dp=2,
            tp=2,
            pp=2,
        )
        cases.append((config, native))
    per_rank = run_ranks(record_cases, 8, cases, timeout=600)
    for index, ((config, _), (reference, exact)) in enumerate(zip(cases, expected, strict=True)):
        for dp_rank in range(2):  # ranks dp_rank*2 + tp_rank + 4*pp_rank: one replica's stages
            replica = [per_rank[pp * 4 + dp_rank * 2][index] for pp in range(2)]
            merged = functools.reduce(Steps.merge, replica)
            assert_steps_match(merged, reference, exact, label=config.general.run)
