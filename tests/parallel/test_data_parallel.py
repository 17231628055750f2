"""Data parallelism and ZeRO-1/2/3: bucket layout, equivalence with one process, overlap with backward,
exact memory per rank and exact bytes per step."""

from __future__ import annotations

import contextlib

import pytest
import torch
from distributed import run_ranks
from helpers import (
    SMOOTH_ADAM,
    assert_close_to_reference,
    check_layouts,
    full_masters,
    held_bytes,
    precision_path,
    tiny_config_maker,
    write_patterned_tokens,
)

from femtotron.config import load_config_dict
from femtotron.config.zero_stages import ZERO_STAGES
from femtotron.optim.zero import ZeroOptimizer
from femtotron.parallel.comm import Comm, Group
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.data_parallel import DataParallel
from femtotron.parallel.flat_layout import ALIGNMENT, Replicas, plan_buckets
from femtotron.parallel.fully_sharded import ParameterGathering
from femtotron.trainer import Trainer

SMALL_BUCKETS = "parallelism.dp_bucket_size_mb=0.02"  # ~5k fp32 elements: the tiny model gets many buckets
ONCE_PER_STEP = "optimizer.reduce_every_micro_batch=false"  # ZeRO-3 reduces after the last micro-batch only


def test_buckets_keep_to_their_group_align_every_parameter_and_split_evenly_over_dp():
    numels = [100, 7, 5000, 64, 3, 9]
    groups = [[5, 4, 3, 2], [1], [0]]
    offsets, buckets = plan_buckets(numels, groups, bucket_elements=150, dp=4)
    # 5, 4 and 3 fill the first bucket (each padded to 64 elements); 2 is larger than a bucket alone.
    assert [b.params for b in buckets] == [(5, 4, 3), (2,), (1,), (0,)]
    assert [offsets[p] for p in (5, 4, 3, 2)] == [0, 64, 128, 256]
    assert all(offset % ALIGNMENT == 0 for offset in offsets)
    for bucket in buckets:
        assert (bucket.end - bucket.start) % (4 * ALIGNMENT) == 0  # every dp shard is aligned too
        assert all(bucket.start <= offsets[p] and offsets[p] + numels[p] <= bucket.end for p in bucket.params)
    assert [b.start for b in buckets[1:]] == [b.end for b in buckets[:-1]]


def _layout(dp, sharded):
    shapes = [(48, 16), (16,), (300,), (7, 9)]
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    return [
        DataParallel.build(
            [(f"p{i}", p) for i, p in enumerate(params)],
            [[3, 2, 1, 0]],
            comm=Comm(),
            dense=Replicas(Group("dp", tuple(range(dp))), rank),
            micro_batches=1,
            bucket_mb=0.002,
            grad_dtype=torch.float32,
            zero=ZERO_STAGES[1 if sharded else 0],
        ).layout
        for rank in range(dp)
    ], [p.numel() for p in params]


