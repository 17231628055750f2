"""One rank's part of the model: its pipeline stages, model chunks and parameter buffers. Built alike by the
trainer and, on the meta device, by the memory estimate and offline checkpoint tools, so all agree on which
slices of which tensors each rank of a mesh holds."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from femtotron.config import Config
from femtotron.mesh import Mesh
from femtotron.models.llama import Llama
from femtotron.models.moe import RouterStats
from femtotron.optim.muon import orthogonalised
from femtotron.parallel.comm import Comm, Group
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.context_parallel import ContextParallel
from femtotron.parallel.data_parallel import DataParallel
from femtotron.parallel.expert_parallel import ExpertParallel
from femtotron.parallel.flat_layout import Replicas
from femtotron.parallel.fully_sharded import ParameterGathering, chunk_units, parameter_indices
from femtotron.parallel.members import Parallel
from femtotron.parallel.pipeline.p2p import PipelineP2P
from femtotron.parallel.pipeline.partition import Stage, partition
from femtotron.parallel.pipeline.schedules import Pipeline
from femtotron.parallel.sharding import split_dim
from femtotron.parallel.split_backward import DeferredWeightGradients, defer_weight_gradients
from femtotron.parallel.tensor_parallel import TensorParallel

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(kw_only=True)
class RankModel:
    stages: list[Stage]  # every virtual stage of the pipeline (this rank runs stage chunk * pp + pp_rank)
    chunks: list[Llama]  # this rank's model chunks (one unless interleaved)
    tp: TensorParallel
    data_parallel: DataParallel  # the dp reduction, with the flat layout and the model state it reduces
    gathering: ParameterGathering | None  # ZeRO-3: which units' parameters are whole, and the hooks
    deferred: DeferredWeightGradients | None  # zb-h1: the weight gradients a backward left for W
    replicated: list[bool]  # per parameter: every tp rank holds it whole (the norms)
    # Per parameter: this rank's copy is the one that counts, in the grad norm and in a checkpoint (a
    # tp-replicated parameter on tp rank 0 only, a tied embedding on the first stage only).
    counted: list[bool]
    tied_embedding: int | None  # the index of a tied embedding shared between first and last stage
    ep: ExpertParallel
    router_stats: RouterStats | None  # what this rank's MoE layers routed in a step (None: a dense model)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters over all its chunks, by their names in the whole model."""
        return [item for chunk in self.chunks for item in chunk.named_parameters()]

    def finish_reduction(self) -> None:
        """After the step's backward: every owned gradient summed over dp; under ZeRO-3, what a prefetch left
        gathered is freed."""
        self.data_parallel.finish_reduction()
        if self.gathering is not None:
            self.gathering.settle()

    def whole_parameters(self, params: list[int]):
        """A context in which parameters `params` are whole (ZeRO-3 gathers their buckets; else they are)."""
        if self.gathering is None:
            return contextlib.nullcontext()
        return self.gathering.whole_parameters(params)


def tensor_parallel(config: Config, comm: Comm, group: Group, rank: int) -> TensorParallel:
    return TensorParallel(comm, group, rank, sequence_parallel=config.parallelism.tp_mode == "REDUCE_SCATTER")


def build_rank_model(config: Config, ctx: ParallelContext) -> RankModel:
    """This process's part of the model, on its device, talking over its groups."""
    parallel = Parallel(
        tp=tensor_parallel(config, ctx.comm, ctx.tp_group, ctx.tp_rank),
        cp=ContextParallel(ctx.comm, ctx.cp_group, ctx.cp_rank, ctx.cp_links),
        ep=ExpertParallel(ctx.comm, ctx.ep_group, ctx.ep_rank),
    )
    return _build(
        config,
        parallel,
        pp_rank=ctx.pp_rank,
        comm=ctx.comm,
        dense=Replicas(ctx.dp_cp_group, ctx.dp_cp_rank),
        experts=Replicas(ctx.edp_group, ctx.edp_rank),
        device=ctx.device,
    )


