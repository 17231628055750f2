import math

import pytest

from femtotron.config import load_config_dict
from femtotron.config.config import LRSchedulerArgs
from femtotron.optim.lr_schedule import lr_at

PEAK = 1e-3
FLOOR = 1e-4


def schedule(train_steps: int, **scheduler):
    """The resolved `learning_rate_scheduler` section of a config with these settings."""
    config = load_config_dict(
        {
            "tokens": {"train_steps": train_steps},
            "optimizer": {
                "learning_rate_scheduler": {"learning_rate": PEAK, "min_decay_lr": FLOOR, **scheduler}
            },
            "data": {"dataset_folder": "unused"},
        }
    )
    return config.optimizer.learning_rate_scheduler


def lrs(train_steps: int, **scheduler) -> list[float]:
    """The learning rate of every optimizer step 0 .. train_steps - 1."""
    sched = schedule(train_steps, **scheduler)
    return [lr_at(step, sched, train_steps) for step in range(train_steps)]


def test_linear_warmup_climbs_to_the_peak_at_the_end_of_warmup():
    values = lrs(10, lr_warmup_steps=4)
    assert values[:4] == pytest.approx([PEAK / 4, PEAK / 2, 3 * PEAK / 4, PEAK])


def test_constant_warmup_holds_the_peak():
    values = lrs(10, lr_warmup_steps=4, lr_warmup_style="constant", lr_decay_style="linear")
    assert values[:5] == pytest.approx([PEAK] * 5)
    assert values[5] < PEAK


# Warm-up steps 0-1, decay over steps 2-10: the midpoint of the decay is step 6.
WARMUP = 2
TRAIN_STEPS = 11
MID = 6


@pytest.mark.parametrize(
    ("style", "mid"),
    [
        ("cosine", (PEAK + FLOOR) / 2),
        ("linear", (PEAK + FLOOR) / 2),
        ("1-sqrt", FLOOR + (PEAK - FLOOR) * (1 - math.sqrt(0.5))),
    ],
)
def test_decay_runs_from_the_peak_after_warmup_to_the_floor_at_the_last_step(style, mid):
    values = lrs(TRAIN_STEPS, lr_warmup_steps=WARMUP, lr_decay_style=style)
    assert values[WARMUP] == pytest.approx(PEAK, rel=1e-12)
    assert values[MID] == pytest.approx(mid, rel=1e-12)
    assert values[-1] == pytest.approx(FLOOR, rel=1e-12)
    decay = values[WARMUP:]
    assert all(later < earlier for earlier, later in zip(decay, decay[1:], strict=False))


def test_constant_decay_style_keeps_the_peak_to_the_end():
    values = lrs(TRAIN_STEPS, lr_warmup_steps=WARMUP, lr_decay_style="constant")
    assert values[WARMUP:] == pytest.approx([PEAK] * (TRAIN_STEPS - WARMUP))


def test_decay_starting_step_holds_the_peak_until_then():
    values = lrs(12, lr_warmup_steps=2, lr_decay_starting_step=5, lr_decay_style="linear")
    assert values[:2] == pytest.approx([PEAK / 2, PEAK])
    assert values[2:6] == pytest.approx([PEAK] * 4)  # steps 2-5: warm-up done, decay not started
    assert values[6] < PEAK
    assert values[8] == pytest.approx((PEAK + FLOOR) / 2, rel=1e-12)  # steps 5-11 decay, midpoint 8
    assert values[-1] == pytest.approx(FLOOR, rel=1e-12)


def test_short_decay_reaches_the_floor_and_stays_there():
    values = lrs(20, lr_warmup_steps=2, lr_decay_steps=5, lr_decay_style="linear")
    assert values[2] == pytest.approx(PEAK)
    assert values[6:] == pytest.approx([FLOOR] * 14)  # decay is steps 2-6


def test_schedule_is_a_pure_function_of_the_step():
    sched = schedule(50, lr_warmup_steps=5)
    forward = [lr_at(step, sched, 50) for step in range(50)]
    backward = [lr_at(step, sched, 50) for step in reversed(range(50))]
    assert forward == backward[::-1]  # a resumed run asks for steps out of order and gets the same values
    assert len(set(forward[5:])) == 45  # and it really changes with the step


def test_a_section_built_outside_a_config_resolves_the_same_defaults():
    raw = LRSchedulerArgs(learning_rate=PEAK, min_decay_lr=FLOOR, lr_warmup_steps=WARMUP)
    assert raw.lr_decay_steps is None and raw.lr_decay_starting_step is None
    resolved = lrs(TRAIN_STEPS, lr_warmup_steps=WARMUP)
    assert [lr_at(step, raw, TRAIN_STEPS) for step in range(TRAIN_STEPS)] == pytest.approx(
        resolved, rel=1e-12
    )


@pytest.mark.parametrize("style", ["cosine", "linear", "1-sqrt"])
def test_a_decay_of_one_step_reaches_the_floor(style):
    assert lrs(3, lr_warmup_steps=2, lr_decay_style=style) == pytest.approx([PEAK / 2, PEAK, FLOOR])
