import json
import math
import resource

import torch
from helpers import TINY_MODEL

from femtotron.config import load_config_dict
from femtotron.metrics import matmul_flops_rate, memory_gib, peak_flops
from femtotron.run_log import RunLog


def tiny_model_config(**overrides):
    model = {**TINY_MODEL, **overrides}
    config = load_config_dict(
        {
            "model": {"model_config": model},
            "tokens": {"train_steps": 1, "sequence_length": 32},
            "data": {"dataset_folder": "unused"},
        }
    )
    return config.model.model_config_


def test_model_flops_per_token_matches_a_hand_count():
    # Per layer: q and o are 64x64, k and v 64x32 (2 KV heads of dim 16), gate/up/down 64x128.
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128
    matmul_weights = 2 * per_layer + 64 * 256  # + lm_head; the embedding lookup is no matmul
    attention = 6 * 2 * 32 * 64  # 6 * layers * sequence * hidden
    assert 6 * matmul_weights + attention == 565_248
    assert tiny_model_config().flops_per_token(32) == 565_248


def test_tied_embeddings_still_pay_for_the_lm_head_matmul():
    assert tiny_model_config(tie_word_embeddings=True).flops_per_token(32) == 565_248


def test_attention_flops_grow_with_the_sequence():
    cfg = tiny_model_config()
    assert cfg.flops_per_token(64) - cfg.flops_per_token(32) == 6 * 2 * 32 * 64


def test_the_mfu_yardstick_is_the_fastest_matmul_ever_measured_on_this_machine(tmp_path, monkeypatch):
    """A busy machine makes one measurement slow, and MFU over 100%: the peak kept per machine only rises."""
    import femtotron.metrics

    cache = tmp_path / "peak_flops.json"
    rates = iter([4e11, 1e11, 9e11])
    monkeypatch.setattr(femtotron.metrics, "matmul_flops_rate", lambda *a, **k: next(rates))
    cpu, shape = torch.device("cpu"), (64, 256, 64)
    assert peak_flops(cpu, torch.float32, shape, cache)[0] == 4e11
    second, source = peak_flops(cpu, torch.float32, shape, cache)
    assert second == 4e11  # measured 1e11 while busy: the earlier, faster measurement stands
    assert "the fastest torch.float32 matmul 1024x1024x1024" in source and str(cache) in source
    assert peak_flops(cpu, torch.float32, shape, cache)[0] == 9e11
    assert json.loads(cache.read_text()) == {next(iter(json.loads(cache.read_text()))): 9e11}


def test_matmul_flops_rate_is_positive_and_finite():
    rate = matmul_flops_rate(32, 48, 16, torch.float32, torch.device("cpu"), seconds=0.05)
    assert math.isfinite(rate) and rate > 0
    assert 1e6 < rate < 1e14  # FLOP/s: any CPU beats a MFLOP/s, none reaches 100 TFLOP/s


def test_memory_gib_on_cpu_is_the_resident_set():
    memory = memory_gib(torch.device("cpu"))
    assert set(memory) == {"mem_rss_gib"}
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
    assert 0.01 < memory["mem_rss_gib"] <= peak_gib * 1.01  # torch alone takes well over 10 MiB


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
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier))
    log = RunLog("[rank 0]", tmp_path, is_main=True)  # a run that may still fail to start
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == earlier
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
