import json
import math
import re
import resource

import pytest
import torch
from helpers import TINY_MODEL

from femtotron.config import load_config_dict
from femtotron.metrics import data_sheet_peak, describe_memory, matmul_flops_rate, memory_gib, peak_flops


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
    cpu = torch.device("cpu")
    shape = (64, 256, 64)
    assert peak_flops(cpu, torch.float32, shape, cache)[0] == 4e11
    second, source = peak_flops(cpu, torch.float32, shape, cache)
    assert second == 4e11  # measured 1e11 while busy: the earlier, faster measurement stands
    assert "the fastest torch.float32 matmul 1024x1024x1024" in source and str(cache) in source
    assert peak_flops(cpu, torch.float32, shape, cache)[0] == 9e11
    [record] = json.loads(cache.read_text()).values()
    assert record["flops"] == 9e11


def test_the_mfu_yardstick_says_when_and_how_it_was_measured_and_is_measured_per_thread_count(
    tmp_path, monkeypatch
):
    """A figure kept for good must say where it came from; one measured with 2 threads is no yardstick for
    a rank running 1 (a launcher's ranks), and an entry of an older femtotron (a bare number) is measured
    again."""
    import femtotron.metrics

    trials = []

    def rate(*args, **kwargs):
        trials.append(kwargs["trials"])
        return 1e11 * torch.get_num_threads()

    monkeypatch.setattr(femtotron.metrics, "matmul_flops_rate", rate)
    cache = tmp_path / "peak_flops.json"
    cpu = torch.device("cpu")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        peak, source = peak_flops(cpu, torch.float32, (64, 256, 64), cache)
        assert peak == 2e11 and trials == [3]
        assert re.search(
            r"with 2 thread\(s\) measured on this machine, on \d{4}-\d\d-\d\d \d\d:\d\d \(the best of 3 "
            r"trial\(s\) of 0.3 s\), kept in .*peak_flops.json: delete it to measure afresh",
            source,
        )
        torch.set_num_threads(1)
        assert peak_flops(cpu, torch.float32, (64, 256, 64), cache)[0] == 1e11 and trials == [3, 3]
        assert peak_flops(cpu, torch.float32, (64, 256, 64), cache)[0] == 1e11 and trials == [3, 3, 1]
        older = {key: record["flops"] for key, record in json.loads(cache.read_text()).items()}
        cache.write_text(json.dumps(older))
        assert peak_flops(cpu, torch.float32, (64, 256, 64), cache)[0] == 1e11 and trials[-1] == 3
    finally:
        torch.set_num_threads(threads)


def test_matmul_flops_rate_is_positive_and_finite():
    rate = matmul_flops_rate(32, 48, 16, torch.float32, torch.device("cpu"), seconds=0.05)
    assert math.isfinite(rate) and rate > 0
    assert 1e6 < rate < 1e14  # FLOP/s: any CPU beats a MFLOP/s, none reaches 100 TFLOP/s


def test_memory_gib_on_cpu_is_the_resident_set():
    memory = memory_gib(torch.device("cpu"))
    assert set(memory) == {"mem_rss_gib"}
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
    assert 0.01 < memory["mem_rss_gib"] <= peak_gib * 1.01  # torch alone takes well over 10 MiB


@pytest.mark.parametrize(
    "name, dtype, tf32, peak",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, True, 989e12),  # the SXM part's name
        ("NVIDIA H100 PCIe", torch.bfloat16, True, 756e12),
        ("NVIDIA H100 NVL", torch.float16, True, 835e12),
        ("NVIDIA H200 NVL", torch.bfloat16, True, 835e12),
        ("NVIDIA H200", torch.bfloat16, True, 989e12),
        ("NVIDIA GH200 480GB", torch.bfloat16, True, 989e12),  # not "H200"
        ("NVIDIA A100-PCIE-40GB", torch.bfloat16, True, 312e12),  # any case
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, True, 312e12),
        ("NVIDIA L40S", torch.bfloat16, True, 362e12),  # not "L4"
        ("NVIDIA L4", torch.bfloat16, True, 121e12),
        ("NVIDIA H100 80GB HBM3", torch.float32, True, 495e12),  # fp32 runs as TF32
        ("NVIDIA H100 PCIe", torch.float32, True, 378e12),
        ("NVIDIA H100 80GB HBM3", torch.float32, False, None),  # plain fp32: measured instead
        ("Tesla V100-SXM2-16GB", torch.float32, True, None),  # no TF32 units
        ("Some Future GPU", torch.bfloat16, True, None),
    ],
)
def test_the_data_sheet_peak_is_the_most_specific_name_s_for_the_run_s_dtype(name, dtype, tf32, peak):
    assert data_sheet_peak(name, dtype, tf32) == peak


class RecordingCuda:
    """Stands in for torch.cuda's memory statistics: peaks that only rise until reset."""

    def __init__(self):
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.calls = []

    def use(self, allocated, reserved):
        self.allocated = allocated
        self.reserved = reserved
        self.peak_allocated = max(self.peak_allocated, allocated)
        self.peak_reserved = max(self.peak_reserved, reserved)

    def max_memory_allocated(self, device):
        self.calls.append("max_memory_allocated")
        return self.peak_allocated

    def max_memory_reserved(self, device):
        self.calls.append("max_memory_reserved")
        return self.peak_reserved

    def mem_get_info(self, device):
        self.calls.append("mem_get_info")
        return 80 * 2**30 - self.reserved, 80 * 2**30

    def reset_peak_memory_stats(self, device):
        self.calls.append("reset_peak_memory_stats")
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved


def test_memory_gib_on_cuda_is_each_record_s_peak_and_the_free_memory():
    cuda = RecordingCuda()
    gpu = torch.device("cuda", 0)
    cuda.use(10 * 2**30, 12 * 2**30)  # step 1 peaks high ...
    cuda.use(2 * 2**30, 12 * 2**30)  # ... and ends low
    assert memory_gib(gpu, cuda) == {
        "mem_peak_allocated_gib": 10.0,
        "mem_peak_reserved_gib": 12.0,
        "mem_free_gib": 68.0,
        "mem_total_gib": 80.0,
    }
    assert cuda.calls[-1] == "reset_peak_memory_stats"  # after reading: the next record is the next peak
    cuda.use(6 * 2**30, 12 * 2**30)
    assert memory_gib(gpu, cuda)["mem_peak_allocated_gib"] == 6.0
    assert describe_memory({"step": 3, **memory_gib(gpu, cuda)}) == (
        "peak allocated 6.00 GiB, peak reserved 12.00 GiB, free 68.00 GiB, total 80.00 GiB"
    )


@pytest.mark.cuda
def test_memory_gib_on_a_real_gpu_reports_the_peak_since_the_last_read():
    gpu = torch.device("cuda")
    memory_gib(gpu)
    scratch = torch.empty(2**28, dtype=torch.uint8, device=gpu)  # 0.25 GiB
    del scratch
    first = memory_gib(gpu)
    second = memory_gib(gpu)  # nothing allocated since the first read: its peak is lower
    assert first["mem_peak_allocated_gib"] - second["mem_peak_allocated_gib"] > 0.24
    assert 0 < first["mem_free_gib"] < first["mem_total_gib"]
