"""`femtotron check-tp` (T1): tp=N against tp=1 module by module, naming the first divergence."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest
import torch
from distributed import run_ranks
from helpers import FEATURES, OLMO2_FEATURES, precision_path, write_yaml

from femtotron.diagnostics import check_tp
from femtotron.diagnostics.check_tp import (
    DIVERGES_EXIT_CODE,
    TPCheckFailed,
    compare_tp,
    format_report,
    run_check_tp,
)
from femtotron.errors import ConfigError, DataError
from femtotron.models.llama import Llama
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.tensor_parallel import RowParallelLinear, TensorParallel
from femtotron.precision import linear

# Every module that declares its output layout, in the order outputs are produced, then the loss.
LAYER = [
    "input_layernorm",
    "self_attn.qkv_proj",
    "self_attn.o_proj",
    "self_attn",
    "post_attention_layernorm",
    "mlp.gate_up_proj",
    "mlp.down_proj",
    "mlp",
    "",
]
MODULES = [
    "embed_tokens",
    *[f"layers.{i}.{m}".rstrip(".") for i in range(2) for m in LAYER],
    "norm",
    "lm_head",
    "loss",
]


def tp_model(config, ctx: ParallelContext) -> Llama:
    sequence_parallel = config.parallelism.tp_mode == "REDUCE_SCATTER"
    tp = TensorParallel(ctx.comm, ctx.tp_group, ctx.tp_rank, sequence_parallel=sequence_parallel)
    return Llama(
        config.model.model_config_,
        std=config.model.init_method.std,
        seed=config.general.seed,
        dtype=torch.float32,
        device=ctx.device,
        tp=tp,
    )


def _correct(rank, configs, cases):
    ctx = ParallelContext(tp=2, collective_timeout_seconds=60)
    reports = []
    for config, (_, _, _, native) in zip(configs, cases, strict=True):
        with precision_path(native):
            reports.append(compare_tp(config, ctx))
    ctx.close()
    return reports


@pytest.mark.distributed
def test_T1_a_correct_model_matches_in_both_modes_module_by_module(tiny_config):
    # vocab 257 (the data's ids stay below 256): the vocabulary is padded to 258 for tp=2. bf16 on both CPU
    # paths: the default tolerance must hold whichever the user's CPU takes.
    cases = [
        ("ALL_REDUCE", "float32", False, None),
        ("ALL_REDUCE", "bfloat16", False, True),
        ("REDUCE_SCATTER", "float32", True, None),
        ("REDUCE_SCATTER", "bfloat16", True, False),
        ("REDUCE_SCATTER", "bfloat16", False, True),
        ("ALL_REDUCE", "bfloat16", True, False),
    ]
    configs = [
        tiny_config(
            "parallelism.tp=2",
            f"parallelism.tp_mode={mode}",
            f"model.dtype={dtype}",
            "model.model_config.vocab_size=257",
            f"model.model_config.tie_word_embeddings={tied}",
        )
        for mode, dtype, tied, _ in cases
    ]
    rank0, rank1 = run_ranks(_correct, 2, configs, cases)
    for report, (mode, dtype, tied, _) in zip(rank0, cases, strict=True):
        assert report.ok, format_report(report)
        assert (report.tp, report.tp_mode, report.dtype) == (2, mode, dtype)
        assert [row.name for row in report.rows] == [m for m in MODULES if not (tied and m == "lm_head")]
        bound = 1e-5 if dtype == "float32" else 2e-2
        for row in report.rows:
            assert row.worst() <= bound, (mode, dtype, row)
        for row in report.rows[1:-1]:  # the embedding's input is token ids; the loss has no module hooks
            assert row.grad_output_rel is not None and row.grad_input_rel is not None, (mode, dtype, row.name)
        text = format_report(report)
        assert f"tp=2 matches tp=1 within tolerance {report.tolerance:.0e}" in text
        assert "DIVERGES" not in text and "layers.1.mlp.down_proj" in text
    assert [format_report(r) for r in rank1] == [format_report(r) for r in rank0]  # every rank agrees


class _GatherWithoutReduceScatter(torch.autograd.Function):
    """The sequence all-gather, its backward taking this rank's slice instead of the sum over tp."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return tp.comm.all_gather(x, tp.group, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.tp.size, dim=1)[ctx.tp.rank].contiguous(), None


class NoRotary(torch.nn.Module):
    """Positions left out of the queries and keys."""

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        return x


