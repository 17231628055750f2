"""N4: loss spikes are logged, not acted on; persistent ones get advice."""

import math

from femtotron.diagnostics.loss_spikes import LossSpikes


def noisy_decline(steps):
    return [3.0 - 0.01 * i + 0.02 * math.sin(i) for i in range(steps)]


def test_N4_a_spike_that_recovers_is_logged_without_advice():
    spikes = LossSpikes()
    warnings = [spikes.observe(i + 1, loss) for i, loss in enumerate(noisy_decline(30))]
    assert warnings == [None] * 30  # ordinary noise is not a spike
    warning = spikes.observe(31, 4.5)
    assert warning.startswith("step 31: loss spike, 4.5000 against a running median of")
    assert "isolated spikes that recover are normal" in warning
    assert spikes.observe(32, 2.7) is None  # recovered


def test_N4_persistent_spikes_get_a_warning_with_advice():
    spikes = LossSpikes()
    for i, loss in enumerate(noisy_decline(30)):
        spikes.observe(i + 1, loss)
    warnings = [spikes.observe(31 + i, 5.0 + 0.1 * i) for i in range(5)]
    assert all(w is not None for w in warnings)
    assert "5 of the last 10 steps spiked, so it is not recovering" in warnings[-1]
    assert "learning_rate" in warnings[-1] and "inspect-data" in warnings[-1]
