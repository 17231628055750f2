"""The run's log: rank-prefixed console lines, and metrics.jsonl kept across restarts."""

import json

import torch

from femtotron.run_log import RunLog, StepLogger, StepResult


def test_run_log_main_rank_writes_jsonl_and_prefixed_lines(tmp_path, capsys):
    log = RunLog("[rank 0 dp0 tp0 pp0]", tmp_path / "run", is_main=True)
    log.record({"step": 1, "loss": 2.5})
    log.record({"step": 2, "loss": 2.25, "note": "two\nlines"})
    log.info("hello\nworld")
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "loss": 2.5},
        {"step": 2, "loss": 2.25, "note": "two\nlines"},
    ]
    assert capsys.readouterr().out == "[rank 0 dp0 tp0 pp0] hello\n[rank 0 dp0 tp0 pp0] world\n"


def test_run_log_touches_the_metrics_file_only_once_the_run_starts_and_keeps_the_steps_before(tmp_path):
    earlier = [
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 2.0},
        {"step": 2, "val_loss": 2.5},
        {"step": 3, "loss": 1.0},
    ]
    # The attempt that died was killed while writing a line: it is cut short.
    written = "".join(json.dumps(r) + "\n" for r in earlier) + '{"step": 4, "lo'
    (tmp_path / "metrics.jsonl").write_text(written)
    log = RunLog("[rank 0]", tmp_path, is_main=True)  # a run that may still fail to start
    assert (tmp_path / "metrics.jsonl").read_text() == written  # untouched so far
    log.start_at(2)  # resumed from step 2: step 3 of the attempt that died is dropped, the rest kept
    log.record({"step": 3, "loss": 1.5})
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        *earlier[:3],
        {"step": 3, "loss": 1.5},
    ]
    RunLog("[rank 0]", tmp_path, is_main=True).start_at(0)  # a run from scratch keeps nothing
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_run_log_other_ranks_write_nothing_unless_asked(tmp_path, capsys):
    log = RunLog("[rank 3 dp1 tp1 pp0]", tmp_path / "run", is_main=False)
    log.record({"step": 1})
    log.info("only on rank 0")
    assert not (tmp_path / "run").exists()
    assert capsys.readouterr().out == ""
    log.info("a stage report", every_rank=True)
    assert capsys.readouterr().out == "[rank 3 dp1 tp1 pp0] a stage report\n"


def test_run_log_console_off_is_silent_but_still_records(tmp_path, capsys):
    log = RunLog("[rank 0]", tmp_path, is_main=True, console=False)
    log.info("quiet", every_rank=True)
    log.record({"step": 1})
    assert capsys.readouterr().out == ""
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_logged_step_records_the_gpu_s_peak_and_free_memory_and_shows_them(tmp_path, capsys, monkeypatch):
    import femtotron.run_log as run_log

    memory = {
        "mem_peak_allocated_gib": 61.5,
        "mem_peak_reserved_gib": 70.25,
        "mem_free_gib": 8.0,
        "mem_total_gib": 79.2,
    }
    monkeypatch.setattr(run_log, "memory_gib", lambda device: memory)  # what metrics.memory_gib reads on CUDA
    log = RunLog("[rank 0]", tmp_path, is_main=True)
    logger = StepLogger(
        log=log,
        train_steps=10,
        interval=1,
        world_size=1,
        device=torch.device("cuda", 0),
        flops_per_token=1e9,
        peak_flops=1e15,
        peak_source="a data sheet",
    )
    logger(
        1,
        StepResult(loss=5.0, grad_norm=1.0, lr=1e-4, tokens=1000, seconds=0.5, comm_seconds={}),
        consumed_tokens=1000,
    )
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert {k: v for k, v in record.items() if k.startswith("mem_")} == memory
    assert (
        capsys.readouterr()
        .out.rstrip()
        .endswith("| mem peak allocated 61.50 GiB, peak reserved 70.25 GiB, free 8.00 GiB, total 79.20 GiB")
    )


def test_the_step_line_shows_the_first_steps_then_every_interval_with_time_eta_and_tokens(tmp_path, capsys):
    """What nanotron, torchtitan and Megatron users read first: the step's time, the time left (from the
    steps after this process's first, which pays for warming up) and the tokens consumed; and a run that
    logs every 10 steps still says at once that it trains."""
    logger = StepLogger(
        log=RunLog("[rank 0]", tmp_path, is_main=True),
        train_steps=1000,
        interval=10,
        world_size=1,
        device=torch.device("cpu"),
        flops_per_token=1e6,
        peak_flops=1e12,
        peak_source="a test",
    )
    for step in range(101, 121):  # resumed at step 100: this process's first 5 steps are shown
        seconds = 9.0 if step == 101 else 0.25
        result = StepResult(loss=2.0, grad_norm=1.0, lr=1e-4, tokens=2048, seconds=seconds, comm_seconds={})
        logger(step, result, consumed_tokens=2048 * step)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in lines] == [
        f"[rank 0] step {s}/1000" for s in (101, 102, 103, 104, 105, 110, 120)
    ]
    assert " | 9,000 ms | ETA 2:14:51 | 206,848 tokens | " in lines[0]  # only the first step to go by
    assert " | 250 ms | ETA 0:03:44 | 208,896 tokens | " in lines[1]  # 898 steps to go at 0.25 s
    assert " | 250 ms | ETA 0:03:40 | 245,760 tokens | " in lines[-1]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [101, 102, 103, 104, 105, 110, 120]
    assert records[-1]["consumed_tokens"] == 2048 * 120 and records[-1]["eta_seconds"] == 880 * 0.25
