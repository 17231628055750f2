"""Mixture of experts on one device: femtotron's grouped-GEMM experts against a loop over the experts and
against transformers' MixtralForCausalLM, the same model and batch.

Each timed step is forward + backward of the whole model (the same weights: femtotron's exported with the HF
mapping, checked to give the same logits first). The three alternate (grouped, loop, HF, grouped, ...); the
ratio is per round, its median and min-max reported. The loop swaps femtotron's grouped GEMM for a matmul per
expert (what transformers' experts do), so its ratio isolates the kernel; HF's ratio is the whole model.
`make gpu-check` runs it on the GPU in bf16 (`measure`).

    python bench/moe.py [--quick] [--rounds 5] [--threads 2] [--device cpu|cuda] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.nn.functional as F
import transformers
from common import headline, median_pair
from packaging.version import Version
from safetensors.torch import save_file
from transformers import MixtralConfig, MixtralForCausalLM

import femtotron.parallel.split_backward as experts_matmul  # models/moe.py's Experts call its grouped_linear
from femtotron.config import LlamaConfig
from femtotron.models.hf_conversion import to_hf
from femtotron.models.llama import Llama

SHAPE = dict(
    hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, vocab_size=2048
)
MOE = dict(num_experts=8, num_experts_per_tok=2, intermediate_size=1024, aux_loss_coef=0.0)
# from_pretrained's keyword for the weights' dtype: transformers 4.56 renamed torch_dtype to dtype, and before
# it ignores dtype= (the model stays in fp32).
DTYPE_KEYWORD = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def loop_over_experts(rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    return torch.cat([F.linear(part, w) for part, w in zip(rows.split(counts), weight, strict=True)])


def measure(
    shape: dict, moe: dict, batch: int, sequence: int, rounds: int, device: torch.device, dtype: torch.dtype
) -> dict[str, list[float]]:
    """Seconds per step of each variant ("grouped", "loop", "hf"), one entry per round."""
    cfg = LlamaConfig(
        **shape, intermediate_size=moe["intermediate_size"], max_position_embeddings=sequence, moe=moe
    )
    ours = Llama(cfg, std=0.02, seed=0, dtype=dtype, device=device)
    ours.router_stats.reset(gradient_scale=1.0)
    hf_config = MixtralConfig(
        **shape,
        intermediate_size=moe["intermediate_size"],
        num_local_experts=moe["num_experts"],
        num_experts_per_tok=moe["num_experts_per_tok"],
        max_position_embeddings=sequence,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
    )
    with tempfile.TemporaryDirectory() as tmp:  # femtotron's weights, as a Mixtral checkpoint holds them
        hf_config.save_pretrained(tmp)
        weights = to_hf({n: p.detach().cpu() for n, p in ours.named_parameters()}, cfg)
        save_file(weights, f"{tmp}/model.safetensors")
        hf = MixtralForCausalLM.from_pretrained(tmp, **{DTYPE_KEYWORD: dtype}).to(device)
    loaded = sorted({str(p.dtype) for p in hf.parameters()})
    if loaded != [str(dtype)]:
        raise RuntimeError(
            f"HF MixtralForCausalLM's parameters are in {', '.join(loaded)}, not the requested {dtype}: "
            f"transformers {transformers.__version__} did not apply from_pretrained({DTYPE_KEYWORD}=...), so "
            "the comparison would be against another dtype: set DTYPE_KEYWORD in bench/moe.py to the keyword "
            "this version takes"
        )
    ids = torch.randint(0, cfg.vocab_size, (batch, sequence), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    with torch.no_grad():  # the same model: the same logits (bf16: within its rounding)
        ours_logits, hf_logits = ours.logits(ids[:1]).float(), hf(ids[:1]).logits.float()
        assert (ours_logits - hf_logits).abs().max() <= (
            1e-4 if dtype == torch.float32 else 0.1
        ) * hf_logits.abs().max()
    grouped = experts_matmul.grouped_linear

    def femtotron_step(kernel) -> None:
        experts_matmul.grouped_linear = kernel
        loss, count = ours(ids, ids)
        (loss / count).backward()
        experts_matmul.grouped_linear = grouped

    def hf_step() -> None:
        hf(input_ids=ids, labels=ids).loss.backward()

    steps = {
        "grouped": lambda: femtotron_step(grouped),
        "loop": lambda: femtotron_step(loop_over_experts),
        "hf": hf_step,
    }
    for step in steps.values():
        step()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - start)
    return times


def ratio_lines(times: dict[str, list[float]]) -> list[tuple[str, float, float, list[float]]]:
    """(baseline, femtotron's seconds and the baseline's in the median round, the per-round ratios) for
    "loop" and "hf"."""
    return [
        (
            name,
            *median_pair(times["grouped"], times[name]),
            [g / o for g, o in zip(times["grouped"], times[name], strict=True)],
        )
        for name in ("loop", "hf")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, 3 rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--sequence", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    shape = {**SHAPE, "num_hidden_layers": 2} if args.quick else SHAPE
    rounds = 3 if args.quick else args.rounds
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    times = measure(shape, MOE, args.batch, args.sequence, rounds, device, dtype)
    print(
        f"hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, top-"
        f"{MOE['num_experts_per_tok']} of {MOE['num_experts']} experts of {MOE['intermediate_size']}, "
        f"{args.batch * args.sequence} tokens, {args.dtype} on {args.device}, {args.threads} threads, "
        f"{rounds} rounds"
    )
    for name, ours, theirs, ratios in ratio_lines(times):
        print(
            f"  grouped GEMM {ours * 1e3:.0f} ms, {name} {theirs * 1e3:.0f} ms (the median round): "
            f"{ours / theirs:.2f}x (min {min(ratios):.2f}, max {max(ratios):.2f})"
        )
        label = "a loop over the experts" if name == "loop" else "HF MixtralForCausalLM's"
        headline(
            f"MoE step time (fwd+bwd, {args.dtype}) / {label} (ms, the median round)",
            ours * 1e3,
            theirs * 1e3,
            number_format=".0f",
        )


if __name__ == "__main__":
    main()
