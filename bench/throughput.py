"""Single-process training throughput: femtotron against Hugging Face transformers, same run.

The baseline is `LlamaForCausalLM` trained the way HF's Trainer does with `bf16=True`: fp32
weights under bf16 autocast, fused fp32 AdamW, gradient clipping at 1.0. Both train the same
model shape on the same batch and thread count. The machine is noisy, so trials alternate
(femtotron, HF, femtotron, HF, ...) and the ratio is reported per pair: median and min-max.

It also reports achieved model FLOP/s divided by the rate of the model's own largest matmul
(tokens x hidden -> intermediate) measured here, in the precision the matmuls really run in: bf16
where the CPU has bf16 matrix units, else fp32 (femtotron upcasts bf16 matmuls on such CPUs, see
models/llama.py), i.e. how close training gets to the machine's matmul speed.

A case is SHAPE:PRECISION. bf16 is the comparison above; fp32 compares both in plain fp32 (HF
without autocast), the fair engine-to-engine figure on CPUs that emulate bf16.

`--family` trains each named model family of models/families.py instead (its transformers class against
femtotron's model with the features import-hf gives it), the small shape with the family's own values
(FAMILY_VALUES: Mistral's window half the sequence, Granite's multipliers, 4 experts of which 2 per token),
eager both, in `--family-precision`.

    python bench/throughput.py [--cases small:bf16,wide:fp32] [--pairs 5] [--steps 3] [--threads 2]
    python bench/throughput.py --family all [--family-precision bf16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import headline, median_pair, shape_trainer, write_random_tokens
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from femtotron.metrics import matmul_flops_rate
from femtotron.models.families import BY_MODEL_TYPE
from femtotron.precision import cpu_has_bf16_matmul
from femtotron.serialize.hf import llama_config

SHAPES = {
    # the debug model of examples/debug.yaml
    "small": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=2048,
        sequence_length=128,
        micro_batch_size=16,
    ),
    # matmul-heavy: hidden >= 1024, where GEMMs dominate the step
    "wide": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=2048,
        sequence_length=256,
        micro_batch_size=4,
    ),
}


EXPERTS = {"num_experts_per_tok": 2, "moe_intermediate_size": 344}
# Each family's own config.json values beside the small shape's.
FAMILY_VALUES = {
    "llama": {},
    "mistral": {"sliding_window": 64},
    "qwen2": {},
    "qwen3": {},
    "smollm3": {"no_rope_layer_interval": 2},
    "olmo2": {},
    "granite": dict(
        embedding_multiplier=6.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0
    ),
    "phi3": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 344},
    "qwen3_moe": {"num_experts": 4, **EXPERTS},
    "qwen2_moe": {"num_experts": 4, "shared_expert_intermediate_size": 344, **EXPERTS},
}


def hf_config(shape: dict, family: str | None):
    """transformers' config of `shape`: Llama's, or the family's with its FAMILY_VALUES."""
    values = dict(
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        vocab_size=shape["vocab_size"],
        max_position_embeddings=shape["sequence_length"],
        attn_implementation="sdpa",
        **dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id")),  # not in the small vocabulary
    )
    if family is None:
        return LlamaConfig(**values)
    return AutoConfig.for_model(family, **(values | FAMILY_VALUES[family]))


