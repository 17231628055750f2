"""model.compile: each decoder layer through torch.compile (TorchInductor: C++ on CPUs, Triton on GPUs),
fusing its elementwise work; its tp collectives cut it into compiled regions (tensor_parallel._conjugates).
At tp = 1 so are the last stage's norm, LM head and loss; the rest is eager, with the same modules and
names. Shapes are static: one compile at the first call with gradients (step 1), one without (validation).
"""

from __future__ import annotations

import torch
from torch import nn

from femtotron.diagnostics.compile_check import require_cpp_compiler, require_gpu_compilers


def compile_layers(chunks: list[nn.Module], device: torch.device) -> None:
    """Mark each decoder layer of this rank's model chunks for compiling at its first call."""
    if device.type == "cpu":
        require_cpp_compiler()
    elif device.type == "cuda":
        require_gpu_compilers()
    for chunk in chunks:
        for layer in chunk.layers.values():
            layer.compile(dynamic=False)
        if chunk.stage.head and chunk.tp.size == 1:  # at tp > 1 the loss is collectives around little compute
            chunk.head_loss = torch.compile(chunk.head_loss, dynamic=False)
