"""What a run prints before its first step: the summary (model, layout, batch, data, memory, stages) and the
warnings about legal but risky settings (N1, N2, P2, M3, T3)."""

from __future__ import annotations

from femtotron.config.sections import stage_end
from femtotron.diagnostics.advice import config_warnings, imbalance_warning
from femtotron.parallel.pipeline.partition import stage_map
from femtotron.train_state import TrainingParts


def summary(parts: TrainingParts, mfu_yardstick: str) -> str:
    config = parts.config
    ctx = parts.ctx
    scaler = parts.state.scaler
    mcfg = config.model.model_config_
    tokens = config.tokens
    par = config.parallelism
    accumulation = tokens.batch_accumulation_per_replica
    model_line = (
        f"model: Llama {mcfg.num_hidden_layers} layers, hidden {mcfg.hidden_size}, "
        f"{mcfg.num_attention_heads} heads ({mcfg.num_key_value_heads} kv), vocab {mcfg.vocab_size}: "
        f"{mcfg.parameter_count / 1e6:.2f}M parameters, {config.model.dtype} with fp32 master weights"
    )
    if scaler.enabled:
        model_line += f", dynamic loss scale from {scaler.scale:g}"
    ep = f" (experts over ep={ctx.ep})" if ctx.ep > 1 else ""  # ep splits dp x cp: not a factor of the world
    lines = [
        f"run: {config.general.project}/{config.general.run}, directory {config.run_dir}",
        model_line,
        f"layout: {ctx.mesh.describe()}{ep} on {ctx.world_size} process(es) on "
        f"{len(set(ctx.hosts))} host(s), device {ctx.device}",
        f"batch: {tokens.micro_batch_size} x {tokens.sequence_length} tokens x {accumulation} micro-batches "
        f"x dp {ctx.dp} = {config.tokens_per_step:,} tokens per step, {tokens.train_steps} steps",
        *data_lines(parts),
        f"MFU is measured against {mfu_yardstick}",
        memory_summary(parts),
    ]
    if config.checkpoints.async_save and config.checkpoints.checkpoint_interval:
        pinned = ", pinned" if ctx.device.type == "cuda" else ""
        staging = parts.model.data_parallel.state.checkpoint_bytes() / 2**20
        lines.append(
            "checkpoints: written in the background (checkpoints.async_save); staging buffers of "
            f"{staging:,.1f} MiB of host memory on this rank{pinned}"
        )
    if ctx.tp > 1:
        lines.append(f"tensor parallel: tp={ctx.tp}, tp_mode={par.tp_mode}")
    if ctx.cp > 1:
        lines.append(
            f"context parallel: cp={ctx.cp}, each rank holds 2 of the {2 * ctx.cp} chunks of every sequence "
            f"({tokens.sequence_length // ctx.cp} of {tokens.sequence_length} tokens, zigzag); attention as "
            "a ring; gradients summed over dp x cp"
        )
    if mcfg.moe is not None:
        lines.append(_experts_line(parts))
    if config.model.document_masking:
        lines.append("document masking: attention stops at each end-of-document token, RoPE restarts there")
    padded = parts.model.chunks[0].padded_vocab_size
    if padded != mcfg.vocab_size:
        lines.append(
            f"vocabulary padded from {mcfg.vocab_size} to {padded} rows to split evenly over "
            f"tp={ctx.tp}; the padded logits are masked out of the loss"
        )
    if ctx.pp > 1:
        bubble = par.engine.bubble(ctx.pp, accumulation, par.pp_virtual_stages)
        virtual = ""
        if par.pp_virtual_stages > 1:
            virtual = f" with {par.pp_virtual_stages} virtual stages per rank"
        lines.append(
            f"pipeline parallel: pp={ctx.pp}, pp_engine={par.pp_engine}{virtual}, {accumulation} "
            f"micro-batches: each stage idles {bubble:.0%} of a step in theory (bubble)"
        )
        lines.append(stage_map(parts.model.stages, ctx.pp))
    return "\n".join(lines)


def data_lines(parts: TrainingParts) -> list[str]:
    """What each data stage holds and how much of it the run reads (one line without stages)."""
    config = parts.config
    data = parts.data
    lines = []
    for i, (stage, nanoset) in enumerate(zip(data.stages, data.nanosets, strict=True)):
        last = min(config.tokens.train_steps, stage_end(data.stages, i) or config.tokens.train_steps)
        steps = max(last - stage.start_training_step + 1, 0)
        name = f"data stage {stage.name!r} (steps {stage.start_training_step} to {last}): "
        if stage.synthetic:
            what = "random token ids uniform over the vocabulary (data.synthetic: for throughput; the loss "
            what += "cannot fall)"
        else:
            epochs = nanoset.epochs_for(config.global_batch_size * steps)
            what = (
                f"{nanoset.num_documents:,} documents, {nanoset.num_tokens:,} tokens, "
                f"{nanoset.samples_per_epoch:,} samples per epoch; this run sees {epochs:.2f} epochs"
            )
        lines.append((name if len(data.stages) > 1 else "data: ") + what)
    return lines