def _broken(rank, config, breakage):
    ctx = ParallelContext(tp=2, collective_timeout_seconds=60)
    model = tp_model(config, ctx)
    layer = model.layers[1]
    if breakage == "row reduction":  # the partial sums of down_proj are never added up
        layer.mlp.down_proj.forward = lambda x: linear(x, layer.mlp.down_proj.weight)
    elif breakage == "attention core":  # between qkv_proj and o_proj: stands in for a wrong head split
        model.layers[0].self_attn.rotary = NoRotary()
    elif breakage == "column input gradient":
        gate_up = layer.mlp.gate_up_proj
        if model.tp.sequence_parallel:
            gate_up.forward = lambda x: linear(
                _GatherWithoutReduceScatter.apply(x, model.tp), gate_up.weight.flatten(0, 1)
            )
        else:  # no copy_to_tp: the same forward, but the input gradient is never all-reduced
            gate_up.forward = lambda x: linear(x, gate_up.weight.flatten(0, 1))
    elif breakage == "weight gradient":
        layer.self_attn.o_proj.weight.register_hook(lambda grad: 2 * grad)
    report = compare_tp(config, ctx, model=model)
    ctx.close()
    return report


@pytest.mark.distributed
def test_the_families_features_match_module_by_module_in_both_modes(tiny_config):
    """The features the families turn on (biases split with their rows, per-head q/k norms, a sliding window,
    Granite's scalings; OLMo2's norms after each block and its q/k norms over all heads) match the reference
    module by module, the q/k norms among the modules compared."""
    cases = []
    configs = []
    for features in (FEATURES, OLMO2_FEATURES):
        for mode in ("ALL_REDUCE", "REDUCE_SCATTER"):
            cases.append((mode, "float32", False, None))
            configs.append(tiny_config("parallelism.tp=2", f"parallelism.tp_mode={mode}", *features))
    rank0, _ = run_ranks(_correct, 2, configs, cases)
    for report in rank0:
        assert report.ok, format_report(report)
        assert any("q_norm" in row.name for row in report.rows), [row.name for row in report.rows]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "mode, breakage, module, where, advice",
    [
        ("ALL_REDUCE", "row reduction", "layers.1.mlp.down_proj", "output", "the all-reduce (ALL_REDUCE)"),
        ("ALL_REDUCE", "attention core", "layers.0.self_attn.o_proj", "input", "query/key/value heads"),
        ("ALL_REDUCE", "column input gradient", "layers.1.mlp.gate_up_proj", "input gradient", "copy_to_tp"),
        (
            "REDUCE_SCATTER",
            "column input gradient",
            "layers.1.mlp.gate_up_proj",
            "input gradient",
            "reduce-scatter",
        ),
        (
            "REDUCE_SCATTER",
            "weight gradient",
            "layers.1.self_attn.o_proj",
            "weight gradient",
            "o_proj.weight",
        ),
    ],
)
def test_T1_the_first_divergent_module_is_named(tiny_config, mode, breakage, module, where, advice):
    config = tiny_config("parallelism.tp=2", f"parallelism.tp_mode={mode}")
    report = run_ranks(_broken, 2, config, breakage)[0]
    text = format_report(report)
    assert not report.ok
    assert (report.first.module, report.first.where) == (module, where), text
    assert f"FIRST DIVERGENCE: {module}" in text and advice in report.first.explanation
    assert [line.split()[0] for line in text.splitlines() if line.endswith("<- first")] == [module]
    rows = {row.name: row for row in report.rows}
    if where == "output":  # everything before the broken layer matched; it and its block did not
        assert all(rows[name].output_rel < 1e-5 for name in MODULES[: MODULES.index(module)])
        # The loss alone hardly moves (a young model's residual branches are small): hence per module.
        assert rows[module].output_rel > 1e-2 and rows[module.rpartition(".")[0]].output_rel > 1e-2
    if where in ("input gradient", "weight gradient"):  # the forward is untouched
        assert all(row.output_rel < 1e-5 for row in report.rows)


def _crash(rank, config):
    ctx = ParallelContext(tp=2, collective_timeout_seconds=60)
    model = tp_model(config, ctx)
    down_proj = model.layers[0].mlp.down_proj  # no reduce-scatter: a whole sequence where a shard belongs
    down_proj.forward = lambda x: linear(x, down_proj.weight)
    with pytest.raises(TPCheckFailed) as raised:
        compare_tp(config, ctx, model=model)
    ctx.close()
    return str(raised.value)


