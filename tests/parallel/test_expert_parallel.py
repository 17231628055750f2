"""Expert parallelism equals one process: tokens sent to their experts' ranks and back (all-to-all), the
experts' gradients summed and ZeRO-1-sharded over their own replicas, in every layout (loss, full-shape
gradients, 3 optimizer steps), and the all-to-all's exact bytes."""

from __future__ import annotations

import pytest
from distributed import run_ranks
from helpers import check_layouts

from femtotron.diagnostics.doctor import all_to_all_bytes
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer

MOE = (
    "model.model_config.moe.num_experts=4",
    "model.model_config.moe.num_experts_per_tok=2",
    "model.model_config.moe.intermediate_size=32",
    "model.model_config.moe.z_loss_coef=0.001",
)


@pytest.mark.distributed
def test_expert_parallel_equals_one_process(tiny_config):
    """ep = 2 over dp = 2 (fp32, bf16 on both CPU paths, ZeRO-1 with recomputation), ep = 4 over dp = 4, and
    ep = 2 over dp = 4 (without ZeRO, with ZeRO-1, ZeRO-2 and ZeRO-3: the experts' gradients, and with ZeRO-3
    their parameters, sharded over their two replicas), and ZeRO-3 at dp = ep = 2 in bf16."""
    check_layouts(
        lambda *overrides: tiny_config(*MOE, *overrides),
        {
            ("parallelism.dp=2", "parallelism.ep=2"): [
                ("float32", None, ()),
                ("bfloat16", True, ()),
                ("bfloat16", False, ()),
                ("float32", None, ("optimizer.zero_stage=1", "parallelism.recompute_layer=true")),
            ],
            ("parallelism.dp=4", "parallelism.ep=4"): [("float32", None, ())],
            # two ranks hold each expert: its gradient reduced, and ZeRO-1 sharded, over them
            ("parallelism.dp=4", "parallelism.ep=2"): [
                ("float32", None, ()),
                ("float32", None, ("optimizer.zero_stage=1",)),
                ("float32", None, ("optimizer.zero_stage=2",)),
            ],
            # ZeRO-3: each layer's experts gathered over their own replicas (edp), the rest over dp
            ("parallelism.dp=4", "parallelism.ep=2", "optimizer.zero_stage=3"): [("float32", None, ())],
            ("parallelism.dp=2", "parallelism.ep=2", "optimizer.zero_stage=3"): [("bfloat16", False, ())],
        },
    )


SHARED = ("model.model_config.moe.num_shared_experts=1", "model.model_config.moe.shared_expert_gate=true")
DENSE_LAYERS = ("model.model_config.moe.dense_layers=[0,3]",)  # Qwen-MoE's mlp_only_layers


@pytest.mark.distributed
def test_expert_parallel_with_tp_cp_and_pp_equals_one_process(tiny_config):
    """dp2 x ep2 with tp2 inside the experts (both tp modes, shared experts under sequence parallelism, ZeRO-1
    over each group's replicas), ep over cp ranks, and with pp2; dense layers among the experts (their own
    layer on each pipeline stage) under tp and pp."""
    check_layouts(
        lambda *overrides: tiny_config(*MOE, *overrides),
        {
            ("parallelism.dp=2", "parallelism.ep=2", "parallelism.tp=2"): [
                ("float32", None, ()),
                ("float32", None, DENSE_LAYERS),
            ],
            (
                "parallelism.dp=2",
                "parallelism.ep=2",
                "parallelism.tp=2",
                "parallelism.tp_mode=REDUCE_SCATTER",
            ): [("float32", None, ("optimizer.zero_stage=1", *SHARED))],
            # Guards the aux loss's assignments summed over cp (the only layout case with cp and MoE;
            # tests/models/test_moe.py tests the shares directly).
            ("parallelism.cp=2", "parallelism.ep=2"): [("float32", None, ())],
            ("parallelism.dp=2", "parallelism.ep=2", "parallelism.pp=2"): [
                ("float32", None, ()),
                ("float32", None, DENSE_LAYERS),
            ],
        },
    )


def _all_to_all_bytes(rank, config):
    par = config.parallelism
    ctx = ParallelContext(
        dp=par.dp, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep, collective_timeout_seconds=60
    )
    trainer = Trainer(config, ctx, log_to_console=False)
    trainer.train_step()
    sent = dict(ctx.comm.bytes_sent)
    loads = trainer.model.router_stats.values[:, :4].clone()  # rows routed to each of the 4 experts
    ctx.close()
    return sent, loads, ctx.ep_rank


@pytest.mark.distributed
@pytest.mark.parametrize("dp, ep, recompute", [(4, 2, False), (4, 4, True)])
def test_the_all_to_all_sends_exactly_the_routed_rows(tiny_config, dp, ep, recompute):
    """Per layer and micro-batch, each forward (again when recomputed) sends the counts per expert, then the
    rows routed to other ranks' experts and their outputs back; backward sends both again as gradients."""
    config = tiny_config(
        *MOE,
        f"parallelism.dp={dp}",
        f"parallelism.ep={ep}",
        f"parallelism.recompute_layer={str(recompute).lower()}",
        "tokens.batch_accumulation_per_replica=2",
    )
    mcfg = config.model.model_config_
    row = mcfg.hidden_size * {"bfloat16": 2, "float32": 4}[config.model.dtype]
    local = 4 // ep  # experts per rank
    forwards = 2 if recompute else 1
    exchanges = mcfg.num_hidden_layers * 2  # layers times micro-batches
    results = run_ranks(_all_to_all_bytes, dp, config, timeout=120)[:ep]  # the first ep group
    loads = {me: rank_loads for _, rank_loads, me in results}
    for sent, mine, me in results:
        experts = slice(me * local, (me + 1) * local)
        away = mine.sum() - mine[:, experts].sum()  # rows this rank's tokens sent to other ranks' experts
        arrived = sum(other[:, experts].sum() for j, other in loads.items() if j != me)
        counts = forwards * exchanges * (ep - 1) * local * 8  # int64 counts
        assert sent[("ep", "all_to_all")] == counts + (forwards + 1) * (away + arrived) * row
        assert (("edp", "all_reduce") in sent) == (dp > ep)  # the experts' gradients over their replicas
    # What `femtotron doctor` counts: the same, with every expert getting its share of the rows.
    rows = config.tokens.micro_batch_size * config.tokens.sequence_length * 2 * exchanges * (ep - 1) / ep
    assert all_to_all_bytes(config) == counts + (forwards + 1) * 2 * rows * row
