"""The train state is data: it round-trips through a JSON-ready dict, the loss scale only when asked."""

import json

from femtotron.data.stages import StageStart
from femtotron.optim.loss_scale import DynamicLossScaler
from femtotron.train_state import TrainState


def test_the_train_state_round_trips_and_keeps_the_loss_scale_only_for_fp16():
    state = TrainState(
        scaler=DynamicLossScaler(initial_scale=1024.0),
        step=7,
        consumed_samples=112,
        consumed_tokens=3500,
        non_finite_skips=1,
        lr_schedule_start=4,
        stages=[StageStart(name="stable", step=1, samples=0), StageStart(name="decay", step=6, samples=80)],
    )
    state.recent.extend([(6, 1e-3, 0.5), (7, 9e-4, 0.4)])
    state.scaler.update(overflow=True)
    saved = json.loads(json.dumps(state.state_dict()))  # what the manifest holds
    assert saved["lr_schedule"] == {"last_lr": 9e-4, "start": 4} and saved["loss_scale"]["scale"] == 512.0
    fresh = TrainState(scaler=DynamicLossScaler(initial_scale=1024.0))
    fresh.load_state_dict(saved, loss_scale=True)
    assert (fresh.step, fresh.consumed_samples, fresh.consumed_tokens, fresh.non_finite_skips) == (
        7,
        112,
        3500,
        1,
    )
    assert list(fresh.recent) == [(6, 1e-3, 0.5), (7, 9e-4, 0.4)]
    assert fresh.stages == state.stages and fresh.lr_schedule_start == 4
    assert (fresh.scaler.scale, fresh.scaler.skipped_steps) == (512.0, 1)
    other = TrainState(scaler=DynamicLossScaler(initial_scale=1024.0))
    other.load_state_dict(saved, loss_scale=False)  # a bf16 checkpoint's scale means nothing to fp16
    assert other.step == 7 and other.scaler.scale == 1024.0
