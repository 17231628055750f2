"""Mixture of experts on one process: femtotron's grouped-GEMM experts against a loop over the experts and
against transformers' MixtralForCausalLM, the same model and batch.

Each timed step is forward + backward of the whole model (fp32, the same weights: femtotron's converted with
the HF mapping). The three alternate (grouped, loop, HF, grouped, ...); the ratio is per round, its median
and min-max reported. The loop swaps femtotron's grouped GEMM for a matmul per expert (what transformers'
experts do), so its ratio isolates the kernel; HF's ratio is the whole model.

    python bench/moe.py [--quick] [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from common import headline
from safetensors.torch import save_file
from transformers import MixtralConfig, MixtralForCausalLM

import femtotron.models.moe as moe_module
from femtotron.config import LlamaConfig
from femtotron.models.hf_conversion import to_hf
from femtotron.models.llama import Llama

SHAPE = dict(
    hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, vocab_size=2048
)
MOE = dict(num_experts=8, num_experts_per_tok=2, intermediate_size=1024, aux_loss_coef=0.0)


def loop_over_experts(rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    return torch.cat([F.linear(part, w) for part, w in zip(rows.split(counts), weight, strict=True)])


def timed(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, 3 rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--sequence", type=int, default=256)
    args = parser.parse_args()
    shape = {**SHAPE, "num_hidden_layers": 2} if args.quick else SHAPE
    rounds = 3 if args.quick else args.rounds
    torch.set_num_threads(args.threads)
    cfg = LlamaConfig(**shape, intermediate_size=1024, max_position_embeddings=args.sequence, moe=MOE)
    ours = Llama(cfg, std=0.02, seed=0, dtype=torch.float32, device=torch.device("cpu"))
    ours.router_stats.reset(gradient_scale=1.0)
    hf_config = MixtralConfig(
        **shape,
        intermediate_size=MOE["intermediate_size"],
        num_local_experts=MOE["num_experts"],
        num_experts_per_tok=MOE["num_experts_per_tok"],
        max_position_embeddings=args.sequence,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
    )
    with tempfile.TemporaryDirectory() as tmp:  # femtotron's weights, as a Mixtral checkpoint holds them
        hf_config.save_pretrained(tmp)
        save_file(to_hf({n: p.detach() for n, p in ours.named_parameters()}, cfg), f"{tmp}/model.safetensors")
        hf = MixtralForCausalLM.from_pretrained(tmp).float()
    ids = torch.randint(
        0, cfg.vocab_size, (args.batch, args.sequence), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():  # the same model: the same logits
        assert torch.allclose(ours.logits(ids[:1]), hf(ids[:1]).logits, atol=1e-4)
    grouped = moe_module.grouped_linear

    def femtotron_step(kernel) -> None:
        moe_module.grouped_linear = kernel
        loss, count = ours(ids, ids)
        (loss / count).backward()
        moe_module.grouped_linear = grouped

    def hf_step() -> None:
        hf(input_ids=ids, labels=ids).loss.backward()

    for step in (lambda: femtotron_step(grouped), lambda: femtotron_step(loop_over_experts), hf_step):
        step()  # warm-up
    times = {"grouped": [], "loop": [], "hf": []}
    for _ in range(rounds):
        times["grouped"].append(timed(lambda: femtotron_step(grouped)))
        times["loop"].append(timed(lambda: femtotron_step(loop_over_experts)))
        times["hf"].append(timed(hf_step))
    tokens = args.batch * args.sequence
    print(
        f"hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, top-"
        f"{MOE['num_experts_per_tok']} of {MOE['num_experts']} experts of {MOE['intermediate_size']}, "
        f"{tokens} tokens, fp32, "
        f"{args.threads} threads, {rounds} rounds"
    )
    median = {name: statistics.median(values) for name, values in times.items()}
    for name in ("loop", "hf"):
        ratios = [g / other for g, other in zip(times["grouped"], times[name], strict=True)]
        print(
            f"  grouped GEMM {median['grouped'] * 1e3:.0f} ms, {name} {median[name] * 1e3:.0f} ms: "
            f"{statistics.median(ratios):.2f}x (min {min(ratios):.2f}, max {max(ratios):.2f})"
        )
        label = "a loop over the experts" if name == "loop" else "HF MixtralForCausalLM's"
        headline(
            f"MoE step time (fwd+bwd, fp32) / {label} (ms)",
            f"{median['grouped'] * 1e3:.0f}",
            f"{median[name] * 1e3:.0f}",
            statistics.median(ratios),
        )


if __name__ == "__main__":
    main()
