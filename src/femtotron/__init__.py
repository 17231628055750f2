"""femtotron: pretrain LLaMA-style models with data, tensor and pipeline parallelism and ZeRO-1."""

__version__ = "0.1.0"
