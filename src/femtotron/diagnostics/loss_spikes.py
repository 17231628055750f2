"""Loss spikes (N4): log them without stopping; warn when they persist.

A spike is a loss far above the running median of the recent steps: more than `threshold` times
their median absolute deviation above it, and at least 10% above it (so a flat, noiseless loss does
not count every wiggle). An isolated spike that recovers is normal in pretraining and is only
logged; when several of the recent steps are spikes, the warning says what to look at.
"""

from __future__ import annotations

import statistics
from collections import deque


class LossSpikes:
    def __init__(self, window: int = 50, threshold: float = 6.0, persistent: int = 5) -> None:
        self.losses: deque[float] = deque(maxlen=window)
        self.recent: deque[bool] = deque(maxlen=10)  # spike flags of the last steps
        self.threshold = threshold
        self.persistent = persistent

    def observe(self, step: int, loss: float) -> str | None:
        """Record a step's loss; return a warning when it is a spike, or None."""
        spike = False
        if len(self.losses) >= 10:
            median = statistics.median(self.losses)
            deviation = statistics.median(abs(x - median) for x in self.losses)
            spike = loss > median + max(self.threshold * deviation, 0.1 * abs(median))
        self.recent.append(spike)
        if not spike:
            self.losses.append(loss)  # spikes stay out of the baseline they are measured against
            return None
        message = f"step {step}: loss spike, {loss:.4f} against a running median of {median:.4f}"
        if sum(self.recent) >= self.persistent:
            return (
                f"{message}; {sum(self.recent)} of the last {len(self.recent)} steps spiked, so it is not "
                "recovering: lower optimizer.learning_rate_scheduler.learning_rate, keep optimizer.clip_grad "
                "at 1.0, and check the data around these steps (`femtotron inspect-data`)"
            )
        return f"{message} (isolated spikes that recover are normal; it is logged, not acted on)"