@pytest.mark.distributed
def test_a_model_that_crashes_is_explained_by_the_first_wrong_shape(tiny_config):
    message = run_ranks(_crash, 2, tiny_config("parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"))[0]
    assert message.startswith("the tp=2 model (tp_mode=REDUCE_SCATTER) failed in forward, inside layers.0: ")
    assert (
        "First wrong shape: layers.0.mlp.down_proj (RowParallelLinear) returned (4, 32, 64), but with "
        "output_split_dim=1 at tp=2 it must return (4, 16, 64) (tp=1: (4, 32, 64))"
    ) in message
    assert "reduce-scatter (REDUCE_SCATTER) after the layer is missing" in message


def _command(rank, path, overrides, break_row_parallel):
    if break_row_parallel:  # in this forked process only; at tp=1 the reduction is a no-op anyway
        RowParallelLinear.forward = lambda self, x: linear(x, self.weight)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = run_check_tp(path, overrides, tp=2)
    return code, out.getvalue()


@pytest.mark.distributed
@pytest.mark.parametrize("mode, broken", [("REDUCE_SCATTER", False), ("ALL_REDUCE", True)])
def test_the_command_prints_on_rank_0_and_exits_1_on_divergence(tiny_config, tmp_path, mode, broken):
    path = write_yaml(tiny_config(), tmp_path / "config.yaml")  # tp=1 in the file: --tp 2 sets the layout
    (code0, text0), (code1, text1) = run_ranks(_command, 2, path, [f"parallelism.tp_mode={mode}"], broken)
    assert (code0, code1) == ((DIVERGES_EXIT_CODE,) * 2 if broken else (0, 0)) and DIVERGES_EXIT_CODE == 1
    assert text1 == ""
    assert text0.startswith(
        f"check-tp: tp=2 (tp_mode={mode}) against tp=1, float32, one micro-batch of 4 x 32 tokens"
    )
    # The first RowParallelLinear to run; the embedding sums its lookups with its own all-reduce.
    verdict = (
        "FIRST DIVERGENCE: layers.0.self_attn.o_proj (RowParallelLinear), output:"
        if broken
        else "tp=2 matches tp=1 within tolerance 1e-04 (tp_mode=REDUCE_SCATTER, float32)."
    )
    assert verdict in text0


@pytest.mark.distributed
def test_the_command_starts_its_tp_processes_and_passes_a_correct_model(tiny_config, tmp_path, no_launcher):
    path = write_yaml(tiny_config("parallelism.tp_mode=REDUCE_SCATTER"), tmp_path / "config.yaml")
    result = subprocess.run(
        [sys.executable, "-m", "femtotron", "check-tp", path, "--tp", "2", "tokens.micro_batch_size=2"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "check-tp at tp=2 needs 2 processes" in result.stderr and "Traceback" not in result.stderr
    assert "tp=2 matches tp=1 within tolerance 1e-04" in result.stdout
    assert result.stdout.count("check-tp: tp=2") == 1  # one report, from rank 0


def test_config_and_data_mistakes_are_reported_before_any_process_starts(
    tiny_config, tmp_path, monkeypatch, no_launcher
):
    monkeypatch.setattr(check_tp, "launch_local", lambda *a, **k: pytest.fail("must not launch"))
    path = write_yaml(tiny_config(), tmp_path / "config.yaml")
    with pytest.raises(ConfigError, match=r"parallelism.tp=1 and no --tp .* one of: 2\."):
        run_check_tp(path)
    with pytest.raises(ConfigError, match="num_key_value_heads=2 must both be divisible by tp=4") as info:
        run_check_tp(path, tp=4)  # the config's own T2 rule, with the tp values that work
    assert "parallelism.tp (--tp 4)" in str(info.value) and "command line override" not in str(info.value)
    with pytest.raises(ConfigError, match="--tolerance 0"):
        run_check_tp(path, tp=2, tolerance=0)
    with pytest.raises(DataError, match="vocab_size=200 allows ids 0..199"):
        run_check_tp(path, ["model.model_config.vocab_size=200"], tp=2)
    monkeypatch.setenv("WORLD_SIZE", "4")  # under a launcher that started the wrong number of ranks
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=4 .* --nproc-per-node 2"):
        run_check_tp(path, tp=2)
