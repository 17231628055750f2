"""model.compile: each decoder layer through torch.compile trains like eager, in every layout (one case per
layout), without recompiling after step 1; a machine without a C++ compiler is told which key to change.

Every test here is `distributed`: TorchInductor starts the C++ compiler in processes of its own."""

from __future__ import annotations

import functools
import importlib.util
import re

import pytest
from distributed import run_ranks
from helpers import (
    BF16_PATHS,
    FEATURES,
    NEEDS_CXX,
    OLMO2_FEATURES,
    SMOOTH_ADAM,
    Steps,
    assert_steps_match,
    precision_path,
    record_steps,
)

from femtotron.errors import ConfigError
from femtotron.models.compile import c_compiler_for_triton, require_gpu_compilers
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer

pytestmark = pytest.mark.distributed


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def steps_eager_and_compiled(config_of, native=None, ctx=None):
    with precision_path(native):
        return [record_steps(config_of(compiled), ctx or ParallelContext()) for compiled in (False, True)]


@NEEDS_CXX
def test_fp32_compiled_equals_eager_and_compiles_only_at_the_first_step(tiny_config):
    def config_of(compiled):
        return tiny_config(f"model.compile={compiled}", "model.model_config.num_hidden_layers=2")

    eager, compiled = steps_eager_and_compiled(config_of)
    assert_steps_match(compiled, eager, label="fp32")

    trainer = Trainer(config_of(True), ParallelContext(), log_to_console=False)
    trainer.train_step()
    after_first = graphs_compiled()
    for _ in range(3):
        trainer.train_step()
    assert graphs_compiled() == after_first  # no recompilation after step 1


@NEEDS_CXX
def test_a_mixture_of_experts_compiled_equals_eager(tiny_config):
    """The routing and the router losses run between the layer's compiled graphs."""

    def config_of(compiled):
        moe = ("model.model_config.moe.num_experts=4", "model.model_config.moe.intermediate_size=32")
        return tiny_config(f"model.compile={compiled}", "model.model_config.num_hidden_layers=2", *moe)

    eager, compiled = steps_eager_and_compiled(config_of)
    assert_steps_match(compiled, eager, label="moe")


@NEEDS_CXX
@pytest.mark.parametrize("features", [FEATURES, OLMO2_FEATURES], ids=["features", "olmo2"])
def test_the_families_features_compiled_equal_eager(tiny_config, features):
    """q/k/v biases, per-head q/k norms, a head_dim of its own, a layer without RoPE, a sliding window and
    Granite's scalings; OLMo2's norms after each block and q/k norms over all heads; compiled
    (tests/models/test_llama.py has them in every layout)."""

    def config_of(compiled):
        return tiny_config(f"model.compile={compiled}", "model.model_config.num_hidden_layers=2", *features)

    eager, compiled = steps_eager_and_compiled(config_of)
    assert_steps_match(compiled, eager, label=str(features))


@NEEDS_CXX
@BF16_PATHS
def test_bf16_compiled_is_eager_within_bf16_rounding(tiny_config, native):
    def config_of(compiled, dtype="bfloat16"):
        return tiny_config(f"model.compile={compiled}", f"model.dtype={dtype}", SMOOTH_ADAM)

    eager, compiled = steps_eager_and_compiled(config_of, native)
    with precision_path(native):
        exact = record_steps(config_of(False, "float32"), ParallelContext())
    assert_steps_match(compiled, eager, exact, label=f"bf16 native={native}")


@NEEDS_CXX
def test_fp16_with_recomputation_compiled_equals_eager(tiny_config):
    def config_of(compiled):
        return tiny_config(
            f"model.compile={compiled}", "model.dtype=float16", "parallelism.recompute_layer=true"
        )

    eager, compiled = steps_eager_and_compiled(config_of)
    exact = record_steps(tiny_config(), ParallelContext())
    assert_steps_match(compiled, eager, exact, label="fp16, recompute_layer")


