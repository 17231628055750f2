"""What a training step costs: model FLOPs, the device's peak, memory, and the run's log.

Console lines carry the rank (`[rank 3 dp1 tp1 pp0]`); the same records go, one JSON object per
line, to `metrics.jsonl` in the run directory.
"""

from __future__ import annotations

import json
import os
import re
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

# Dense bf16 tensor-core peaks from the vendors' data sheets (FLOP/s), matched by device name.
PEAK_BF16_FLOPS = {
    "B200": 2.25e15, "H200": 989e12, "H100": 989e12, "H800": 989e12, "GH200": 989e12,
    "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12,
    "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12, "MI300X": 1307e12, "MI250X": 383e12,
}


def model_flops_per_token(cfg: Any, sequence_length: int) -> float:
    """Forward + backward FLOPs per trained token: 6 per matmul weight, plus causal attention.

    Attention scores and the weighted sum cost 4·s·h per token per layer forward at full width;
    causal masking halves it, and backward doubles the forward (×3 overall): 6·L·s·h.
    """
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * cfg.intermediate_size
    matmul_weights = cfg.num_hidden_layers * per_layer + h * cfg.vocab_size
    return 6.0 * matmul_weights + 6.0 * cfg.num_hidden_layers * sequence_length * h


def matmul_flops_rate(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                      seconds: float = 0.3, trials: int = 3) -> float:
    """Measured FLOP/s of an (m×k)·(k×n) matmul, the yardstick for MFU where no peak is known.

    The best of a few short trials: a busy machine only ever makes a trial slower.
    """
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    a @ b  # warm-up: first call pays for kernel selection
    best = 0.0
    for _ in range(trials):
        iterations, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            iterations += 1
            if device.type == "cuda":
                torch.cuda.synchronize()
        best = max(best, 2.0 * m * n * k * iterations / (time.perf_counter() - start))
    return best


def peak_flops(device: torch.device, dtype: torch.dtype, gemm_shape: tuple[int, int, int]) -> tuple[float, str]:
    """The FLOP/s to divide by for MFU, and where the number came from."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in PEAK_BF16_FLOPS.items():
            if re.search(rf"\b{re.escape(key)}\b", name):  # whole words: "L4" is not "L40S"
                return flops, f"{name} data-sheet bf16 peak"
    # Tiny debug models' matmuls are dominated by call overhead and would give a "peak" below what
    # the model itself achieves (MFU > 100%): measure at least 1024 in every dimension.
    gemm_shape = tuple(max(n, 1024) for n in gemm_shape)
    rate = matmul_flops_rate(*gemm_shape, dtype=dtype, device=device)
    return rate, f"measured {dtype} matmul {gemm_shape[0]}x{gemm_shape[2]}x{gemm_shape[1]} on {device.type}"


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); without it bf16 is emulated."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return True  # not Linux: no way to tell, so do not warn
    return "avx512_bf16" in flags or "amx_bf16" in flags


def memory_gib(device: torch.device) -> dict[str, float]:
    """Allocated and reserved accelerator memory (their gap is fragmentation), or the process RSS."""
    if device.type == "cuda":
        return {"mem_allocated_gib": torch.cuda.memory_allocated(device) / 2**30,
                "mem_reserved_gib": torch.cuda.memory_reserved(device) / 2**30}
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
        return {"mem_rss_gib": resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**30}
    except OSError:  # not Linux: the peak is what the OS reports (bytes on macOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"mem_peak_rss_gib": peak / (2**30 if sys.platform == "darwin" else 2**20)}


class RunLog:
    """Rank-prefixed console lines, and metrics.jsonl, written by the rank that owns the logged loss."""

    def __init__(self, prefix: str, run_dir: Path, is_main: bool, console: bool = True, level: str = "info") -> None:
        self.prefix, self.is_main, self.console, self.level = prefix, is_main, console, level
        self.metrics_path = run_dir / "metrics.jsonl"
        if is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.metrics_path.write_text("")

    def info(self, message: str, every_rank: bool = False) -> None:
        """Print on the main rank (on every rank with `every_rank` or at level debug); tqdm.write keeps the
        progress bar intact."""
        if self.console and self.level in ("debug", "info") and (self.is_main or every_rank or self.level == "debug"):
            self._write(message)

    def warn(self, message: str) -> None:
        if self.console and self.level != "error" and (self.is_main or self.level == "debug"):
            self._write(f"WARNING: {message}")

    def _write(self, message: str) -> None:
        tqdm.write("\n".join(f"{self.prefix} {line}" for line in message.splitlines()), file=sys.stdout)

    def record(self, values: dict[str, Any]) -> None:
        if self.is_main:
            with self.metrics_path.open("a") as f:
                f.write(json.dumps(values) + "\n")