@pytest.mark.parametrize("dp, sharded", [(1, True), (4, False), (4, True), (3, True)])
def test_owned_pieces_cover_every_element_exactly_once_over_the_dp_ranks(dp, sharded):
    ranks, numels = _layout(dp, sharded)
    copies = dp if not sharded else 1  # without ZeRO every rank owns everything
    for param, numel in enumerate(numels):
        count = torch.zeros(numel, dtype=torch.int64)
        for layout in ranks:
            offset = layout.offsets[param]
            for piece in layout.pieces:
                if piece.param == param:
                    count[piece.start - offset : piece.end - offset] += 1
        assert torch.equal(count, torch.full((numel,), copies))
    owned = [sum(p.end - p.start for p in d.pieces) for d in ranks]
    total = ranks[0].size
    assert sum(owned) == copies * sum(numels) and max(owned) <= (total if not sharded else total // dp)


def case(tiny_config, dtype, zero, native=None, dp=2, *more):
    """`native` is the bf16 path of a bf16 case (None for fp32); its fp32 counterpart takes the same."""
    return tiny_config(
        f"model.dtype={dtype}",
        f"optimizer.zero_stage={zero}",
        f"parallelism.dp={dp}",
        "tokens.micro_batch_size=2",
        f"tokens.batch_accumulation_per_replica={4 // dp}",
        "optimizer.clip_grad=0.5",
        SMALL_BUCKETS,
        f"general.run={dtype}-{zero}-{native}-{dp}",
        *([SMOOTH_ADAM] if native is not None else []),
        *more,
    )


def train_and_record(config, ctx):
    """Three steps: losses, grad norms and master-weight changes by name; the final parameters; the dp
    group's bytes and calls per op in the last step; and, for the first step, how many gradients had
    arrived when each bucket's reduction started."""
    trainer = Trainer(config, ctx, log_to_console=False)
    data_parallel = trainer.data_parallel
    launches = []  # per bucket: the gradients arrived when its reduction started
    launch = data_parallel._launch

    def counted_launch(bucket):
        launches.append(sum(data_parallel.arrivals))
        launch(bucket)

    data_parallel._launch = counted_launch
    names = [n for n, _ in trainer.model.named_parameters()]
    initial = [m.clone() for m in full_masters(trainer.optimizer)]
    results = [trainer.train_step()]
    data_parallel._launch = launch
    results.append(trainer.train_step())
    bytes_before = dict(ctx.comm.bytes_sent)
    calls_before = dict(ctx.comm.calls)
    results.append(trainer.train_step())
    traffic = {}  # op -> (bytes, calls) of the last step over dp
    for (kind, op), n in ctx.comm.bytes_sent.items():
        if kind == "dp":
            sent = n - bytes_before.get((kind, op), 0)
            calls = ctx.comm.calls[kind, op] - calls_before.get((kind, op), 0)
            traffic[op] = (sent, calls)
    updates = {
        n: after - before
        for n, after, before in zip(names, full_masters(trainer.optimizer), initial, strict=True)
    }
    with trainer.model.whole_parameters(list(range(len(names)))):  # ZeRO-3: gathered to read them
        params = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters()}
    gathering = trainer.model.gathering
    return {
        "losses": [r.loss for r in results],
        "norms": [r.grad_norm for r in results],
        "updates": updates,
        "params": params,
        "traffic": traffic,
        "launches": launches,
        "buckets": data_parallel.layout.buckets,
        "parameters": len(names),
        "elements": data_parallel.layout.size,
        "units": gathering.units if gathering else None,
        "peak_whole_elements": gathering.peak_whole_elements if gathering else None,
    }


def _dp_cases(rank, configs):
    ctx = ParallelContext(dp=2, collective_timeout_seconds=60)
    out = []
    for config, (_, _, native, *_) in zip(configs, CASES, strict=True):
        with precision_path(native):
            out.append(train_and_record(config, ctx))
    ctx.close()
    return out


# (dtype, zero_stage, bf16 path: native, upcast, or None for fp32[, more overrides])
CASES = [
    ("float32", 0, None),
    ("float32", 1, None),
    ("float32", 2, None),
    ("bfloat16", 0, True),
    ("bfloat16", 0, False),
    ("bfloat16", 1, True),
    ("bfloat16", 1, False),
    ("bfloat16", 2, True),
    ("bfloat16", 2, False),
    ("float32", 3, None),
    ("bfloat16", 3, True),
    ("bfloat16", 3, False),
    ("float32", 3, None, ONCE_PER_STEP),
]
IDS = [
    f"{d}-zero{z}" + {None: "", True: "-native", False: "-upcast"}[n] + ("-once" if more else "")
    for d, z, n, *more in CASES
]


