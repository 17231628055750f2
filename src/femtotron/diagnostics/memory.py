"""Per-rank memory: estimated before launch (M1, `femtotron doctor`), and measured during a step.

Both count the same thing, the bytes of tensor storage alive at once:

- the **model state** is exact: each rank's part of the model is built on the meta device (layout.py:
  shapes, no memory), and its flat buffers give parameters, gradients, fp32 master weights and Adam
  moments (with or without ZeRO-1, padding included);
- the **step** is simulated on the meta device: one micro-batch's forward and backward through this
  rank's stage(s), every tensor op tracked by `LiveMemory`, gives what a micro-batch keeps for backward
  (its saved activations) and the peak while it runs (activations, logits, their gradients, transient
  buffers); the pipeline schedule says how many micro-batches each stage holds at once;
- on GPUs, the **NCCL communicators** the rank belongs to (parallel/context.py creates one process group per
  distinct rank set, and one per one-way link of the pipeline and the cp ring), at a fixed figure each:
  NCCL allocates them outside PyTorch's allocator.

`LiveMemory` tracks every storage a tensor op creates until it is freed (not the ones that existed
before, nor outputs that alias an input: views and in-place ops), on real tensors as on meta ones,
so the estimate is checked against a real step's peak on CPU (tests/diagnostics/test_memory.py).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from femtotron.batch import MicroBatch
from femtotron.config import Config
from femtotron.config.pipeline_engines import Engine
from femtotron.layout import DTYPES, RankModel, meta_rank_model
from femtotron.mesh import Mesh, MeshCoordinates
from femtotron.models.llama import DecoderLayers, Llama
from femtotron.optim.muon import Muon
from femtotron.parallel.context_parallel import place_tokens
from femtotron.parallel.data_parallel import IN_FLIGHT
from femtotron.parallel.pipeline.schedules import schedule
from femtotron.parallel.split_backward import (
    DeferredWeightGradients,
    compute_weight_gradients,
    defer_weight_gradients,
    kept_tensors,
)
from femtotron.precision import ESTIMATING_FOR_THIS_CPU
from femtotron.serialize.background import available_host_bytes

GIB = 2**30
# A chunk's step is simulated with at most this many decoder layers (see `_per_layer`).
SIMULATED_LAYERS = 2
# Usable memory per device: what the driver reports, less what the CUDA context keeps (~0.5-1 GiB).
DEVICES = {
    "H100": 79.1,
    "H200": 139.8,
    "A100-80GB": 79.1,
    "A100-40GB": 39.4,
    "L40S": 44.4,
    "V100-32GB": 31.7,
    "CPU": None,  # this machine's memory, as available now
}
# NCCL's device memory per communicator, a middle figure (0.3-1.6 GiB are reported on H100-class GPUs): every
# channel keeps, per peer it receives from, a buffer per protocol (Simple: NCCL_BUFFSIZE, 4 MiB by default;
# LL128 ~4.7 MiB; LL 0.5 MiB), and NVLink runs up to 32 channels for rings and as many for trees: 32 x 2 x
# ~9 MiB. NVLink SHARP (NCCL_NVLS_ENABLE) and send/receive buffers add more; NCCL_MAX_NCHANNELS lowers it.
NCCL_COMMUNICATOR_BYTES = GIB // 2
# A one-way link (a 2-rank group carrying the pipeline's or the cp ring's transfers one way) connects only
# the p2p channels to its one peer: a buffer of NCCL_P2P_*_CHUNKSIZE x NCCL_STEPS (4 MiB) on each of 2-32
# channels, plus the communicator's own structures. A middle figure, not yet measured on a GPU.
NCCL_LINK_BYTES = 64 * 2**20


class LiveMemory(TorchDispatchMode):
    """While active: bytes of tensor storage created by tensor ops and still alive (`live`), and their
    peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        arguments = tree_flatten((args, kwargs))[0]
        inputs = {id(t.untyped_storage()) for t in arguments if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._alive:  # a view or an in-place result: nothing new
                continue
            self._alive.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self._alive.discard(key)
        self.live -= nbytes


@dataclass(kw_only=True)
class RankEstimate:
    pp_rank: int
    state: dict[str, int]  # params, grads, master_weights, adam_moments
    # Per model chunk: the activations a micro-batch keeps until its backward.
    saved_per_micro_batch: list[int]
    # zb-h1: per model chunk, what a micro-batch keeps from its B to its W (the split linears' inputs and
    # output gradients); zeros for the other engines.
    left_for_w_per_micro_batch: list[int]
    micro_batch_peak: int  # the most alive while one micro-batch runs forward and backward
    waiting: int  # the activations of the other micro-batches held meanwhile (1F1B: up to pp - pp_rank - 1)
    micro_batches_held: int
    communicators: int  # the NCCL communicators it belongs to (none counted on a CPU)
    links: int = 0  # of which one-way links (2-rank p2p communicators), not in `communicators`
    working: int = 0  # ZeRO-2/3: whole gradients and (ZeRO-3) gathered parameters alive during a step
    elements: int = 0  # in the rank's flat buffers, padding included (whole, whatever the ZeRO stage)
    checkpoint: int = 0  # host bytes checkpoints.async_save stages per save (not device memory)
    muon_gather: dict[str, int] | None = None  # Muon: bytes received per step for whole matrices, by group

    @property
    def communicator_bytes(self) -> int:
        return self.communicators * NCCL_COMMUNICATOR_BYTES + self.links * NCCL_LINK_BYTES

    @property
    def total(self) -> int:
        state = sum(self.state.values()) + self.working
        return state + self.waiting + self.micro_batch_peak + self.communicator_bytes


def schedule_peak(
    engine: Engine, pp: int, pp_rank: int, micro_batches: int, saved: list[int], left_for_w: list[int]
) -> tuple[int, int]:
    """The most activation bytes this rank holds for micro-batches whose backward has not run (or, split
    in B and W, whose W has not: `left_for_w` per chunk), and the most micro-batches at once, walking its
    action list."""
    held: dict[tuple[int, int], int] = {}
    worst = 0
    most = 0
    actions = schedule(engine.name, pp=pp, rank=pp_rank, micro_batches=micro_batches, chunks=len(saved))
    for action in actions:
        key = (action.micro_batch, action.chunk)
        if action.kind == "F":
            held[key] = saved[action.chunk]
        elif action.kind == "B" and engine.splits_backward:
            held[key] = left_for_w[action.chunk]
        else:
            held.pop(key)
        worst = max(worst, sum(held.values()))
        most = max(most, len(held))
    return worst, most


def estimate_rank(config: Config, pp_rank: int, on_this_cpu: bool = False) -> RankEstimate:
    """The memory of a rank at pipeline position `pp_rank` (every tp and dp rank there is alike), on GPUs,
    or with `on_this_cpu` on this machine's CPU (which may compute bf16 matmuls on fp32 copies)."""
    token = ESTIMATING_FOR_THIS_CPU.set(on_this_cpu)
    try:
        return _estimate_rank(config, pp_rank, on_this_cpu)
    finally:
        ESTIMATING_FOR_THIS_CPU.reset(token)


def communicators(dp: int, tp: int, pp: int, rank: int, cp: int = 1, ep: int = 1) -> int:
    """The NCCL communicators for collectives `rank` belongs to: the default group's and every subgroup's
    holding it (its one-way links: `links`)."""
    mesh = Mesh(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
    return (mesh.world_size > 1) + sum(rank in ranks for ranks in mesh.subgroups())


def links(dp: int, tp: int, pp: int, rank: int, cp: int = 1) -> int:
    """The one-way links (each a 2-rank communicator) `rank` sends or receives on."""
    mesh = Mesh(dp=dp, tp=tp, pp=pp, cp=cp)
    return sum(rank in pair for pair in mesh.pipe_links() + mesh.ring_links())


def _estimate_rank(config: Config, pp_rank: int, on_this_cpu: bool) -> RankEstimate:
    par = config.parallelism
    tokens = config.tokens
    meta = torch.device("meta")
    rank = Mesh.of(par).rank_of(MeshCoordinates(pp_rank=pp_rank, dp_rank=0, cp_rank=0, tp_rank=0))
    model = meta_rank_model(config, rank)
    state = model.data_parallel.state.model_state_bytes()
    sequence_split = par.tp if model.tp.sequence_parallel else 1
    sequence = tokens.sequence_length // par.cp // sequence_split
    # cp rank 0's part of the sequences (the ranks' parts are alike); one document (no token is -1).
    eos = -1 if config.model.document_masking else None
    zeros = torch.zeros(tokens.micro_batch_size, tokens.sequence_length + 1).long()
    whole = MicroBatch.from_tokens(zeros)
    saved: list[int] = []  # per chunk
    peaks: list[int] = []
    left_for_w: list[int] = []
    for chunk_index, chunk in enumerate(model.chunks):
        stage = chunk_index * par.pp + pp_rank
        batch = place_tokens(whole, par.cp, 0, eos).to(meta)
        deferred = defer_weight_gradients([chunk]) if par.engine.splits_backward else None

        def step(
            chunk: Llama = chunk,
            stage: int = stage,
            batch: MicroBatch = batch,
            deferred: DeferredWeightGradients | None = deferred,
        ) -> tuple[int, ...]:
            with LiveMemory() as memory:
                if stage == 0:
                    inputs = batch.inputs
                else:  # what the previous stage sends; received into a new buffer
                    inputs = torch.empty(
                        tokens.micro_batch_size,
                        sequence,
                        config.model.model_config_.hidden_size,
                        dtype=DTYPES[config.model.dtype],
                        device=meta,
                    ).requires_grad_()
                output = chunk.run_stage(inputs, batch.targets, batch.placement)
                kept = memory.live
                if stage == par.pp * par.pp_virtual_stages - 1:
                    output.backward()
                else:
                    torch.autograd.backward(output, torch.empty_like(output))
                del inputs, output
                waiting_for_w = 0
                if deferred is not None:  # what W will read, distinct storages once (x feeds q, k and v)
                    storages = {
                        id(t.untyped_storage()): t.untyped_storage().nbytes()
                        for t in kept_tensors(deferred.collected)
                    }
                    waiting_for_w = sum(storages.values())
                    compute_weight_gradients(deferred.take())
            model.data_parallel.zero_grad()  # the gradient hooks take each step as a fresh one
            return kept, memory.peak, waiting_for_w

        kept, peak, waiting_for_w = _per_layer(chunk, step)
        saved.append(kept)
        peaks.append(peak)
        left_for_w.append(waiting_for_w)
    micro_batches = tokens.batch_accumulation_per_replica
    held_bytes, held = schedule_peak(
        par.engine, par.pp, pp_rank, micro_batches, saved=saved, left_for_w=left_for_w
    )
    waiting = held_bytes - max(saved) if held > 1 else 0  # the others, while the largest one runs
    if on_this_cpu:  # no NCCL
        nccl = 0
        one_way = 0
    else:
        nccl = communicators(dp=par.dp, tp=par.tp, pp=par.pp, rank=rank, cp=par.cp, ep=par.ep)
        one_way = links(dp=par.dp, tp=par.tp, pp=par.pp, rank=rank, cp=par.cp)
    return RankEstimate(
        pp_rank=pp_rank,
        state=state,
        saved_per_micro_batch=saved,
        left_for_w_per_micro_batch=left_for_w,
        micro_batch_peak=max(peaks),
        waiting=waiting,
        micro_batches_held=held,
        communicators=nccl,
        links=one_way,
        working=working_set_bytes(model, split_backward=par.engine.splits_backward),
        elements=model.data_parallel.layout.size,
        checkpoint=model.data_parallel.state.checkpoint_bytes(),
        muon_gather=muon_gather_bytes(config, model),
    )


def muon_gather_bytes(config: Config, model: RankModel) -> dict[str, int] | None:
    """What Muon gathers per step for Newton-Schulz's whole matrices (optim/muon.py), None without Muon."""
    if config.optimizer.optimizer_factory.name != "muon":
        return None
    params = [p for _, p in model.named_parameters()]
    muon = Muon(params, model.data_parallel.state, model.tp, config.optimizer.optimizer_factory)
    return muon.bytes_per_step()


def working_set_bytes(model: RankModel, split_backward: bool = False) -> int:
    """ZeRO-2/3's memory beyond what a rank keeps between steps. ZeRO-2: the whole gradients of the buckets
    being filled and reduced (under accumulation all of them, kept from the first micro-batch's backward
    to the last's). ZeRO-3: the gathered parameters (parallel/fully_sharded.py's working set) and the
    whole gradients of the largest unit (with the backward split, zb-h1: of every unit, each reduced only
    once its W has run), of the embedding (reduced once per step) and of the reductions in flight; reducing
    once per step under accumulation (optimizer.reduce_every_micro_batch false), every unit's whole gradients
    as ZeRO-2's, with the gathered parameters."""
    data_parallel = model.data_parallel
    state = data_parallel.state
    if not state.zero.shards_gradients:
        return 0
    grad_bytes = state.grad_dtype.itemsize
    buckets = state.layout.buckets
    in_flight = IN_FLIGHT * max(bucket.end - bucket.start for bucket in buckets)
    gathering = model.gathering
    if gathering is None:
        filling = max(bucket.end - bucket.start for bucket in buckets)
        whole = state.layout.size if data_parallel.micro_batches > 1 else filling + in_flight
        return grad_bytes * whole
    params = gathering.working_set() * state.param_dtype.itemsize
    if not data_parallel.reduce_every_micro_batch and data_parallel.micro_batches > 1:
        return grad_bytes * state.layout.size + params
    units = [unit for chunk in gathering.units for unit in chunk]
    sizes = [gathering.elements(unit.buckets) for unit in units if unit.needed_in_backward]
    largest = sum(sizes) if split_backward else max(sizes)
    once_per_step = gathering.elements(
        b for unit in units if not unit.needed_in_backward for b in unit.buckets
    )
    return grad_bytes * (largest + once_per_step + in_flight) + params


def _per_layer(chunk: Llama, step: Callable[[], tuple[int, ...]]) -> tuple[int, ...]:
    """`step()`'s byte counts for `chunk`. A deep chunk is stepped with its first SIMULATED_LAYERS - 1
    and SIMULATED_LAYERS layers only, each further layer adding what the last one added (they are alike): a
    128-layer stage is estimated as fast as a 2-layer one, and exactly (tests/diagnostics/test_doctor.py)."""
    layers = chunk.layers
    extra = len(layers) - SIMULATED_LAYERS
    if extra <= 0:
        return step()
    measured = []
    for count in (SIMULATED_LAYERS - 1, SIMULATED_LAYERS):
        chunk.layers = DecoderLayers(dict(itertools.islice(layers.items(), count)))
        try:
            measured.append(step())
        finally:
            chunk.layers = layers
    fewer, more = measured
    return tuple(count + extra * (count - before) for before, count in zip(fewer, more, strict=True))


def human(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:.1f} MiB"


def device_budget(device: str | None, device_memory: float | None, processes: int) -> tuple[str, float]:
    """What the device is called in the report, and the bytes a rank may take on it: `device_memory` GiB; a
    named GPU's usable memory; the CPU's, this machine's memory available now, shared by the `processes`
    that `femtotron train` starts on it; no device named: this machine's first GPU's free memory."""
    if device_memory is not None:
        return f"{device_memory:g} GiB per device", device_memory * GIB
    if device is None:
        free, _ = torch.cuda.mem_get_info()
        return f"this machine's {torch.cuda.get_device_name()}, {free / GIB:.1f} GiB free", free
    name = next((k for k in DEVICES if k.lower() == device.lower()), None)
    if name is None:
        raise ValueError(
            f"unknown device {device!r}; known: {', '.join(DEVICES)}, or give --device-memory GIB"
        )
    memory = DEVICES[name]
    if not memory:
        available = available_host_bytes()
        where = f"{available / GIB:.1f} GiB of this machine's memory available, for {processes} process(es)"
        return f"{name}, {where}", available / processes
    return f"{name} ({memory:g} GiB usable)", memory * GIB
