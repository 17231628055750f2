"""The split backward of zero-bubble pipelines: B gives the input's gradient and leaves the weight's to W,
which accumulates it through autograd (hooks and all); the layers' gradients equal one backward's, and zb-h1
trains like one process in every layout."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    BF16_PATHS,
    NEEDS_CXX,
    assert_steps_match,
    check_layouts,
    cpu_low_precision_path,
    layout_case,
    precision_path,
    record_steps,
)

from femtotron.errors import FemtotronError
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.pipeline import schedules
from femtotron.parallel.split_backward import (
    DeferredWeightGradients,
    compute_weight_gradients,
    split_grouped_linear,
    split_linear,
)
from femtotron.precision import grouped_linear, linear
from femtotron.trainer import Trainer

MOE = (
    "model.model_config.moe.num_experts=4",
    "model.model_config.moe.num_experts_per_tok=2",
    "model.model_config.moe.intermediate_size=32",
)
ZB = "parallelism.pp_engine=zb-h1"


def parameters(*shapes, dtype=torch.float32) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*shape, generator=generator).to(dtype)) for shape in shapes]


def count_hooks(params) -> list[int]:
    """Per parameter, how often its post-accumulate hook fired (what data parallelism listens to)."""
    fired = [0] * len(params)
    for index, param in enumerate(params):
        param.register_post_accumulate_grad_hook(
            lambda _, index=index: fired.__setitem__(index, fired[index] + 1)
        )
    return fired


def tolerance(dtype: torch.dtype) -> dict:
    # bf16: the split computes the same products in another kernel (another summation order, then rounding)
    return {"atol": 0, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize(
    "dtype, native",
    [(torch.float32, None), (torch.bfloat16, True), (torch.bfloat16, False)],
    ids=["fp32", "native-bf16", "upcast-bf16"],
)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "gate-up"])
def test_split_linear_gives_the_input_gradient_in_b_and_the_weight_gradient_in_w(dtype, native, fused):
    """A (2, 3, 8) weight used flattened (the MLP's gate|up) gets its gradient in its shape; the bias in B."""
    shape = (2, 3, 8) if fused else (6, 8)
    x, weight, bias = parameters((4, 5, 8), shape, (6,), dtype=dtype)
    grad = torch.randn(4, 5, 6).to(dtype)
    with precision_path(native):
        linear(x, weight.flatten(0, -2), bias).backward(grad)
        expected = [t.grad.clone() for t in (x, weight, bias)]
        for t in (x, weight, bias):
            t.grad = None
        fired = count_hooks([weight, bias])
        store = DeferredWeightGradients()
        out = split_linear(x, param=weight, weight=weight.flatten(0, -2), bias=bias, deferred=store)
        out.backward(grad)
        assert weight.grad is None and fired == [0, 1]  # B: the input's and the bias's gradients only
        torch.testing.assert_close(x.grad, expected[0], **tolerance(dtype))
        torch.testing.assert_close(bias.grad, expected[2], **tolerance(dtype))
        compute_weight_gradients(store.take())
    assert fired == [1, 1] and store.take() == []
    torch.testing.assert_close(weight.grad, expected[1], **tolerance(dtype))


@pytest.mark.parametrize(
    "dtype, native",
    [(torch.float32, None), (torch.bfloat16, True), (torch.bfloat16, False)],
    ids=["fp32", "native-bf16", "upcast-bf16"],
)
@pytest.mark.parametrize("out_features", [8, 6], ids=["grouped-gemm", "loop"])  # 6 fp32 = 24 bytes: unaligned
def test_split_grouped_linear_equals_grouped_linear_with_an_expert_without_rows(out_features, dtype, native):
    x, weight = parameters((16, 8), (3, out_features, 8), dtype=dtype)
    ends = torch.tensor([5, 5, 16])
    grad = torch.randn(16, out_features).to(dtype)
    with precision_path(native):
        grouped_linear(x, weight, ends).backward(grad)
        expected = [x.grad.clone(), weight.grad.clone()]
        x.grad = None
        weight.grad = None
        fired = count_hooks([weight])
        store = DeferredWeightGradients()
        split_grouped_linear(x, param=weight, weight=weight, ends=ends, deferred=store).backward(grad)
        assert weight.grad is None and fired == [0]
        compute_weight_gradients(store.take())
    assert fired == [1]
    torch.testing.assert_close(x.grad, expected[0], **tolerance(dtype))
    torch.testing.assert_close(weight.grad, expected[1], **tolerance(dtype))
    assert not weight.grad[1].any()  # the expert without rows


def test_nothing_is_deferred_without_gradients_to_compute():
    """Evaluation (no grad) and an input no gradient flows back to (its weight's would never be computed)."""
    x, weight = parameters((3, 8), (4, 8))
    store = DeferredWeightGradients()
    with torch.no_grad():
        split_linear(x, param=weight, weight=weight, bias=None, deferred=store)
    split_linear(x.detach(), param=weight, weight=weight, bias=None, deferred=store).sum().backward()
    assert store.take() == [] and weight.grad is not None


@pytest.mark.parametrize(
    "extra",
    [(), MOE, ("parallelism.recompute_layer=true",), ("model.dtype=float16",)],
    ids=["dense", "moe", "recompute", "fp16"],
)
def test_zb_h1_on_one_process_trains_exactly_as_1f1b(tiny_config, extra):
    """pp = 1: every micro-batch's F, B, W in turn; the weights' gradients land through W's hooks in the dp
    buckets; loss, full-shape gradients and 3 steps equal 1F1B's."""
    reference = record_steps(layout_case(tiny_config, "float32", None, *extra), ParallelContext())
    got = record_steps(layout_case(tiny_config, "float32", None, *extra, ZB), ParallelContext())
    assert_steps_match(got, reference, label=str(extra))


@BF16_PATHS
def test_zb_h1_on_one_process_in_bf16(tiny_config, native):
    with cpu_low_precision_path(native):
        reference = record_steps(layout_case(tiny_config, "bfloat16", native), ParallelContext())
        got = record_steps(layout_case(tiny_config, "bfloat16", native, ZB), ParallelContext())
    exact = record_steps(layout_case(tiny_config, "float32", native), ParallelContext())
    assert_steps_match(got, reference, exact, label=f"bf16 native={native}")


EIGHT = "tokens.batch_accumulation_per_replica=8"


@pytest.mark.distributed
@pytest.mark.parametrize("pp", [2, 4])
def test_zb_h1_pipelines_equal_one_process(tiny_config, pp):
    """pp = 2 and 4 with m = 4 and 8 micro-batches in fp32; at pp = 2 also bf16 (upcast path), recomputation
    and fp16 with loss scaling."""
    cases = [("float32", None, ()), ("float32", None, (EIGHT,))]
    if pp == 2:
        cases += [
            ("bfloat16", False, (EIGHT,)),
            ("float32", None, ("parallelism.recompute_layer=true",)),
            ("float16", None, ()),
        ]
    check_layouts(tiny_config, {(f"parallelism.pp={pp}", ZB): cases})


@pytest.mark.distributed
def test_zb_h1_with_tp_and_cp_equals_one_process(tiny_config):
    """tp2 x pp2 in both tp modes (m = 4 and 8), cp2 x pp2."""
    check_layouts(
        tiny_config,
        {
            ("parallelism.tp=2", "parallelism.pp=2", ZB): [("float32", None, (EIGHT,))],
            ("parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER", "parallelism.pp=2", ZB): [
                ("float32", None, ())
            ],
            ("parallelism.cp=2", "parallelism.pp=2", ZB): [("float32", None, ())],
        },
    )


@pytest.mark.distributed
def test_zb_h1_with_experts_and_data_parallel_equals_one_process(tiny_config):
    """dp2 x ep2 x pp2: the experts' grouped weights' gradients in W, their buckets reduced over their
    replicas as W completes them (ZeRO-2: sharded; ZeRO-3: each layer reduced once its W has run, or once
    per step, every replica deciding alike whichever experts got gradients)."""
    check_layouts(
        lambda *overrides: tiny_config(*MOE, *overrides),
        {
            ("parallelism.dp=2", "parallelism.ep=2", "parallelism.pp=2", ZB): [
                ("float32", None, ("optimizer.zero_stage=2",)),
                ("float32", None, ("optimizer.zero_stage=3",)),
                ("float32", None, ("optimizer.zero_stage=3", "optimizer.reduce_every_micro_batch=false")),
            ],
        },
    )


@pytest.mark.distributed
def test_zb_h1_with_zero_3_equals_one_process(tiny_config):
    """dp2 x pp2 under ZeRO-3 (parameters gathered per layer, freed after its B; its reduce-scatter queued
    behind its weight gradients), resharding after forward or not, reducing once per step; dp2 at pp = 1 in
    bf16."""
    check_layouts(
        tiny_config,
        {
            ("parallelism.dp=2", "parallelism.pp=2", ZB, "optimizer.zero_stage=3"): [("float32", None, ())],
            (
                "parallelism.dp=2",
                "parallelism.pp=2",
                ZB,
                "optimizer.zero_stage=3",
                "optimizer.reshard_after_forward=false",
            ): [("float32", None, ())],
            (
                "parallelism.dp=2",
                "parallelism.pp=2",
                ZB,
                "optimizer.zero_stage=3",
                "optimizer.reduce_every_micro_batch=false",
            ): [("float32", None, ())],
            ("parallelism.dp=2", ZB, "optimizer.zero_stage=3"): [("bfloat16", False, ())],
        },
    )


@NEEDS_CXX
@pytest.mark.distributed
def test_zb_h1_compiled_equals_one_eager_process(tiny_config):
    """model.compile: the layers' compiled graphs end at the split linears."""
    check_layouts(tiny_config, {("parallelism.pp=2", ZB, "model.compile=true"): [("float32", None, ())]})


def test_under_zero_3_a_layer_is_reduced_as_soon_as_its_weight_gradients_are_in(tiny_config):
    """ZeRO-3 reduce-scatters each layer's gradients as its backward ends; under zb-h1 that waits for its W,
    and happens right after it: when the step's last W is done, no layer's whole gradients are left for the
    end of the step (only the embedding's, reduced once per step by design)."""
    config = layout_case(tiny_config, "float32", None, ZB, "optimizer.zero_stage=3")
    trainer = Trainer(config, ParallelContext(), log_to_console=False)
    data_parallel = trainer.data_parallel
    finish = data_parallel.finish_reduction
    left_whole = []

    def look_then_finish() -> None:
        left_whole.extend(i for i, grads in enumerate(data_parallel.state.bucket_grads) if grads is not None)
        finish()

    data_parallel.finish_reduction = look_then_finish
    trainer.train_step()
    units = trainer.model.gathering.units[0]
    assert units[0].name == "embedding" and not units[0].needed_in_backward
    assert left_whole and set(left_whole) <= set(units[0].buckets)


def test_work_left_by_a_failed_step_is_dropped_and_a_missing_w_is_reported(tiny_config, monkeypatch):
    """A backward that raised part-way leaves deferred work behind: the next step drops it (its gradients
    belong to no micro-batch of this step). A schedule without some W would lose those gradients silently:
    the step stops, naming them."""
    trainer = Trainer(layout_case(tiny_config, "float32", None, ZB), ParallelContext(), log_to_console=False)
    ran = []
    trainer.pipeline.deferred.after(lambda: ran.append(True))
    trainer.train_step()
    assert ran == []
    full = schedules.schedule
    monkeypatch.setattr(schedules, "schedule", lambda *args, **kwargs: full(*args, **kwargs)[:-1])
    with pytest.raises(FemtotronError, match=r"weight gradients of \[\(3, 0\)\] .* bug in femtotron"):
        trainer.train_step()


def test_under_zero_3_w_completes_one_layer_at_a_time_so_few_buckets_are_whole_at_once(tiny_config):
    """W runs the work in the order backward left it: a layer's weight gradients, then its reduction, then the
    next layer's. So when a layer's buckets are reduced, the only other whole gradients are those B opened:
    the buckets of the embedding and of the norms (their gradients come in B) of the layers whose W is still
    to run, not one holding a deferred weight's gradient. W in another order (the reductions after all the
    weight gradients, or before their own) gives the same numbers but holds every bucket whole at once."""
    config = layout_case(tiny_config, "float32", None, ZB, "optimizer.zero_stage=3")
    trainer = Trainer(config, ParallelContext(), log_to_console=False)
    data_parallel = trainer.data_parallel
    chunk = trainer.model.chunks[0]
    deferred = {id(m.weight) for m in chunk.modules() if hasattr(m, "deferred")}
    opened_in_b = {
        data_parallel.layout.bucket_of[index]
        for index, (_, param) in enumerate(trainer.model.named_parameters())
        if id(param) not in deferred
    }
    reduce = data_parallel.reduce_micro_batch
    others_whole = []  # at each unit's reduction: the other buckets whose gradients are whole

    def look_then_reduce(buckets: tuple[int, ...]) -> None:
        whole = {i for i, grads in enumerate(data_parallel.state.bucket_grads) if grads is not None}
        others_whole.append(whole - set(buckets))
        reduce(buckets)

    data_parallel.reduce_micro_batch = look_then_reduce
    trainer.train_step()
    units = len(trainer.model.gathering.units[0]) - 1  # every unit but the embedding, in each micro-batch
    assert len(others_whole) == config.tokens.batch_accumulation_per_replica * units
    most = max(len(whole) for whole in others_whole)  # 5 of 19 here: the 4 layers' norms, the embedding
    assert all(whole <= opened_in_b for whole in others_whole), (most, len(data_parallel.layout.buckets))