@NEEDS_CXX
def test_a_compiled_run_logs_its_compile_time_and_resumes_from_its_checkpoint_as_if_never_stopped(
    tiny_config, capsys
):
    overrides = ["model.compile=true", "checkpoints.checkpoint_interval=2", "tokens.train_steps=4"]
    whole = Trainer(tiny_config(*overrides), ParallelContext()).train()
    assert re.search(r"model\.compile: \d+ graphs compiled in [\d.]+ s", capsys.readouterr().out)
    step_2 = tiny_config(*overrides).run_dir / "checkpoints" / "step-0000002"
    resumed = tiny_config(*overrides, "general.run=resumed", f"checkpoints.resume_checkpoint_path={step_2}")
    rest = Trainer(resumed, ParallelContext(), log_to_console=False).train()
    assert [r.loss for r in rest] == pytest.approx([r.loss for r in whole[2:]], rel=1e-6)


def test_without_a_cpp_compiler_the_error_names_the_key(tiny_config):
    from torch._inductor import config

    with config.patch({"cpp.cxx": (None, "/nonexistent/g++")}), pytest.raises(ConfigError) as info:
        Trainer(tiny_config("model.compile=true"), ParallelContext(), log_to_console=False)
    message = str(info.value)
    assert "model.compile=true needs a C++ compiler" in message and "/nonexistent/g++" in message
    assert "set model.compile=false" in message


