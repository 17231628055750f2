"""Single-process training throughput: femtotron against Hugging Face transformers, same run.

The baseline is `LlamaForCausalLM` trained the way HF's Trainer does with `bf16=True`: fp32
weights under bf16 autocast, fused fp32 AdamW, gradient clipping at 1.0. Both train the same
model shape on the same batch and thread count. The machine is noisy, so trials alternate
(femtotron, HF, femtotron, HF, ...) and the ratio is reported per pair: median and min-max.

It also reports, for each model, achieved model FLOP/s divided by the bf16 rate of the model's
own largest matmul measured here (tokens x intermediate x hidden), i.e. how close training gets
to the machine's matmul speed.

    python bench/throughput.py [--pairs 5] [--steps 6] [--threads 2] [--only small|wide]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from femtotron.config import load_config_dict
from femtotron.data.indexed import IndexedDatasetWriter
from femtotron.metrics import matmul_flops_rate, model_flops_per_token
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer

SHAPES = {
    # the debug model of examples/debug.yaml
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=2048, sequence_length=128, micro_batch_size=16),
    # matmul-heavy: hidden >= 1024, where GEMMs dominate the step
    "wide": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=8, vocab_size=2048, sequence_length=256, micro_batch_size=4),
}


def write_random_tokens(prefix: Path, vocab: int, tokens: int) -> None:
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(8):
        writer.add_document(rng.integers(1, vocab, tokens // 8, dtype=np.uint16))
    writer.finalize()


def femtotron_trainer(shape: dict, data_prefix: Path, run_dir: Path) -> Trainer:
    model_keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size")
    config = load_config_dict({
        "general": {"run": "bench"},
        "model": {"model_config": {**{k: shape[k] for k in model_keys},
                                   "max_position_embeddings": shape["sequence_length"]}},
        "tokens": {"sequence_length": shape["sequence_length"], "micro_batch_size": shape["micro_batch_size"],
                   "train_steps": 10**6},
        "data": {"dataset_folder": str(data_prefix)},
        "logging": {"output_dir": str(run_dir)},
        "checkpoints": {"save_final_state": False},
    })
    return Trainer(config, ParallelContext(), log_to_console=False)


class HFRun:
    def __init__(self, shape: dict) -> None:
        self.shape = shape
        self.model = LlamaForCausalLM(LlamaConfig(
            hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
            num_hidden_layers=shape["num_hidden_layers"], num_attention_heads=shape["num_attention_heads"],
            num_key_value_heads=shape["num_key_value_heads"], vocab_size=shape["vocab_size"],
            max_position_embeddings=shape["sequence_length"], attn_implementation="sdpa",
        )).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.01, fused=True)
        self.generator = torch.Generator().manual_seed(0)

    def train_step(self) -> None:
        s = self.shape
        ids = torch.randint(1, s["vocab_size"], (s["micro_batch_size"], s["sequence_length"]), generator=self.generator)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def timed(step, steps: int, tokens_per_step: int) -> float:
    """Tokens per second over `steps` steps, after one warm-up step."""
    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * tokens_per_step / (time.perf_counter() - start)


def bench_shape(name: str, shape: dict, pairs: int, steps: int) -> None:
    tokens_per_step = shape["micro_batch_size"] * shape["sequence_length"]
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "random"
        write_random_tokens(prefix, shape["vocab_size"], 64 * tokens_per_step)
        ours, theirs = femtotron_trainer(shape, prefix, Path(tmp) / "runs"), HFRun(shape)
        rates = []
        for _ in range(pairs):
            rates.append((timed(ours.train_step, steps, tokens_per_step),
                          timed(theirs.train_step, steps, tokens_per_step)))
    ratios = [a / b for a, b in rates]
    flops_per_token = model_flops_per_token(ours.config.model.model_config_, shape["sequence_length"])
    gemm = matmul_flops_rate(tokens_per_step, shape["intermediate_size"], shape["hidden_size"], torch.bfloat16,
                             torch.device("cpu"), seconds=1.0)
    ours_tps = statistics.median(a for a, _ in rates)
    theirs_tps = statistics.median(b for _, b in rates)
    print(f"\n[{name}] hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, vocab "
          f"{shape['vocab_size']}, batch {shape['micro_batch_size']} x {shape['sequence_length']}, "
          f"{torch.get_num_threads()} threads, {pairs} pairs of {steps} steps")
    print(f"  femtotron       {ours_tps:10,.0f} tok/s (median)")
    print(f"  HF transformers {theirs_tps:10,.0f} tok/s (median)")
    print(f"  ratio femtotron/HF: median {statistics.median(ratios):.2f}x  (min {min(ratios):.2f}x, "
          f"max {max(ratios):.2f}x; pairs: {', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"  bf16 GEMM {tokens_per_step}x{shape['hidden_size']}x{shape['intermediate_size']}: {gemm / 1e12:.3f} TFLOP/s")
    print(f"  achieved model FLOP/s / GEMM rate: femtotron {ours_tps * flops_per_token / gemm:.2f}, "
          f"HF {theirs_tps * flops_per_token / gemm:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=sorted(SHAPES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name, shape in SHAPES.items():
        if args.only in (None, name):
            bench_shape(name, shape, args.pairs, args.steps)


if __name__ == "__main__":
    main()
