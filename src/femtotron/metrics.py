"""What a training step is measured against: the device's peak FLOP/s (for MFU) and its memory.

Model FLOPs per token come from the model config (`LlamaConfig.flops_per_token`).
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import sys
import time
from pathlib import Path

import torch

from femtotron.atomic import atomic_path

# Dense bf16 tensor-core peaks from the vendors' data sheets (FLOP/s), matched by device name.
PEAK_BF16_FLOPS = {
    "B200": 2.25e15,
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,
    "MI300X": 1307e12,
    "MI250X": 383e12,
}


def matmul_flops_rate(
    m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, seconds: float = 0.3, trials: int = 3
) -> float:
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


def peak_flops(
    device: torch.device, dtype: torch.dtype, gemm_shape: tuple[int, int, int], cache: Path | None = None
) -> tuple[float, str]:
    """The FLOP/s to divide by for MFU, and where the number came from.

    On GPUs the data sheet's peak. Elsewhere a matmul is timed, and a machine that is busy meanwhile only
    makes it slower: so the fastest rate ever measured on this machine for this shape, dtype, thread count
    and torch version is kept in `cache` (default: ~/.cache/femtotron/peak_flops.json) and used when higher.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in PEAK_BF16_FLOPS.items():
            if re.search(rf"\b{re.escape(key)}\b", name):  # whole words: "L4" is not "L40S"
                return flops, f"{name} data-sheet bf16 peak"
    # Tiny debug models' matmuls are dominated by call overhead and would give a "peak" below what the model
    # itself achieves (MFU > 100%): at least 1024 in every dimension; at most 4096 (64 MiB per fp32 operand),
    # which reaches the peak already, whatever the micro-batch.
    m, n, k = (min(max(size, 1024), 4096) for size in gemm_shape)
    what = f"{dtype} matmul {m}x{k}x{n} on {device.type} with {torch.get_num_threads()} thread(s)"
    default = (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "femtotron" / "peak_flops.json"
    )
    cache, key = cache or default, f"{_processor()} | {what} | torch {torch.__version__}"
    try:
        known = json.loads(cache.read_text()) if cache.is_file() else {}
        cached = float(known.get(key, 0.0))
    except (OSError, ValueError, TypeError, AttributeError):  # unreadable or mangled: measure afresh
        known, cached = None, 0.0
    # With a rate on record, one short trial more is enough (0.05 s): the record only ever rises.
    trials, seconds = (1, 0.05) if cached else (3, 0.3)
    best = max(matmul_flops_rate(m, n, k, dtype=dtype, device=device, seconds=seconds, trials=trials), cached)
    unusable = (best, f"{what}, measured now: no cache at {cache}")
    if known is None:
        return unusable
    if best > cached:
        try:
            with atomic_path(cache) as tmp:
                Path(tmp).write_text(json.dumps({**known, key: best}, indent=1))
        except OSError:  # an unwritable home
            return unusable
    return best, f"the fastest {what} measured on this machine, kept in {cache}"


def _processor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def memory_gib(device: torch.device) -> dict[str, float]:
    """Allocated and reserved accelerator memory (their gap is fragmentation), or the process RSS."""
    if device.type == "cuda":
        return {
            "mem_allocated_gib": torch.cuda.memory_allocated(device) / 2**30,
            "mem_reserved_gib": torch.cuda.memory_reserved(device) / 2**30,
        }
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
        return {"mem_rss_gib": resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**30}
    except OSError:  # not Linux: the peak is what the OS reports (bytes on macOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"mem_peak_rss_gib": peak / (2**30 if sys.platform == "darwin" else 2**20)}
