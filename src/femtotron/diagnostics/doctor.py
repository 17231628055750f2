"""`femtotron doctor CONFIG`: everything that can be known before launching (L1, M1, M3, P2, T3).

The config rules and warnings, the world size, the pipeline's stage map and bubble, the bytes each
rank communicates per step, and a per-rank memory estimate for every pipeline stage (diagnostics/
memory.py; on GPUs with the NCCL communicators the rank belongs to) against the device; when it does not
fit, the usual fixes, each with the estimate it gives.
"""

from __future__ import annotations

import glob
import os
from collections import Counter

import torch

from femtotron.config import Config, check_world_size
from femtotron.config.rules import rule_problems, with_changes
from femtotron.config.sections import stage_end
from femtotron.config.zero_stages import ZERO_STAGES
from femtotron.diagnostics.advice import config_warnings, imbalance_warning
from femtotron.diagnostics.memory import (
    GIB,
    NCCL_COMMUNICATOR_BYTES,
    NCCL_LINK_BYTES,
    RankEstimate,
    device_budget,
    estimate_rank,
    human,
)
from femtotron.layout import DTYPES
from femtotron.mesh import ADDED_LATER, NAMED, WORLD_DIMENSIONS, Mesh
from femtotron.parallel.pipeline.partition import partition, stage_map


def worst_stage(config: Config, on_cpu: bool) -> RankEstimate:
    estimates = [estimate_rank(config, p, on_cpu) for p in range(config.parallelism.pp)]
    return max(estimates, key=lambda e: e.total)


def fixes(config: Config, budget: float, on_cpu: bool) -> list[str]:
    """The guide's other knobs against OOM (ZeRO-1 and recomputation are in `variants`), each tried on its
    own, with the largest rank's estimate it gives."""
    tokens = config.tokens
    par = config.parallelism
    candidates: list[tuple[str, Config]] = []
    if tokens.micro_batch_size > 1:
        half = tokens.micro_batch_size // 2
        twice = tokens.batch_accumulation_per_replica * 2
        label = (
            f"tokens.micro_batch_size={half} (and batch_accumulation_per_replica={twice} to keep the batch)"
        )
        changes = {"tokens.micro_batch_size": half, "tokens.batch_accumulation_per_replica": twice}
        candidates.append((label, with_changes(config, changes)))
    shorter = tokens.sequence_length // 2
    candidates.append(
        (f"tokens.sequence_length={shorter}", with_changes(config, {"tokens.sequence_length": shorter}))
    )
    for key in ("tp", "pp", "cp", "ep"):
        doubled = getattr(par, key) * 2
        bigger = with_changes(config, {f"parallelism.{key}": doubled})
        if not rule_problems(bigger) and (key != "ep" or config.model.model_config_.moe):
            if key == "ep":
                how = "each rank holds half the experts, no more processes"
            else:
                how = "twice the processes, or dp halved"
            candidates.append((f"parallelism.{key}={doubled} ({how})", bigger))
    lines = []
    for label, changed in candidates:
        total = worst_stage(changed, on_cpu).total
        # A CPU's memory is shared by every process on it: more processes, less each.
        share = par.world_size / changed.parallelism.world_size if on_cpu else 1
        verdict = "fits" if total <= budget * share else "still too much"
        lines.append(f"  {label}: {human(total)} per rank ({verdict})")
    return lines


def variants(config: Config, budget: float, on_cpu: bool) -> list[str]:
    """The same layout at the other ZeRO stages and with recomputation switched the other way, whether or not
    it fits."""
    par = config.parallelism
    toggles = []
    if par.dp * par.cp > 1:
        for other in ZERO_STAGES:
            if other == config.optimizer.zero:
                continue
            changed = with_changes(config, {"optimizer.zero_stage": other.number})
            toggles.append((f"optimizer.zero_stage={other.number}", changed))
    optimizer = config.optimizer
    if optimizer.zero.shards_parameters and config.tokens.batch_accumulation_per_replica > 1:
        once = not optimizer.reduce_every_micro_batch
        changed = with_changes(config, {"optimizer.reduce_every_micro_batch": once})
        toggles.append((f"optimizer.reduce_every_micro_batch={str(once).lower()}", changed))
    recompute = not par.recompute_layer
    recomputed = with_changes(config, {"parallelism.recompute_layer": recompute})
    toggles.append((f"parallelism.recompute_layer={str(recompute).lower()}", recomputed))
    lines = []
    for label, changed in toggles:
        total = worst_stage(changed, on_cpu).total
        verdict = " (fits)" if total <= budget else " (does not fit)"
        lines.append(f"  with {label}: {human(total)} per rank{verdict}")
    return lines