def meta_rank_model(config: Config, rank: int) -> RankModel:
    """Rank `rank` of the config's mesh on the meta device, no process group: shapes and layout only."""
    par = config.parallelism
    at = Mesh.of(par).coordinates_of(rank)
    replica = at.dp_rank * par.cp + at.cp_rank
    parallel = Parallel(
        tp=tensor_parallel(config, Comm(), Group("tp", tuple(range(par.tp))), at.tp_rank),
        cp=ContextParallel(Comm(), Group("cp", tuple(range(par.cp))), at.cp_rank),
        ep=ExpertParallel(Comm(), Group("ep", tuple(range(par.ep))), replica % par.ep),
    )
    return _build(
        config,
        parallel,
        pp_rank=at.pp_rank,
        comm=Comm(),
        dense=Replicas(Group("dp", tuple(range(par.dp * par.cp))), replica),
        experts=Replicas(Group("edp", tuple(range(par.dp * par.cp // par.ep))), replica // par.ep),
        device=torch.device("meta"),
    )


def _build(
    config: Config,
    parallel: Parallel,
    *,
    pp_rank: int,
    comm: Comm,
    dense: Replicas,
    experts: Replicas,
    device: torch.device,
) -> RankModel:
    """`dense`: the ranks summing the gradients of the dense parameters (dp x cp) and this rank's place among
    them; `experts`: the same for the experts' (dp x cp / ep)."""
    tp = parallel.tp
    ep = parallel.ep
    mcfg = config.model.model_config_
    par = config.parallelism
    dtype = DTYPES[config.model.dtype]
    # Virtual stage s runs on pp rank s % pp as its chunk s // pp (one chunk unless interleaved).
    stages = partition(mcfg, config.tokens.sequence_length, par.pp * par.pp_virtual_stages)
    common = dict(std=config.model.init_method.std, seed=config.general.seed, dtype=dtype, device=device)
    stats = RouterStats(mcfg, device) if mcfg.moe else None
    common |= dict(tp=tp, cp=parallel.cp, ep=ep, recompute_layer=par.recompute_layer, router_stats=stats)
    zero = config.optimizer.zero
    if zero.shards_parameters:  # parameters drawn a bucket at a time by ModelState, never whole
        common["param_device"] = torch.device("meta")
    chunks = [Llama(mcfg, **common, stage=stages[c * par.pp + pp_rank]) for c in range(par.pp_virtual_stages)]
    named = [item for chunk in chunks for item in chunk.named_parameters()]
    replicated = [split_dim(p.shard) is None for _, p in named]
    muon = config.optimizer.optimizer_factory.name == "muon"
    # A tied LM head on the last stage holds a copy of the first stage's embedding: its gradient is summed
    # with the original's, and it is counted (and saved) once.
    tied_copy = [n == "embed_tokens.weight" and par.pp > 1 and mcfg.tie_word_embeddings for n, _ in named]
    pairs = zip(replicated, tied_copy, strict=True)
    counted = [(tp.rank == 0 or not r) and not (c and pp_rank > 0) for r, c in pairs]
    data_parallel = DataParallel.build(
        named,
        bucket_groups(chunks, tied_copy),
        comm,
        dense,
        micro_batches=config.tokens.batch_accumulation_per_replica,
        bucket_mb=par.dp_bucket_size_mb,
        grad_dtype=torch.float32 if config.optimizer.accumulate_grad_in_fp32 else dtype,
        zero=zero,
        experts=experts if ep.size > 1 else None,
        device=device,
        orthogonalised=[muon and orthogonalised(n, p) for n, p in named],
        reduce_every_micro_batch=config.optimizer.reduce_every_micro_batch,
    )
    deferred = defer_weight_gradients(chunks) if par.engine.splits_backward else None
    gathering = None
    if zero.shards_parameters:
        gathering = ParameterGathering(
            data_parallel,
            chunks,
            deferred=deferred,
            reshard_after_forward=config.optimizer.reshard_after_forward,
        )
    return RankModel(
        stages=stages,
        chunks=chunks,
        tp=tp,
        data_parallel=data_parallel,
        gathering=gathering,
        deferred=deferred,
        replicated=replicated,
        counted=counted,
        tied_embedding=tied_copy.index(True) if any(tied_copy) else None,
        ep=ep,
        router_stats=stats,
    )


def build_pipeline(config: Config, ctx: ParallelContext, model: RankModel) -> Pipeline:
    """The schedule executor over this rank's chunks; it checks the transfer shape with its neighbours."""
    tokens = config.tokens
    hidden = config.model.model_config_.hidden_size
    sequence = tokens.sequence_length // ctx.cp // (ctx.tp if model.tp.sequence_parallel else 1)
    shape = (tokens.micro_batch_size, sequence, hidden)
    p2p = PipelineP2P(ctx.comm, ctx.pp_links, ctx.pp_rank, ctx.device, shape, DTYPES[config.model.dtype])
    pipeline = Pipeline(
        model.chunks, config.parallelism.pp_engine, ctx.pp, ctx.pp_rank, p2p, deferred=model.deferred
    )
    ctx.comm.take_seconds()  # the start-up handshake is not part of any step's communication
    return pipeline


def bucket_groups(chunks: list[Llama], own_bucket: list[bool]) -> list[list[int]]:
    """Parameter indices in the order backward produces their gradients: each chunk's units in reverse (the
    head, the layers from the last, the embedding: parallel/fully_sharded.py), so that no bucket spans two
    units (ZeRO-3 gathers a unit by its buckets), each unit's experts in buckets of their own (reduced over
    other ranks). A tied embedding gets its own bucket: at pp = 1 it is in two units; at pp > 1 it is laid out
    alike on both stages, so the pieces each rank owns after the dp reduction match across them."""
    index_of = parameter_indices(chunks)
    groups = []
    placed: set[int] = set()
    for chunk in chunks:
        experts = {index_of[id(p)] for p in chunk.parameters() if p.shard.experts}
        units = [{index_of[id(p)] for p in unit.params} for unit in reversed(chunk_units(chunk))]
        shared = {i for unit in units for i in unit if sum(i in other for other in units) > 1}
        for unit in units:
            backward_order = sorted(unit - placed, reverse=True)
            placed.update(backward_order)
            alone = [i for i in backward_order if own_bucket[i] or i in shared]
            groups.append([i for i in backward_order if i not in alone and i not in experts])
            groups.append([i for i in backward_order if i in experts])
            groups += [[i] for i in alone]
    return [group for group in groups if group]
