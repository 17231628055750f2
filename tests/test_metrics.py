import json
import math
import resource

import torch
from helpers import TINY_MODEL

from femtotron.config import load_config_dict
from femtotron.metrics import matmul_flops_rate, memory_gib, peak_flops


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
