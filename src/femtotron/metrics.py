"""What a training step is measured against: the device's peak FLOP/s (for MFU) and its memory.
(Model FLOPs per token come from the model config, `LlamaConfig.flops_per_token`.)"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from femtotron.atomic import atomic_path
from femtotron.precision import CPU_FLAGS

# Dense tensor-core peaks from the vendors' data sheets (FLOP/s): (bf16 and fp16, TF32 or None where the GPU
# has no TF32), matched by device name as whole words, the first match counting: so variants come before
# the bare name ("H100 PCIe" before "H100", which is the SXM part). TF32 is what fp32 matmuls run as on
# CUDA (precision.tf32_for_fp32). The V100 figure is fp16 (it has no bf16 units).
DATA_SHEET_PEAKS: dict[str, tuple[float, float | None]] = {
    "B200": (2.25e15, 1.12e15),
    "H200 NVL": (835e12, 418e12),
    "H200": (989e12, 495e12),
    "H100 NVL": (835e12, 418e12),
    "H100 PCIe": (756e12, 378e12),
    "H100": (989e12, 495e12),
    "H800 PCIe": (756e12, 378e12),
    "H800": (989e12, 495e12),
    "GH200": (989e12, 495e12),
    "A100": (312e12, 156e12),  # SXM and PCIe alike
    "A800": (312e12, 156e12),
    "L40S": (362e12, 183e12),
    "L4": (121e12, 60e12),
    "A10G": (70e12, 35e12),
    "RTX 4090": (165e12, 83e12),
    "RTX 3090": (71e12, 36e12),
    "V100": (125e12, None),
    "MI300X": (1307e12, None),  # TF32 only with HIPBLASLT_ALLOW_TF32=1
    "MI250X": (383e12, None),
}


def data_sheet_peak(name: str, dtype: torch.dtype, tf32: bool) -> float | None:
    """The data-sheet peak of GPU `name` for matmuls in `dtype` (fp32 with `tf32`: the TF32 peak), or None
    where the table has none (fp32 without TF32: plain fp32 runs on CUDA cores, not tensor cores)."""
    # Whole words: "L4" is not "L40S".
    match = (p for key, p in DATA_SHEET_PEAKS.items() if re.search(rf"\b{re.escape(key)}\b", name, re.I))
    half, tf32_peak = next(match, (None, None))
    if dtype in (torch.bfloat16, torch.float16):
        return half
    return tf32_peak if dtype == torch.float32 and tf32 else None


def matmul_flops_rate(
    m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, seconds: float = 0.3, trials: int = 3
) -> float:
    """Measured FLOP/s of an (m×k)·(k×n) matmul, the yardstick for MFU where no peak is known: the best of
    a few short trials (a busy machine only ever makes a trial slower)."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    a @ b  # warm-up: first call pays for kernel selection
    best = 0.0
    for _ in range(trials):
        iterations = 0
        start = time.perf_counter()
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
    """The FLOP/s to divide by for MFU, and its source: on known GPUs the data sheet's peak for `dtype`; else
    the fastest rate of a timed matmul ever measured here for this shape, dtype, thread count and torch
    version (a busy machine only slows it), kept in `cache` (default ~/.cache/femtotron/peak_flops.json)
    with when it was measured and how."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        # Read with torch's newer API, which also reports the older one's setting (not the reverse).
        tf32 = torch.backends.cuda.matmul.fp32_precision == "tf32"
        peak = data_sheet_peak(name, dtype, tf32)
        if peak is not None:
            return peak, f"{name} data-sheet {'TF32' if dtype == torch.float32 else 'bf16/fp16'} peak"
    # Tiny debug models' matmuls are dominated by call overhead and would give a "peak" below what the model
    # itself achieves (MFU > 100%): at least 1024 in every dimension; at most 4096 (64 MiB per fp32 operand),
    # which reaches the peak already, whatever the micro-batch.
    m, n, k = (min(max(size, 1024), 4096) for size in gemm_shape)
    # The thread count is this process's: ranks started by a launcher run 1 thread each (OMP_NUM_THREADS=1).
    what = f"{dtype} matmul {m}x{k}x{n} on {device.type} with {torch.get_num_threads()} thread(s)"
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cache = cache or home / "femtotron" / "peak_flops.json"
    key = f"{processor_name()} | {what} | torch {torch.__version__}"
    try:
        known = json.loads(cache.read_text()) if cache.is_file() else {}
    except (OSError, ValueError):
        known = None
    if not isinstance(known, dict):  # unreadable or mangled: measured now, the file left as it is
        known = None
    try:
        record = known[key]
        cached = float(record["flops"])
        record = {"flops": cached, "measured": str(record["measured"]), "how": str(record["how"])}
    except (TypeError, KeyError, ValueError):  # none yet, or an older entry (a bare number): measure afresh
        cached = 0.0
    # With a rate on record, one short trial more is enough (0.05 s): the record only ever rises.
    if cached:
        trials = 1
        seconds = 0.05
    else:
        trials = 3
        seconds = 0.3
    measured = matmul_flops_rate(m, n, k, dtype=dtype, device=device, seconds=seconds, trials=trials)
    if measured > cached:
        record = {
            "flops": measured,
            "measured": time.strftime("%Y-%m-%d %H:%M"),
            "how": f"the best of {trials} trial(s) of {seconds:g} s",
        }
    unusable = (measured, f"the fastest {what}, measured now ({record['how']}): no cache at {cache}")
    if known is None:
        return unusable
    if measured > cached:
        try:
            with atomic_path(cache) as tmp:
                Path(tmp).write_text(json.dumps({**known, key: record}, indent=1))
        except OSError:  # an unwritable home
            return unusable
    return record["flops"], (
        f"the fastest {what} measured on this machine, on {record['measured']} ({record['how']}), kept in "
        f"{cache}: delete it to measure afresh"
    )


def processor_name() -> str:
    lines = CPU_FLAGS.splitlines()
    names = (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    return next(names, "") or platform.processor()


def memory_gib(device: torch.device, cuda: Any = torch.cuda) -> dict[str, float]:
    """On CUDA the peaks since the last call (read, then reset) and the GPU's free and total memory as the
    driver sees it; elsewhere the process's resident set. `cuda`: torch.cuda, or a stand-in for tests."""
    if device.type == "cuda":
        free, total = cuda.mem_get_info(device)
        memory = {  # peak reserved well above peak allocated: fragmentation
            "mem_peak_allocated_gib": cuda.max_memory_allocated(device) / 2**30,
            "mem_peak_reserved_gib": cuda.max_memory_reserved(device) / 2**30,
            "mem_free_gib": free / 2**30,
            "mem_total_gib": total / 2**30,
        }
        cuda.reset_peak_memory_stats(device)
        return memory
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
        return {"mem_rss_gib": resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**30}
    except OSError:  # not Linux: the peak is what the OS reports (bytes on macOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"mem_peak_rss_gib": peak / (2**30 if sys.platform == "darwin" else 2**20)}


def describe_memory(memory: dict[str, float]) -> str:
    """The `mem_` figures of `memory_gib` (or a record) in words: "peak allocated 12.10 GiB, ..."."""
    return ", ".join(
        f"{key.removeprefix('mem_').removesuffix('_gib').replace('_', ' ')} {value:.2f} GiB"
        for key, value in memory.items()
        if key.startswith("mem_")
    )