@pytest.fixture(scope="module")
def dp_results(tmp_path_factory):
    """dp=2 with zero_stage 0 to 3, fp32 and bf16, against one process with the same global batch (and for
    bf16 the same process in fp32, the yardstick for bf16 rounding)."""
    root = tmp_path_factory.mktemp("dp")
    tiny_config = tiny_config_maker(root / "runs", write_patterned_tokens(root / "patterned"))
    references = []
    for dtype, zero, native, *more in CASES:
        with precision_path(native):
            reference = train_and_record(case(tiny_config, dtype, zero, native, 1, *more), ParallelContext())
        exact = (
            None
            if native is None
            else train_and_record(case(tiny_config, "float32", zero, native, 1, *more), ParallelContext())
        )
        references.append((reference, exact))
    configs = [case(tiny_config, dtype, zero, native, 2, *more) for dtype, zero, native, *more in CASES]
    return configs, references, run_ranks(_dp_cases, 2, configs, timeout=300)


@pytest.mark.distributed
@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_dp2_equals_one_process_over_three_steps_with_clipping(dp_results, index):
    configs, references, per_rank = dp_results
    reference, exact = references[index]
    assert min(reference["norms"]) > 0.5  # clip_grad=0.5: clipping is active in every step
    for rank in per_rank:
        got = rank[index]
        assert_close_to_reference(
            got["losses"], reference["losses"], exact and exact["losses"], label="losses"
        )
        # The global grad norm (summed over the dp shards under ZeRO-1) is the single-process norm.
        assert_close_to_reference(
            got["norms"], reference["norms"], exact and exact["norms"], fp32_rel=1e-4, label="grad norms"
        )
        for name, ref in reference["updates"].items():
            assert_close_to_reference(
                got["updates"][name], ref, exact and exact["updates"][name], fp32_rel=1e-4, label=name
            )
    for name, param in per_rank[0][index]["params"].items():  # the replicas stay identical
        assert torch.equal(param, per_rank[1][index]["params"][name]), name


@pytest.mark.distributed
@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_buckets_are_reduced_during_the_last_micro_batch_backward_only(dp_results, index):
    """ZeRO-0 to 2: once per step, in the last micro-batch's backward. ZeRO-3: as each unit's backward ends,
    in every micro-batch (the embedding's bucket once, after the step's backward); with
    reduce_every_micro_batch false, in the last micro-batch's only, as ZeRO-0 to 2."""
    got = dp_results[2][0][index]
    per_micro_batch = got["parameters"]  # every parameter gets one gradient per micro-batch
    micro_batches = 2
    if CASES[index][1] == 3 and len(CASES[index]) == 3:
        embedding = len(got["units"][0][0].buckets)
        assert len(got["launches"]) == micro_batches * (len(got["buckets"]) - embedding) + embedding
        assert min(got["launches"]) < per_micro_batch  # the first ones during the first micro-batch
        return
    assert len(got["launches"]) == len(got["buckets"]) > 2
    # No reduction before the last micro-batch's gradients (no_sync) ...
    assert min(got["launches"]) >= (micro_batches - 1) * per_micro_batch
    # ... and the first ones start while backward still has gradients to produce (overlap).
    assert got["launches"][0] < micro_batches * per_micro_batch - 2


@pytest.mark.distributed
@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_dp_bytes_per_step_equal_the_analytic_count(dp_results, index):
    """zero_stage 0: one all-reduce of the fp32 gradients per bucket. zero_stage 1 and 2: a reduce-scatter of
    them and an all-gather of the model-dtype parameters per bucket. zero_stage 3: each unit's buckets
    reduce-scattered as its backward ends and all-gathered before its forward and again before its backward,
    in each micro-batch (the embedding's: gathered for forward only, reduced once per step; every bucket
    reduced once per step with reduce_every_micro_batch false). Besides: the step's token count, largest
    token id and loss (one fp32 number each), and when sharded the grad norm's sum of squares."""
    configs, _, per_rank = dp_results
    dtype, zero, _, *more = CASES[index]
    got = per_rank[0][index]
    n = 2
    micro_batches = 2
    elements = got["elements"]
    buckets = got["buckets"]
    scalars = 3 + (zero > 0)
    reduced_elements = scalars + (elements if zero == 0 else 0)
    reductions = scalars + (len(buckets) if zero == 0 else 0)
    expected = {"all_reduce": (2 * (n - 1) / n * 4 * reduced_elements, reductions)}
    gathered = elements
    gathers = len(buckets)
    if zero == 3:
        uses = [
            (b, 2 if unit.needed_in_backward else 1)
            for units in got["units"]
            for unit in units
            for b in unit.buckets
        ]
        gathered = micro_batches * sum((buckets[b].end - buckets[b].start) * times for b, times in uses)
        gathers = micro_batches * sum(times for _, times in uses)
    scattered = elements
    scatters = len(buckets)
    if zero == 3 and not more:  # a unit's buckets in each micro-batch, the embedding's once
        embedding = got["units"][0][0].buckets
        once = sum(buckets[b].end - buckets[b].start for b in embedding)
        scattered = micro_batches * (elements - once) + once
        scatters = micro_batches * (len(buckets) - len(embedding)) + len(embedding)
    if zero > 0:
        expected["reduce_scatter"] = ((n - 1) / n * 4 * scattered, scatters)
        expected["all_gather"] = ((n - 1) / n * (2 if dtype == "bfloat16" else 4) * gathered, gathers)
    assert {op: counts for op, counts in got["traffic"].items() if counts[1] and op != "wait"} == {
        op: (int(b), calls) for op, (b, calls) in expected.items()
    }


