"""model.compile: each decoder layer through torch.compile (TorchInductor: C++ on CPUs, Triton on GPUs), so
its elementwise work (RMSNorm, rotary, SiLU, residual adds, casts) runs as fused kernels. A layer's tp
collectives cut it into compiled regions (tensor_parallel._conjugates); the rest (embedding,
LM head, loss, pipeline, dp, ZeRO, recomputation, checkpoints) is eager and sees the same modules and
parameter names. Shapes are static, so a layer compiles at its first call with gradients (step 1), once
more at its first without (validation), and never again.
"""

from __future__ import annotations

import torch
from torch import nn

from femtotron.diagnostics.compile_check import require_cpp_compiler


def compile_layers(chunks: list[nn.Module], device: torch.device) -> None:
    """Mark each decoder layer of this rank's model chunks for compiling at its first call."""
    if device.type == "cpu":
        require_cpp_compiler()
    for chunk in chunks:
        for layer in chunk.layers.values():
            layer.compile(dynamic=False)
