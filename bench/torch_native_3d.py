"""dp x tp x pp = 2 x 2 x 2 on 8 CPU processes: femtotron against the same model assembled from PyTorch's own
parts, trained in the same processes, step for step.

The reference is Hugging Face's `LlamaForCausalLM` of the same shape, split into two pipeline stages by
layer (the embedding and the first half of the layers; the rest, the final norm and the LM head),
each stage's layers parallelised over tp by DTensor (`torch.distributed.tensor.parallel`: column-wise
q/k/v/gate/up, row-wise o/down, a vocabulary-split embedding and LM head, the logits gathered for the loss),
run by `torch.distributed.pipelining`'s `Schedule1F1B`, its gradients all-reduced over dp parameter by
parameter, then `torch.optim.AdamW` and clipping at 1.0. femtotron trains the same shape and global
batch at the same layout: 1F1B, `tp_mode: ALL_REDUCE`, fp32, buckets reduced over dp during backward.

Both live in the same 8 processes (femtotron's ParallelContext and a DeviceMesh over the same process group,
ranks in the same order) and take turns step by step; the step time of a rank is the wall time from a
barrier to the end of its step, the slowest rank counts, and the median over the steps is compared.

    python bench/torch_native_3d.py [--steps 6] [--layers 4] [--micro-batches 4] [--timeout 600]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import (
    DEBUG_SHAPE,
    MODEL_KEYS,
    headline,
    median_pair,
    shape_config,
    spawn_ranks,
    write_random_tokens,
)
from torch import nn

from femtotron.trainer import Trainer

SHAPE = {**DEBUG_SHAPE, "num_hidden_layers": 4, "micro_batch_size": 4}
LAYOUT = {"dp": 2, "tp": 2, "pp": 2}


def femtotron_config(args):
    shape = {**SHAPE, "num_hidden_layers": args.layers}
    model_config = {k: shape[k] for k in MODEL_KEYS}
    return shape_config(
        shape,
        "float32",
        args.data,
        args.runs,
        "native-3d",
        model={
            "model_config": {
                **model_config,
                "max_position_embeddings": shape["sequence_length"],
                "tie_word_embeddings": False,
            },
            "dtype": "float32",
        },
        parallelism={**LAYOUT, "pp_engine": "1f1b", "tp_mode": "ALL_REDUCE"},
        tokens={"batch_accumulation_per_replica": args.micro_batches},
    )


class HFStage(nn.Module):
    """Layers [first, last) of an HF Llama, with the embedding on the first stage and the norm and head on
    the last: token ids or hidden states in, hidden states or logits out."""

    def __init__(self, hf: nn.Module, layers: range, embedding: bool, head: bool) -> None:
        super().__init__()
        self.embed_tokens = hf.model.embed_tokens if embedding else None
        self.layers = nn.ModuleList(hf.model.layers[i] for i in layers)
        self.rotary_emb = hf.model.rotary_emb
        self.norm, self.lm_head = (hf.model.norm, hf.lm_head) if head else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(h.shape[1]).unsqueeze(0)
        rotary = self.rotary_emb(h, positions)
        for layer in self.layers:
            h = layer(h, position_embeddings=rotary, position_ids=positions)
        return self.lm_head(self.norm(h)) if self.lm_head is not None else h


def torch_native(ctx, args):
    """This rank's stage of the reference, its pipeline schedule, optimizer and dp group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaConfig, LlamaForCausalLM

    mesh = init_device_mesh(
        "cpu", (LAYOUT["pp"], LAYOUT["dp"], LAYOUT["tp"]), mesh_dim_names=("pp", "dp", "tp")
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(
        LlamaConfig(
            **{**{k: SHAPE[k] for k in MODEL_KEYS}, "num_hidden_layers": args.layers},
            max_position_embeddings=SHAPE["sequence_length"],
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )
    )
    pp_rank, half = mesh["pp"].get_local_rank(), args.layers // 2
    layers = range(0, half) if pp_rank == 0 else range(half, args.layers)
    stage_module = HFStage(hf, layers, embedding=pp_rank == 0, head=pp_rank == 1)
    tp_mesh = mesh["tp"]
    for layer in stage_module.layers:
        plan = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
        plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
        plan.update({"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel()})
        parallelize_module(layer, tp_mesh, plan)
    if pp_rank == 0:
        parallelize_module(
            stage_module, tp_mesh, {"embed_tokens": RowwiseParallel(input_layouts=Replicate())}
        )
    else:
        parallelize_module(stage_module, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    stage = PipelineStage(
        stage_module, pp_rank, LAYOUT["pp"], torch.device("cpu"), group=mesh["pp"].get_group()
    )

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    schedule = Schedule1F1B(stage, args.micro_batches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(stage_module.parameters(), lr=3e-4, weight_decay=0.01)
    return stage_module, schedule, optimizer, mesh["dp"].get_group(), mesh["pp"].get_group(), pp_rank


def native_step(parts, batch) -> float | None:
    """One step; the mean loss of this dp replica's micro-batches on the last stage."""
    module, schedule, optimizer, dp_group, pp_group, pp_rank = parts
    inputs, targets, losses = *batch, []
    if pp_rank == 0:
        schedule.step(inputs)
    else:
        schedule.step(target=targets, losses=losses)
    for p in module.parameters():  # plain data parallelism: every gradient summed over dp, then averaged
        if p.grad is not None:
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(local, group=dp_group)
            local /= LAYOUT["dp"]
    # Global clipping at 1.0 with torch's pieces: DTensor gradients (tp-split) and plain ones (the replicated
    # norms) have their norms taken apart, then summed over the pipeline stages.
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    split = [g for g in grads if hasattr(g, "to_local")]
    plain = [g for g in grads if not hasattr(g, "to_local")]
    squares = nn.utils.get_total_norm(split).full_tensor() ** 2 + nn.utils.get_total_norm(plain) ** 2
    dist.all_reduce(squares, group=pp_group)
    nn.utils.clip_grads_with_norm_(split, 1.0, squares.sqrt())
    nn.utils.clip_grads_with_norm_(plain, 1.0, squares.sqrt())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(torch.stack(losses).detach().mean()) if losses else None


def timed(ctx, step) -> float:
    dist.barrier()
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def bench_rank(ctx, cases, args, report) -> None:
    trainer = Trainer(femtotron_config(args), ctx, log_to_console=False)
    parts = torch_native(ctx, args)
    rows = args.micro_batches * SHAPE["micro_batch_size"]
    generator = torch.Generator().manual_seed(1234 + ctx.dp_rank)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:  # random tokens, new every step, as femtotron's data
        ids = torch.randint(1, SHAPE["vocab_size"], (rows, SHAPE["sequence_length"] + 1), generator=generator)
        return ids[:, :-1], ids[:, 1:]

    losses = {"femtotron": [trainer.train_step().loss], "torch": [native_step(parts, batch())]}  # warm-up
    times: dict[str, list[float]] = {"femtotron": [], "torch": []}
    for _ in range(args.steps):
        times["femtotron"].append(timed(ctx, lambda: losses["femtotron"].append(trainer.train_step().loss)))
        times["torch"].append(timed(ctx, lambda: losses["torch"].append(native_step(parts, batch()))))
    report(0, (times, losses))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4, help="per dp replica and step")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        args.data, args.runs = str(Path(tmp) / "tokens"), str(Path(tmp) / "runs")
        write_random_tokens(Path(args.data), SHAPE["vocab_size"], 400_000)

        def on_case(case, per_rank) -> None:
            slowest = {
                what: [max(rank[0][what][i] for rank in per_rank) for i in range(args.steps)]
                for what in ("femtotron", "torch")
            }
            losses = per_rank[-1][1]  # the last stage's (dp rank 1); both train on random tokens
            print(
                "loss, first and last step: "
                + ", ".join(f"{what} {values[0]:.3f} -> {values[-1]:.3f}" for what, values in losses.items())
            )
            ours, theirs = statistics.median(slowest["femtotron"]), statistics.median(slowest["torch"])
            ratios = [t / o for o, t in zip(slowest["femtotron"], slowest["torch"], strict=True)]
            print(
                f"dp x tp x pp = 2 x 2 x 2, {args.layers} layers of the debug shape, fp32, "
                f"{args.micro_batches} micro-batches of {SHAPE['micro_batch_size']} x "
                f"{SHAPE['sequence_length']} per replica; "
                f"median of {args.steps} steps (slowest rank)\n  femtotron {ours * 1e3:.0f} ms, torch "
                f"DTensor + pipelining {theirs * 1e3:.0f} ms: speed-up {theirs / ours:.2f}x "
                f"(per step: {min(ratios):.2f}x-{max(ratios):.2f}x)"
            )
            step_ours, step_theirs = median_pair(slowest["femtotron"], slowest["torch"])
            headline(
                "dp2 tp2 pp2 step time (ms, 8 CPU ranks, the median step): femtotron / torch DTensor TP + "
                "pipelining 1F1B + DP all-reduce",
                step_ours * 1e3,
                step_theirs * 1e3,
                number_format=".0f",
            )

        spawn_ranks(LAYOUT, bench_rank, ["3d"], args, on_case)


if __name__ == "__main__":
    main()