def _experts_line(parts: TrainingParts) -> str:
    """The mixture of experts: how many experts a token visits, its active parameters, how ep splits them."""
    ctx = parts.ctx
    mcfg = parts.config.model.model_config_
    moe = mcfg.moe
    active = mcfg.active_parameter_count
    line = f"mixture of experts: top-{moe.num_experts_per_tok} of {moe.num_experts} experts per layer"
    if moe.dense_layers:
        line += f" ({mcfg.moe_layer_count} of {mcfg.num_hidden_layers} layers; the others dense)"
    if moe.num_shared_experts:
        line += f" + {moe.num_shared_experts} shared"
    line += f", {active / 1e6:.2f}M parameters active per token; "
    line += "dropless" if moe.capacity_factor is None else f"capacity factor {moe.capacity_factor:g}"
    if ctx.ep > 1:
        replicas = ctx.dp * ctx.cp // ctx.ep
        line += (
            f"; ep={ctx.ep}: each rank holds {moe.num_experts // ctx.ep} experts of every layer, tokens "
            f"go to them by all-to-all, their gradients are summed over the {replicas} "
            "rank(s) holding the same experts"
        )
    return line


def memory_summary(parts: TrainingParts) -> str:
    """Where this rank's bytes for the model state go, and how dp reduces gradients."""
    layout = parts.model.data_parallel.layout
    dp = parts.ctx.dp * parts.ctx.cp  # the ranks holding the same parameters
    over = "dp" if parts.ctx.cp == 1 else "dp x cp"
    plan = parts.model.data_parallel.state.model_state_bytes()
    elements = layout.size - layout.padding
    total = sum(plan.values())
    kinds = " + ".join(f"{key.replace('_', ' ')} {value / 2**20:.1f}" for key, value in plan.items())
    zero = parts.config.optimizer.zero
    if zero.shards_optimizer:
        gathered = " (each unit gathered while it runs)" if zero.shards_parameters else ""
        sharing = f"{zero.name} shards {zero.sharded}{gathered} over {over}={dp}"
    else:
        sharing = "optimizer state on every dp rank (zero_stage 0)"
    own_masters = " (fp32 parameters are their own master weights)" if not plan["master_weights"] else ""
    if dp > 1:
        reduction = f"gradients reduced over {over} in {len(layout.buckets)} bucket(s) during backward"
    else:
        reduction = "no dp reduction (dp=1)"
    return (
        f"model state on this rank: {elements / 1e6:.2f}M parameters in {total / 2**20:.1f} MiB = {kinds} "
        f"MiB{own_masters}, {total / elements:.1f} bytes per parameter; {sharing}; {reduction}; buffers "
        f"padded by {layout.padding:,} elements"
    )


def start_warnings(parts: TrainingParts, has_validation: bool, upcasts: bool) -> list[str]:
    config = parts.config
    ctx = parts.ctx
    warnings = config_warnings(config)
    if config.tokens.val_check_interval and not has_validation:
        warnings.append(
            f"tokens.val_check_interval={config.tokens.val_check_interval} but data.validation_folder "
            "is not set: no validation will run. Set it, or set tokens.val_check_interval=0."
        )
    warnings += tp_host_warnings(ctx.tp, ctx.hosts)
    rings = ctx.mesh.groups()["cp"] if ctx.cp > 1 else []
    warnings += cp_host_warnings(rings, ctx.hosts)
    imbalance = imbalance_warning(config, parts.model.stages) if ctx.pp > 1 else None
    if imbalance:
        warnings.append(imbalance)
    if upcasts:
        warnings.append(
            f"model.dtype={config.model.dtype} on a CPU without bf16 matrix units (no avx512_bf16 or "
            "amx_bf16): matmuls and attention run in fp32 on upcast copies, since emulated bf16 is "
            "far slower; model.dtype=float32 avoids the casts and is faster still on this CPU."
        )
    return warnings


def tp_host_warnings(tp: int, hosts: list[str]) -> list[str]:
    """T3: a tp group must sit on one host; every layer all-reduces activations within it. tp groups are
    consecutive ranks."""
    groups = [list(range(first, first + tp)) for first in range(0, len(hosts), tp)]
    spanning = [ranks for ranks in groups if len({hosts[r] for r in ranks}) > 1]
    if not spanning:
        return []
    ranks = spanning[0]
    their_hosts = ", ".join(sorted({hosts[r] for r in ranks}))
    return [
        f"{len(spanning)} tensor-parallel group(s) span several hosts, e.g. ranks {ranks[0]}-{ranks[-1]} "
        f"on {their_hosts}: every layer all-reduces activations over the "
        "(slow) network between them. Set parallelism.tp to at most the number of GPUs per node (and "
        "launch the same number of processes on every node); use dp or pp across nodes."
    ]


def cp_host_warnings(rings: list[tuple[int, ...]], hosts: list[str]) -> list[str]:
    """T3 for cp: a ring across hosts sends each step's keys and values over the network."""
    spanning = [ring for ring in rings if len({hosts[r] for r in ring}) > 1]
    if not spanning:
        return []
    ring = spanning[0]
    their_hosts = ", ".join(sorted({hosts[r] for r in ring}))
    return [
        f"{len(spanning)} context-parallel ring(s) span several hosts, e.g. ranks "
        f"{', '.join(map(str, ring))} on {their_hosts}: every layer's ring steps cross the network. Each "
        "step's transfer overlaps a block's attention; when `cp comm` in the step line is large, keep "
        "parallelism.tp * parallelism.cp within a node and use dp or pp across nodes."
    ]
