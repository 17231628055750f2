import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed  # each case starts a process

POINT = "from femtotron.crash_points import crash_point; crash_point('test.point'); print('survived')"


def run_point(**environment: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith("FEMTOTRON_CRASH")}
    env.update(environment)
    return subprocess.run([sys.executable, "-c", POINT], env=env, capture_output=True, text=True, timeout=60)


def test_a_named_point_kills_with_sigkill():
    result = run_point(FEMTOTRON_CRASH_AT="test.point")
    assert result.returncode == -signal.SIGKILL
    assert "survived" not in result.stdout


@pytest.mark.parametrize(
    "environment",
    [
        {},
        {"FEMTOTRON_CRASH_AT": "other.point"},
        {"FEMTOTRON_CRASH_AT": "test.point", "FEMTOTRON_CRASH_RANK": "1"},
    ],
)
def test_other_points_and_other_ranks_run_on(environment):
    result = run_point(**environment)
    assert result.returncode == 0
    assert "survived" in result.stdout


def test_the_named_rank_is_killed():
    result = run_point(FEMTOTRON_CRASH_AT="test.point", FEMTOTRON_CRASH_RANK="1", RANK="1")
    assert result.returncode == -signal.SIGKILL