class HFRun:
    def __init__(self, shape: dict, autocast_bf16: bool, compile: bool = False, family: str | None = None):
        self.shape, self.autocast_bf16 = shape, autocast_bf16
        config = hf_config(shape, family)
        model_class = LlamaForCausalLM if family is None else AutoModelForCausalLM.from_config
        self.model = model_class(config).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.01, fused=True)
        # As HF's Trainer does with torch_compile=True: the whole model through torch.compile.
        self.forward = torch.compile(self.model) if compile else self.model
        self.generator = torch.Generator().manual_seed(0)

    def train_step(self) -> None:
        s = self.shape
        ids = torch.randint(
            1, s["vocab_size"], (s["micro_batch_size"], s["sequence_length"]), generator=self.generator
        )
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast_bf16):
            loss = self.forward(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def timed(step, steps: int, tokens_per_step: int) -> float:
    """Tokens per second over `steps` steps (after the warm-up steps of `warm_up`)."""
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * tokens_per_step / (time.perf_counter() - start)


# What is compared, each against the HF baseline of its row: (numerator, denominator).
RATIOS = (
    ("femtotron", "HF"),
    ("femtotron compiled", "HF"),
    ("femtotron compiled", "HF compiled"),
)


def bench_case(name: str, precision: str, pairs: int, steps: int) -> dict[str, float]:
    """Interleaved rounds of the four variants (femtotron and HF, eager and compiled); returns the median
    ratios by name ("femtotron compiled / HF", ...) and "gemm ratio" (femtotron compiled)."""
    shape = SHAPES[name]
    tokens_per_step = shape["micro_batch_size"] * shape["sequence_length"]
    print(
        f"\n[{name}:{precision}] hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, vocab "
        f"{shape['vocab_size']}, batch {shape['micro_batch_size']} x {shape['sequence_length']}, "
        f"{torch.get_num_threads()} threads, {pairs} rounds of {steps} steps",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "random"
        write_random_tokens(prefix, shape["vocab_size"], 64 * tokens_per_step)
        dtype = {"bf16": "bfloat16", "fp32": "float32"}[precision]
        runs = {
            f"femtotron{' compiled' * c}": shape_trainer(
                shape, dtype, prefix, Path(tmp) / f"runs{c}", model={"compile": c}
            )
            for c in (False, True)
        }
        runs.update(
            {f"HF{' compiled' * c}": HFRun(shape, precision == "bf16", compile=c) for c in (False, True)}
        )
        for what, run in runs.items():  # warm-up: the compiled ones compile here
            start = time.perf_counter()
            run.train_step()
            print(f"  {what}: first step {time.perf_counter() - start:.1f} s", flush=True)
        rates: dict[str, list[float]] = {what: [] for what in runs}
        for round_ in range(pairs):
            for what, run in runs.items():
                rates[what].append(timed(run.train_step, steps, tokens_per_step))
            print(
                f"  round {round_ + 1}: "
                + ", ".join(f"{w} {r[-1]:,.0f}" for w, r in rates.items())
                + " tok/s",
                flush=True,
            )
    for what, r in rates.items():
        print(f"  {what:20} {statistics.median(r):10,.0f} tok/s (median)")
    results = {}
    for ours, theirs in RATIOS:
        ratios = [a / b for a, b in zip(rates[ours], rates[theirs], strict=True)]
        ours_rate, their_rate = median_pair(rates[ours], rates[theirs])
        results[f"{ours} / {theirs}"] = ours_rate / their_rate
        headline(
            f"training tokens/s, {name} {precision}: {ours} / {theirs} (the median round)",
            ours_rate,
            their_rate,
            number_format=",.0f",
        )
        print(
            f"  {ours} / {theirs}: median {statistics.median(ratios):.2f}x  (min {min(ratios):.2f}x, "
            f"max {max(ratios):.2f}x)"
        )
    flops_per_token = runs["femtotron"].config.model.model_config_.flops_per_token(shape["sequence_length"])
    gemm_dtype = torch.bfloat16 if precision == "bf16" and cpu_has_bf16_matmul() else torch.float32
    gemm = matmul_flops_rate(
        tokens_per_step,
        shape["intermediate_size"],
        shape["hidden_size"],
        gemm_dtype,
        torch.device("cpu"),
        seconds=0.5,
    )
    print(
        f"  {gemm_dtype} GEMM {tokens_per_step}x{shape['hidden_size']}->{shape['intermediate_size']}: "
        f"{gemm / 1e9:.1f} GFLOP/s"
    )
    per_gemm = {w: statistics.median(r) * flops_per_token / gemm for w, r in rates.items()}
    print("  achieved model FLOP/s / GEMM rate: " + ", ".join(f"{w} {v:.2f}" for w, v in per_gemm.items()))
    results["gemm ratio"] = per_gemm["femtotron compiled"]
    headline(
        f"model FLOP/s / {gemm_dtype} GEMM rate, {name} {precision}: femtotron compiled",
        statistics.median(rates["femtotron compiled"]) * flops_per_token / 1e9,
        gemm / 1e9,
        unit=" GFLOP/s",
    )
    return results


def bench_family(family: str, precision: str, pairs: int, steps: int) -> float:
    """Eager training of the small shape as `family`: femtotron (the model config import-hf reads from the
    family's config.json) against the family's transformers class, rounds in turn; the median ratio."""
    shape = SHAPES["small"]
    tokens_per_step = shape["micro_batch_size"] * shape["sequence_length"]
    config_json = hf_config(shape, family).to_dict()
    model_config, _ = llama_config(config_json, Path(f"{family} config"))
    print(f"\n[{family}:{precision}] {BY_MODEL_TYPE[family].architecture}, the small shape", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "random"
        write_random_tokens(prefix, shape["vocab_size"], 64 * tokens_per_step)
        dtype = {"bf16": "bfloat16", "fp32": "float32"}[precision]
        model = {"model_config": model_config.model_dump(), "dtype": dtype}
        runs = {
            "femtotron": shape_trainer(shape, dtype, prefix, Path(tmp) / "runs", model=model),
            "HF": HFRun(shape, precision == "bf16", family=family),
        }
        for run in runs.values():
            run.train_step()  # warm-up
        rates: dict[str, list[float]] = {what: [] for what in runs}
        for _ in range(pairs):
            for what, run in runs.items():
                rates[what].append(timed(run.train_step, steps, tokens_per_step))
    ours, theirs = median_pair(rates["femtotron"], rates["HF"])
    print(f"  femtotron {ours:,.0f} tok/s, HF {theirs:,.0f} tok/s: {ours / theirs:.2f}x (the median round)")
    headline(
        f"training tokens/s, {family} small {precision}: femtotron / HF (the median round)",
        ours,
        theirs,
        number_format=",.0f",
    )
    return ours / theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_cases = "small:bf16,wide:bf16" if cpu_has_bf16_matmul() else "small:bf16,small:fp32,wide:fp32"
    parser.add_argument(
        "--cases", default=default_cases, help=f"SHAPE:PRECISION list (default {default_cases})"
    )
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--family", help=f"comma-separated, or all: {', '.join(FAMILY_VALUES)}")
    parser.add_argument("--family-precision", default="bf16" if cpu_has_bf16_matmul() else "fp32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU bf16 matrix units: {'yes' if cpu_has_bf16_matmul() else 'no (bf16 is emulated)'}")
    if args.family:
        families = list(FAMILY_VALUES) if args.family == "all" else args.family.split(",")
        for family in families:
            bench_family(family, args.family_precision, args.pairs, args.steps)
        return
    for case in args.cases.split(","):
        name, precision = case.split(":")
        bench_case(name, precision, args.pairs, args.steps)


if __name__ == "__main__":
    main()