def communication(config: Config, elements: int, device: str | None, gpus_per_node: int) -> list[str]:
    """Bytes each rank sends per step (ring algorithms), by dimension; `elements`: in a rank's flat
    buffers (its parameters, whole, padding included). `device` (None: not given) and `gpus_per_node` say
    what link the tp group uses."""
    mcfg = config.model.model_config_
    par = config.parallelism
    tokens = config.tokens
    size = DTYPES[config.model.dtype].itemsize
    micro = tokens.batch_accumulation_per_replica
    zero = config.optimizer.zero
    activation = tokens.micro_batch_size * tokens.sequence_length // par.cp * mcfg.hidden_size * size
    lines = []
    replicas = par.dp * par.cp  # the ranks holding the same parameters
    expert = expert_fraction(config) if par.ep > 1 else 0.0  # summed over the experts' own replicas
    dense = "dp" if par.cp == 1 else "dp x cp"
    groups = [(dense, replicas, 1 - expert)]
    if expert:
        groups.append(("experts over their replicas", replicas // par.ep, expert))
    for name, ranks, fraction in groups:
        if ranks == 1:
            continue
        grads = fraction * elements * (4 if config.optimizer.accumulate_grad_in_fp32 else size)
        params = fraction * elements * size
        share = (ranks - 1) / ranks  # what a ring sends of the whole
        if zero.shards_parameters:  # per micro-batch: each unit gathered twice (the embedding once)
            reductions = micro if config.optimizer.reduce_every_micro_batch else 1
            lines.append(
                f"  {name}: all-gather {human(2 * micro * share * params)} + reduce-scatter "
                f"{human(reductions * share * grads)} per step (at most; each unit in each micro-batch)"
            )
            if reductions > 1:
                once = human(share * grads)
                lines.append(
                    f"    with optimizer.reduce_every_micro_batch=false: reduce-scatter {once} per step, "
                    "every unit's whole gradients kept through the step (memory below)"
                )
        elif zero.shards_optimizer:
            gathered = human(share * params)
            lines.append(f"  {name}: reduce-scatter {human(share * grads)} + all-gather {gathered} per step")
        else:
            lines.append(f"  {name}: all-reduce {human(2 * share * grads)} per step")
    if par.ep > 1:
        lines.append(
            f"  ep: all-to-all {human(all_to_all_bytes(config))} per step (tokens to their experts' ranks "
            "and back, and their gradients; with the routing balanced)"
        )
    if par.cp > 1:
        lines.append(
            f"  cp: {human(ring_bytes(config))} per step (the ring: keys and values, their gradients)"
        )
    if par.tp > 1:
        layers = mcfg.num_hidden_layers / par.pp
        # Per layer and micro-batch: 2 collectives in forward and 2 in backward on the whole activation.
        volume = 4 * layers * micro * 2 * (par.tp - 1) / par.tp * activation
        if device is not None and device.lower() == "cpu":
            link = "between processes of one host"
        elif par.tp > gpus_per_node:
            link = "across nodes: the network, see the warning above"
        else:
            link = "inside a node: NVLink or PCIe" if device is None else "inside a node: NVLink"
        lines.append(f"  tp: {human(volume)} per step ({par.tp_mode}; {link})")
    if par.pp > 1:
        # Under sequence parallelism each tp rank sends its part of the sequence only.
        sequence_split = par.tp if par.tp_mode == "REDUCE_SCATTER" else 1
        sent = 2 * micro * activation / sequence_split
        lines.append(f"  pp: {human(sent)} per step and stage boundary (activations forward, gradients back)")
    return lines or ["  none (one process)"]


def process_groups(config: Config) -> list[str]:
    """The process groups a layout makes (parallel/context.py), and what creating them costs on NCCL: every
    `split_group` and `new_group` call is one ncclCommSplit of the whole world at start-up."""
    par = config.parallelism
    mesh = Mesh.of(par)
    kinds = mesh.subgroups_by_kind()
    one_way = mesh.pipe_links() + mesh.ring_links()
    # Counted in one pass over the groups (memory.communicators per rank would take world size squared).
    in_subgroups = Counter(rank for sets in kinds.values() for ranks in sets for rank in ranks)
    on_links = Counter(rank for pair in one_way for rank in pair)
    most_communicators = 1 + max(in_subgroups.values(), default=0)  # and the default group
    most_links = max(on_links.values(), default=0)
    subgroup_count = sum(len(sets) for sets in kinds.values())
    lines = [
        f"  process groups: the default one + {subgroup_count} for collectives ({len(kinds)} kinds) + "
        f"{len(one_way)} one-way links (the pipeline's, the cp ring's); each rank is in up to "
        f"{most_communicators} communicators for collectives and {most_links} links"
    ]
    if subgroup_count or one_way:
        lines.append(
            f"  start-up on NCCL: {len(kinds)} split_group + {len(one_way)} new_group calls, each one "
            f"world-wide ncclCommSplit ({subgroup_count + len(one_way)} with new_group alone)"
        )
    return lines


def expert_fraction(config: Config) -> float:
    """The share of a rank's parameters that are experts: it holds 1/ep of them (padding ignored)."""
    mcfg = config.model.model_config_
    ep = config.parallelism.ep
    if mcfg.moe is None:
        return 0.0
    per_expert = 3 * mcfg.hidden_size * mcfg.moe.intermediate_size  # gate, up and down
    experts = mcfg.moe_layer_count * mcfg.moe.num_experts * per_expert
    held = experts / ep
    return held / (held + mcfg.parameter_count - experts)


def all_to_all_bytes(config: Config) -> int:
    """Bytes each rank sends in all-to-alls per step, with every expert getting its share of the tokens: per
    layer and micro-batch, each forward (again with recomputation) sends the counts per expert, then the
    (ep - 1) / ep of its tokens' k rows bound for other ranks and their outputs back; backward both again."""
    mcfg = config.model.model_config_
    par = config.parallelism
    tokens = config.tokens
    moe = mcfg.moe
    size = DTYPES[config.model.dtype].itemsize
    rows = tokens.micro_batch_size * tokens.sequence_length // par.cp * moe.num_experts_per_tok
    away = rows * (par.ep - 1) / par.ep * mcfg.hidden_size * size
    counts = (par.ep - 1) * moe.num_experts // par.ep * 8
    forwards = 2 if par.recompute_layer else 1
    per_layer = forwards * (counts + 2 * away) + 2 * away
    return int(per_layer * mcfg.moe_layer_count / par.pp * tokens.batch_accumulation_per_replica)


def ring_bytes(config: Config) -> int:
    """Bytes each rank sends round the cp ring per step: per layer and micro-batch, the forward's cp - 1
    blocks of keys and values, the backward's cp - 1 again with cp blocks of their fp32 gradients, and with
    recomputation the forward once more."""
    mcfg = config.model.model_config_
    par = config.parallelism
    tokens = config.tokens
    size = DTYPES[config.model.dtype].itemsize
    heads = mcfg.num_key_value_heads // par.tp
    block = 2 * tokens.micro_batch_size * tokens.sequence_length // par.cp * heads * mcfg.head_dim
    forwards = 2 if par.recompute_layer else 1
    per_layer = (forwards + 1) * (par.cp - 1) * block * size + par.cp * block * 4
    layers = mcfg.num_hidden_layers / par.pp
    return int(per_layer * layers * tokens.batch_accumulation_per_replica)


def diagnose(
    config: Config,
    world_size: int | None,
    device: str | None,
    device_memory: float | None,
    gpus_per_node: int,
) -> tuple[str, bool]:
    """The report, and whether everything fits. No device named: the one `femtotron train` would use here,
    this machine's GPU, or its CPU when it has none (no NCCL communicators then), with a hint to name the
    GPUs meant."""
    par = config.parallelism
    for_this_cpu = device is None and device_memory is None and not torch.cuda.is_available()
    if for_this_cpu:
        device = "CPU"
    if world_size is not None:
        check_world_size(config, world_size)  # L1: raises with the valid layouts
    layout = describe_layout(Mesh.of(par))
    lines = [f"config: every rule holds; layout {layout} = {par.world_size} process(es)"]
    lines += data_plan(config)
    lines += [f"warning: {w}" for w in config_warnings(config)]
    lines += [f"warning: {m}" for m in missing_paths(config)]
    if par.tp > gpus_per_node:
        lines.append(
            f"warning: tp={par.tp} > {gpus_per_node} GPUs per node: every layer's tp collectives cross the "
            "network between nodes (T3). Keep tp <= GPUs per node; use dp or pp across nodes."
        )
    elif par.tp * par.cp > gpus_per_node:
        lines.append(
            f"warning: tp={par.tp} x cp={par.cp} > {gpus_per_node} GPUs per node: every layer's cp ring "
            "crosses the network between nodes (T3). Each ring step overlaps its transfer with a block's "
            "attention, so with long sequences a fast network keeps up (Llama 3 ran cp across nodes); "
            "otherwise keep tp * cp <= GPUs per node and use dp or pp across nodes."
        )
    if par.pp > 1:
        micro_batches = config.tokens.batch_accumulation_per_replica
        bubble = par.engine.bubble(par.pp, micro_batches, par.pp_virtual_stages)
        lines.append(f"pipeline: {par.pp_engine}, each stage idles {bubble:.0%} of a step in theory (P2)")
        virtual_stages = par.pp * par.pp_virtual_stages
        stages = partition(config.model.model_config_, config.tokens.sequence_length, virtual_stages)
        lines.append(stage_map(stages, par.pp))
        imbalance = imbalance_warning(config, stages)
        if imbalance:
            lines.append(f"warning: {imbalance}")
    where, budget = device_budget(device, device_memory, par.world_size)
    on_cpu = (device or "").lower() == "cpu"
    estimates = [estimate_rank(config, p, on_cpu) for p in range(par.pp)]
    lines.append("communication per rank:")
    lines += communication(config, estimates[0].elements, device, gpus_per_node)
    if estimates[0].muon_gather is not None:
        replicas = max(e.muon_gather["replicas"] for e in estimates)
        tp = max(e.muon_gather["tp"] for e in estimates)
        lines.append(
            f"  muon: {human(replicas)} over the replicas + {human(tp)} over tp per step (each matrix whole "
            "for Newton-Schulz on its owner, the updates summed back; the busiest pp rank)"
        )
    if par.world_size > 1:
        lines += process_groups(config)
    lines.append(f"memory per rank (estimate; device: {where}):")
    for e in estimates:
        lines.append(_memory_line(e))
    if config.checkpoints.async_save:
        staged = max(e.checkpoint for e in estimates)
        lines.append(
            f"host memory per rank for checkpoints.async_save: {human(staged)} of staging buffers (its part "
            "of a checkpoint, copied there at each save), beside the device's; a host without room is refused"
        )
    worst = max(estimates, key=lambda e: e.total)
    lines += variants(config, budget, on_cpu)
    fits = worst.total <= budget
    if fits:
        line = (
            f"fits: the largest rank needs {human(worst.total)} of {budget / GIB:.1f} GiB "
            f"({worst.total / budget:.0%})"
        )
        if budget - worst.total < 2 * GIB and not on_cpu:
            line += (
                "; within 2 GiB of the device: the allocator's slack (not in the estimate) and NCCL "
                f"buffers beyond {human(NCCL_COMMUNICATOR_BYTES)} per communicator may not fit"
            )
        lines.append(line)
    else:
        has = "each process has" if on_cpu else "the device has"
        lines.append(
            f"does NOT fit (M1): pp rank {worst.pp_rank} needs {human(worst.total)}, {has} "
            f"{budget / GIB:.1f} GiB. More fixes, each on its own (ZeRO-1 and recomputation: above):"
        )
        lines += fixes(config, budget, on_cpu)
    if for_this_cpu:
        lines.append(
            "hint: no --device, and this machine has no GPU: sized for its CPU, where `femtotron train` "
            "would run here. For the GPUs you will train on, pass --device H100 (or H200, A100-80GB, "
            "A100-40GB, L40S, V100-32GB), or --device-memory GIB"
        )
    return "\n".join(lines), fits


def describe_layout(mesh: Mesh) -> str:
    """`dp=2 cp=2 (ep=2) tp=2 pp=1`: every dimension in the order people name them, those added later only
    where used; in parentheses those that are not factors of the world size (ep: carved out of dp x cp)."""
    words = []
    for name in NAMED:
        size = mesh.size(name)
        if name in ADDED_LATER and size == 1:
            continue
        words.append(f"{name}={size}" if name in WORLD_DIMENSIONS else f"({name}={size})")
    return " ".join(words)


def missing_paths(config: Config) -> list[str]:
    """The files the config reads (tokenizer, data) that are not here: said, as doctor sizes the model
    anyway."""
    named = [
        ("tokenizer.tokenizer_name_or_path", config.tokenizer.tokenizer_name_or_path),
        ("data.validation_folder", config.data.validation_folder),
    ]
    for index, stage in enumerate(config.data.stage_list()):
        path = config.data.stage_path(index)
        named += [(f"{path}.{key}", getattr(stage, key)) for key in ("dataset_folder", "text_dataset")]
    lines = []
    for field, spec in named:
        for given in [spec] if isinstance(spec, str) else spec or []:  # a list, or {path: weight}
            if not (glob.glob(given) or os.path.exists(f"{given}.bin")):  # a .bin/.idx prefix, or a glob
                lines.append(
                    f"{field}: {given} does not exist (relative paths start from {os.getcwd()}): `femtotron "
                    "train` would stop there. Fix the path; the estimates below do not need the file"
                )
    return lines


def data_plan(config: Config) -> list[str]:
    """What each step trains on, from the config alone (doctor reads no data: inspect-data does)."""
    stages = config.data.stage_list()
    lines = ["data stages:"] if len(stages) > 1 else []
    for i, stage in enumerate(stages):
        last = stage_end(stages, i) or config.tokens.train_steps
        source = f"{stage.dataset_folder}"
        if stage.synthetic:
            source = "random tokens (synthetic)"
        elif stage.text_dataset is not None:
            source = f"text {stage.text_dataset} (tokenized at start)"
        if len(stages) == 1:
            lines.append(f"data: {source}, seed {stage.seed}")
        else:
            steps = f"steps {stage.start_training_step} to {last}"
            lines.append(f"  {stage.name!r}: {steps}, {source}, seed {stage.seed}")
    return lines


def _until_w(e: RankEstimate) -> str:
    """zb-h1: what a micro-batch still keeps between its B and its W."""
    left = max(e.left_for_w_per_micro_batch)
    return f" ({human(left)} of it until its weight gradients, W)" if left else ""


def _memory_line(e: RankEstimate) -> str:
    """One pp rank's estimate, part by part."""
    state = " + ".join(f"{k.replace('_', ' ')} {human(v)}" for k, v in e.state.items())
    if e.working:
        state += f" + gathered parameters and whole gradients during the step {human(e.working)}"
    line = (
        f"  pp rank {e.pp_rank}: {human(e.total)} = {state} + activations: a micro-batch keeps "
        f"{human(max(e.saved_per_micro_batch))} for its backward{_until_w(e)} and peaks at "
        f"{human(e.micro_batch_peak)}, {e.micro_batches_held} held at most (+{human(e.waiting)})"
    )
    if e.communicators:
        line += f" + {e.communicators} NCCL communicator(s) x {human(NCCL_COMMUNICATOR_BYTES)}"
        if e.links:
            line += f" + {e.links} one-way link(s) x {human(NCCL_LINK_BYTES)}"
        line += f" = {human(e.communicator_bytes)}"
    return line