def _memory(rank, configs):
    ctx = ParallelContext(dp=configs[0].parallelism.dp, collective_timeout_seconds=60)
    out = []
    for config in configs:
        trainer = Trainer(config, ctx, log_to_console=False)
        trainer.train_step()  # Adam allocates its moments in the first step
        layout = trainer.data_parallel.layout
        out.append(
            (
                held_bytes(trainer),
                trainer.data_parallel.state.model_state_bytes(),
                layout.size,
                layout.padding,
                sum(p.numel() for _, p in trainer.model.named_parameters()),
            )
        )
    ctx.close()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_bytes_held_per_rank_match_the_analytic_formula(tiny_config, dp):
    """bf16 parameters: 2 + 4 + 12/dp bytes per parameter with ZeRO-1, 2 + (4 + 12)/dp with ZeRO-2, (2 + 4 +
    12)/dp with ZeRO-3 (2 + 4 + 12 without); fp32: 4 + 4 + 8/dp, 4 + (4 + 8)/dp and (4 + 4 + 8)/dp (the owned
    fp32 parameters are the master weights). The buffers' padding is counted, and reported."""
    configs = [
        tiny_config(
            f"model.dtype={dtype}",
            f"optimizer.zero_stage={zero}",
            f"parallelism.dp={dp}",
            f"general.run=memory-{dtype}-{zero}-{dp}",
        )
        for dtype in ("bfloat16", "float32")
        for zero in (0, 1, 2, 3)
    ]
    per_rank = [_memory(0, configs)] if dp == 1 else run_ranks(_memory, dp, configs)
    for index, config in enumerate(configs):
        bf16 = config.model.dtype == "bfloat16"
        zero = config.optimizer.zero_stage
        owned = []
        for rank in per_rank:
            held, plan, elements, padding, params = rank[index]
            assert elements == params + padding and padding < params  # tiny layers: mostly alignment padding
            # each bucket's 1/dp of the gradients under ZeRO-2 and 3, of the parameters under ZeRO-3
            assert held["params"] == (2 if bf16 else 4) * elements // (dp if zero == 3 else 1)
            assert held["grads"] == 4 * elements // (dp if zero >= 2 else 1)
            owned.append(held["moments"] // 8)
            assert held["moments"] == 8 * owned[-1] and held["masters"] == (4 * owned[-1] if bf16 else 0)
            assert plan == {
                "params": held["params"],
                "grads": held["grads"],
                "master_weights": held["masters"],
                "adam_moments": held["moments"],
            }
        if zero == 0:
            assert owned == [params] * dp  # every rank holds all 12 (bf16) or 8 (fp32) bytes per parameter
        else:
            assert sum(owned) == params  # every element's optimizer state is on exactly one rank ...
            assert max(owned) <= elements // dp  # ... and no rank holds more than its 1/dp share


UNUSED_SECTION = {
    "tokens": {"train_steps": 10},
    "data": {"dataset_folder": "unused"},
    "optimizer": {"learning_rate_scheduler": {"learning_rate": 1e-2}},
}


def _step_with_a_bias_used_once(comm, group, dp_rank, micro_batches, bucket_mb, stage):
    """One step of y = x W^T (+ b only in the very last micro-batch of the global batch: on dp rank 0 of two
    the bias gets no gradient at all, on rank 1 in one of its micro-batches); the gradients summed over dp,
    whole, and the weights after the step."""
    params = [
        torch.nn.Parameter(torch.randn(5, 4, generator=torch.Generator().manual_seed(7))),
        torch.nn.Parameter(torch.zeros(5)),
    ]
    data_parallel = DataParallel.build(
        [("weight", params[0]), ("bias", params[1])],
        [[1, 0]],
        comm=comm,
        dense=Replicas(group, dp_rank),
        micro_batches=micro_batches,
        bucket_mb=bucket_mb,
        grad_dtype=torch.float32,
        zero=ZERO_STAGES[stage],
    )
    gathering = None
    if stage == 3:  # the two parameters as one unit (a tool's, no chunk's), whole through the micro-batches
        gathering = ParameterGathering(data_parallel, [], deferred=None, reshard_after_forward=True)
    optimizer = ZeroOptimizer(params, data_parallel, load_config_dict(UNUSED_SECTION).optimizer)
    whole = gathering.whole_parameters if gathering else lambda _: contextlib.nullcontext()
    with whole([0, 1]):
        for index in range(micro_batches):
            global_index = dp_rank * micro_batches + index
            y = torch.randn(3, 4, generator=torch.Generator().manual_seed(global_index)) @ params[0].T
            if global_index == group.size * micro_batches - 1:
                y = y + params[1]
            y.pow(2).sum().backward()
    data_parallel.finish_reduction()
    if gathering:
        gathering.settle()
    grads = [g.clone() for g in data_parallel.state.full(optimizer.grads())]
    optimizer.step(1e-2)
    with whole([0, 1]):
        return grads, [p.detach().clone() for p in params]


def _unused_parameter(rank, stage, bucket_mb):
    with ParallelContext(dp=2, collective_timeout_seconds=60) as ctx:
        return _step_with_a_bias_used_once(
            ctx.comm, ctx.dp_group, ctx.dp_rank, micro_batches=2, bucket_mb=bucket_mb, stage=stage
        )


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 1, 2, 3], ids=["zero0", "zero1", "zero2", "zero3"])
@pytest.mark.parametrize("bucket_mb", [1e-5, 1.0], ids=["bucket-each", "one-bucket"])
def test_a_parameter_without_a_gradient_on_some_rank_is_still_reduced_over_dp(stage, bucket_mb):
    """The bias gets a gradient only on dp rank 1, in one of its two micro-batches: its bucket never completes
    during backward on either rank, so finish_reduction must reduce it; both ranks then hold the dp sum, and
    the step equals one process accumulating all four micro-batches."""
    expected_grads, expected_weights = _step_with_a_bias_used_once(
        Comm(), Group("dp", (0,)), 0, micro_batches=4, bucket_mb=bucket_mb, stage=0
    )
    assert expected_grads[1].abs().sum() > 0  # the bias really has a gradient, from one micro-batch
    for grads, weights in run_ranks(_unused_parameter, 2, stage, bucket_mb):
        for got, expected in zip(grads + weights, expected_grads + expected_weights, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.distributed
def test_zero3_with_a_tied_embedding_at_pp1_equals_one_process(tiny_config):
    """At pp = 1 the tied embedding's bucket is in two units, the head's and the embedding's: the head's
    reduction runs before the embedding's own gradient arrives, so that gradient, the last of the step, is
    left whole and must still be reduced after the step's backward (not dropped as already reduced)."""
    tied = "model.model_config.tie_word_embeddings=true"
    check_layouts(tiny_config, {("parallelism.dp=2", "optimizer.zero_stage=3"): [("float32", None, (tied,))]})