def test_on_a_gpu_triton_and_a_c_compiler_are_required_before_any_work(monkeypatch, tmp_path):
    """On CUDA, Inductor's kernels are Triton's, and Triton builds their launchers with a C compiler: each
    missing one is named with its fix before the model is built, not at the first step inside torch."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # neither gcc nor clang
    assert c_compiler_for_triton() is None
    cc = tmp_path / "cc"
    cc.write_text("")
    monkeypatch.setenv("CC", str(cc))
    assert c_compiler_for_triton() == str(cc)
    if importlib.util.find_spec("triton") is None:  # this machine: a CPU build of torch, no Triton
        with pytest.raises(
            ConfigError, match=r"model.compile=true on a GPU needs Triton .* set model.compile"
        ):
            require_gpu_compilers()
    else:
        require_gpu_compilers()
        monkeypatch.delenv("CC")
        with pytest.raises(ConfigError, match=r"needs a C compiler .*neither gcc nor clang is on PATH"):
            require_gpu_compilers()


LAYOUTS = {  # world size: cases of (parallelism and dtype overrides, bf16 path)
    2: [(["pp=2", "pp_engine=1f1b"], "bfloat16", True)],  # tp = 1: the last stage's loss is compiled too
    4: [
        (["tp=2", "pp=2", "tp_mode=ALL_REDUCE", "pp_engine=1f1b"], "float32", None),
        (["tp=2", "pp=2", "tp_mode=REDUCE_SCATTER", "pp_engine=afab"], "bfloat16", False),
    ],
    8: [
        (
            [
                "dp=2",
                "tp=2",
                "pp=2",
                "tp_mode=REDUCE_SCATTER",
                "pp_engine=interleaved-1f1b",
                "pp_virtual_stages=2",
            ],
            "float32",
            None,
        ),
    ],
}


def layout_config(tiny_config, parallel, dtype, compiled, zero=0, accumulation=4):
    return tiny_config(
        f"model.compile={compiled}",
        f"model.dtype={dtype}",
        f"optimizer.zero_stage={zero}",
        "model.model_config.num_hidden_layers=4",
        "model.model_config.num_key_value_heads=4",
        "tokens.micro_batch_size=2",
        f"tokens.batch_accumulation_per_replica={accumulation}",
        SMOOTH_ADAM,
        *[f"parallelism.{p}" for p in parallel],
    )


def _layout_ranks(rank, cases):
    par = cases[0][0].parallelism
    ctx = ParallelContext(dp=par.dp, tp=par.tp, pp=par.pp, cp=par.cp, collective_timeout_seconds=300)
    out = []
    for config, native in cases:
        with precision_path(native):
            out.append(record_steps(config, ctx))
    ctx.close()
    return out, graphs_compiled()


@NEEDS_CXX
@pytest.mark.parametrize("world", list(LAYOUTS))
def test_compiled_layouts_equal_one_eager_process(tiny_config, world):
    """pp = 2 in bf16 (the last stage's head and loss compiled too), tp x pp = 2 x 2 under both tp modes
    (ALL_REDUCE 1f1b fp32, REDUCE_SCATTER afab bf16), and the 3D mesh dp x tp x pp = 2 x 2 x 2 with ZeRO-1 and
    the interleaved schedule: compiled, they train like one eager process."""
    zero, dp = (1, 2) if world == 8 else (0, 1)
    cases, expected = [], []
    for parallel, dtype, native in LAYOUTS[world]:
        with precision_path(native):  # one process: the same global batch, accumulated over the dp split
            reference, exact = (
                record_steps(
                    layout_config(tiny_config, [], how, False, accumulation=4 * dp), ParallelContext()
                )
                for how in (dtype, "float32")
            )
        expected.append((reference, exact if dtype != "float32" else None))
        cases.append((layout_config(tiny_config, parallel, dtype, True, zero), native))
    per_rank, graphs = zip(*run_ranks(_layout_ranks, world, cases, timeout=600), strict=True)
    assert min(graphs) > 0  # every rank compiled its layers
    pp = 2
    for index, ((config, _), (reference, exact)) in enumerate(zip(cases, expected, strict=True)):
        replica = [per_rank[stage * (world // pp)][index] for stage in range(pp)]  # dp 0, tp 0 of each stage
        assert_steps_match(functools.reduce(Steps.merge, replica), reference, exact, label=config.general.run)


@NEEDS_CXX
@pytest.mark.distributed
def test_compiled_context_parallel_equals_one_eager_process(tiny_config):
    """cp = 2: the ring (like tp's collectives) is where the compiled graphs end; fp32 and bf16."""
    cases, expected = [], []
    for dtype, native in (("float32", None), ("bfloat16", False)):
        with precision_path(native):
            reference, exact = (
                record_steps(layout_config(tiny_config, [], how, False), ParallelContext())
                for how in (dtype, "float32")
            )
        expected.append((reference, exact if dtype != "float32" else None))
        cases.append((layout_config(tiny_config, ["cp=2"], dtype, True), native))
    per_rank, graphs = zip(*run_ranks(_layout_ranks, 2, cases, timeout=600), strict=True)
    assert min(graphs) > 0
    for index, ((config, _), (reference, exact)) in enumerate(zip(cases, expected, strict=True)):
        for rank in per_rank:
            assert_steps_match(rank[index], reference, exact, label=config.general.run)


@NEEDS_CXX
@pytest.mark.distributed
def test_compiled_zero3_equals_one_eager_process(tiny_config):
    """dp = 2 with ZeRO-3, fp32 and bf16, and with recomputation: each unit's gathers run eagerly at the edges
    of its compiled graphs (the head's as graph breaks inside its compiled loss)."""
    cases, expected = [], []
    for dtype, native, parallel in (
        ("float32", None, ["dp=2"]),
        ("bfloat16", False, ["dp=2"]),
        ("float32", None, ["dp=2", "recompute_layer=true"]),
    ):
        with precision_path(native):
            reference, exact = (
                record_steps(layout_config(tiny_config, [], how, False), ParallelContext())
                for how in (dtype, "float32")
            )
        expected.append((reference, exact if dtype != "float32" else None))
        cases.append((layout_config(tiny_config, parallel, dtype, True, zero=3, accumulation=2), native))
    per_rank, graphs = zip(*run_ranks(_layout_ranks, 2, cases, timeout=600), strict=True)
    assert min(graphs) > 0
    for index, ((config, _), (reference, exact)) in enumerate(zip(cases, expected, strict=True)):
        for rank in per_rank:
            assert_steps_match(rank[index], reference, exact, label=config.general.run)
