import math

import pytest
import torch
from distributed import run_ranks

from femtotron.config import load_config_dict
from femtotron.errors import ConfigError
from femtotron.optim.loss_scale import DynamicLossScaler
from femtotron.parallel.context import ParallelContext


@pytest.fixture(scope="module")
def ctx() -> ParallelContext:
    return ParallelContext()


def grads(*values: float) -> list[torch.Tensor]:
    return [torch.tensor([v, 2.0]) for v in values]


def test_clean_gradients_are_unscaled_and_the_step_counts(ctx):
    scaler = DynamicLossScaler(initial_scale=8.0)
    g = grads(8.0, 16.0)
    assert scaler.unscale_(g, ctx) is False
    torch.testing.assert_close(g, [torch.tensor([1.0, 0.25]), torch.tensor([2.0, 0.25])])
    scaler.update(overflow=False)
    assert scaler.scale == 8.0 and scaler.clean_steps == 1 and scaler.skipped_steps == 0


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_an_overflow_is_found_and_backs_the_scale_off(ctx, bad):
    scaler = DynamicLossScaler(initial_scale=2.0**16, growth_interval=5)
    scaler.update(overflow=False)
    assert scaler.unscale_(grads(1.0, bad), ctx) is True
    scaler.update(overflow=True)
    assert scaler.scale == 2.0**15 and scaler.skipped_steps == 1
    assert scaler.clean_steps == 0  # the growth interval starts over


def test_the_scale_grows_after_growth_interval_clean_steps():
    scaler = DynamicLossScaler(initial_scale=4.0, growth_factor=2.0, growth_interval=3)
    for _ in range(2):
        scaler.update(overflow=False)
    assert scaler.scale == 4.0
    scaler.update(overflow=False)
    assert scaler.scale == 8.0 and scaler.clean_steps == 0
    scaler.update(overflow=False)
    scaler.update(overflow=False)
    scaler.update(overflow=True)  # an overflow resets the count: three more clean steps to grow
    for _ in range(2):
        scaler.update(overflow=False)
    assert scaler.scale == 4.0
    scaler.update(overflow=False)
    assert scaler.scale == 8.0


def test_the_scale_never_goes_below_min_scale():
    scaler = DynamicLossScaler(initial_scale=4.0, backoff_factor=0.25, min_scale=0.5)
    assert not scaler.at_minimum
    scaler.update(overflow=True)
    assert scaler.scale == 1.0 and not scaler.at_minimum
    scaler.update(overflow=True)  # 0.25 would be below min_scale
    assert scaler.scale == 0.5 and scaler.at_minimum  # the trainer stops on the next overflow
    assert scaler.skipped_steps == 2


def test_a_disabled_scaler_does_nothing(ctx):
    scaler = DynamicLossScaler(initial_scale=2.0**16, enabled=False)
    g = grads(3.0, math.inf)
    assert scaler.scale == 1.0 and scaler.unscale_(g, ctx) is False
    assert g[0][0] == 3.0  # untouched; the trainer's divergence check handles non-finite values
    scaler.update(overflow=True)
    assert scaler.scale == 1.0 and scaler.skipped_steps == 0


def _agree(rank, dp, tp):
    ctx = ParallelContext(dp=dp, tp=tp, init_timeout_seconds=30, collective_timeout_seconds=60)
    scaler = DynamicLossScaler(initial_scale=4.0)
    overflow = scaler.unscale_(grads(4.0, math.inf if rank == 1 else 4.0), ctx)  # rank 1 only overflows
    ctx.close()
    return overflow


@pytest.mark.distributed
@pytest.mark.parametrize("dp, tp", [(2, 1), (1, 2)])
def test_an_overflow_on_one_rank_is_an_overflow_on_every_rank(dp, tp):
    # Over dp through the dp group, over tp (different shards) through the model-parallel group.
    assert run_ranks(_agree, 2, dp, tp) == [True, True]


def test_loss_scale_config_keys_and_rule(tiny_config):
    cfg = tiny_config("optimizer.loss_scale.initial_scale=1024", "optimizer.loss_scale.growth_interval=50")
    assert cfg.optimizer.loss_scale.initial_scale == 1024 and cfg.optimizer.loss_scale.growth_interval == 50
    defaults = cfg.optimizer.loss_scale
    assert (defaults.growth_factor, defaults.backoff_factor, defaults.min_scale) == (2.0, 0.5, 1.0)
    with pytest.raises(ConfigError, match="min_scale=4096 must be <= initial_scale=1024"):
        tiny_config("optimizer.loss_scale.initial_scale=1024", "optimizer.loss_scale.min_scale=4096")
    with pytest.raises(ConfigError, match="backoff_factor"):
        load_config_dict({**cfg.to_dict(), "optimizer": {"loss_scale": {"backoff_factor": 2}}})
