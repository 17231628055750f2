"""N1/N2: a non-finite loss or gradient is traced to the module it came from, on every layout."""

from __future__ import annotations

import re

import pytest
import torch
from distributed import RankFailed, run_ranks

from femtotron.errors import TrainingDiverged
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer


def poison_forward(trainer, name):
    """From now on, module `name` (if this rank holds it) outputs NaN."""
    for chunk in trainer.model.chunks:
        for module_name, module in chunk.named_modules():
            if module_name == name:
                module.register_forward_hook(lambda m, i, output: output * float("nan"))


def test_N1_an_injected_nan_in_one_layers_output_is_reported_with_that_layers_name(tiny_config):
    trainer = Trainer(
        tiny_config("tokens.train_steps=5", "tokens.batch_accumulation_per_replica=2"),
        ParallelContext(),
        log_to_console=False,
    )
    trainer.train_step()
    poison_forward(trainer, "layers.1.mlp.down_proj")
    before = [p.detach().clone() for _, p in trainer.model.named_parameters()]
    with pytest.raises(TrainingDiverged) as info:
        trainer.train_step()
    message = str(info.value)
    assert (
        "Where: the forward output of layers.1.mlp.down_proj is the first non-finite value (its inputs were "
        "finite; micro-batch 0, pipeline stage 0, rank 0)"
    ) in message
    assert "step 2: loss nan" in message and "Recent steps: step 1: lr" in message  # N2: the history
    assert all(torch.equal(a, p) for a, (_, p) in zip(before, trainer.model.named_parameters(), strict=True))


@pytest.mark.parametrize("engine", ["1f1b", "zb-h1"])
def test_N1_a_gradient_that_breaks_in_backward_is_traced_there(tiny_config, engine):
    """zb-h1 too: the weights' gradients come in W, but a broken one comes from a broken output gradient,
    which B meets first."""
    config = tiny_config("tokens.train_steps=5", f"parallelism.pp_engine={engine}")
    trainer = Trainer(config, ParallelContext(), log_to_console=False)

    def break_gradient(module, inputs, output):  # its output's gradient turns NaN; forward stays finite
        output.register_hook(lambda grad: grad * float("nan"))

    for name, module in trainer.model.chunks[0].named_modules():
        if name == "layers.0.self_attn.o_proj":
            module.register_forward_hook(break_gradient)
    with pytest.raises(TrainingDiverged) as info:
        trainer.train_step()
    message = str(info.value)
    assert (
        "forward was finite; in backward the first non-finite gradient reached the output of "
        "layers.0.self_attn.o_proj" in message
    )
    # The loss was finite: it is printed rounded and not called non-finite; an fp32 run gets no dtype advice.
    assert re.match(
        r"step 1: grad norm nan is not finite \(loss \d\.\d{4}\); the optimizer step was skipped", message
    )
    assert "model.dtype" not in message


def _poisoned_pipeline(rank, config):
    ctx = ParallelContext(pp=2, collective_timeout_seconds=60)
    trainer = Trainer(config, ctx, log_to_console=False)
    poison_forward(trainer, "layers.2.mlp")
    try:
        trainer.train_step()
    finally:
        ctx.close()


@pytest.mark.distributed
def test_N1_with_pipeline_stages_the_report_names_the_stage_and_rank_that_broke(tiny_config):
    config = tiny_config(
        "model.model_config.num_hidden_layers=4",
        "parallelism.pp=2",
        "tokens.batch_accumulation_per_replica=4",
        "tokens.micro_batch_size=1",
    )
    with pytest.raises(RankFailed) as failed:
        run_ranks(_poisoned_pipeline, 2, config, timeout=120)
    assert (
        "the forward output of layers.2.mlp is the first non-finite value (its inputs were finite; "
        "micro-batch 0, pipeline stage 1, rank 1)" in str(failed.value)
    )


def test_N1_on_non_finite_skip_drops_the_step_and_training_goes_on(tiny_config, capsys):
    trainer = Trainer(tiny_config("tokens.train_steps=3", "optimizer.on_non_finite=skip"), ParallelContext())
    handle = None
    for name, module in trainer.model.chunks[0].named_modules():
        if name == "layers.0.mlp":
            handle = module.register_forward_hook(lambda m, i, output: output * float("nan"))
    before = [p.detach().clone() for _, p in trainer.model.named_parameters()]
    skipped = trainer.train_step()
    handle.remove()
    assert skipped.skipped and trainer.state.non_finite_skips == 1
    assert all(torch.equal(a, p) for a, (_, p) in zip(before, trainer.model.named_parameters(), strict=True))
    assert "step skipped (optimizer.on_non_finite=skip; 1 skipped so far)" in capsys.readouterr().out
    assert not trainer.train_step().skipped
