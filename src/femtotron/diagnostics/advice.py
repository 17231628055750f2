"""Advice on settings that are legal but risky (N1, N2, P2) or slow (M3), worded as warnings; the trainer
logs them at start and `femtotron doctor` prints them. Like the config itself, this needs no torch."""

from __future__ import annotations

from femtotron.config import Config
from femtotron.config.pipeline_engines import ENGINES
from femtotron.config.rules import fixes_that_hold
from femtotron.parallel.pipeline.partition import IMBALANCE_WARNING, Stage, partition


def _typical_lr(n_params: int) -> float:
    """Rough usual peak AdamW lr by model size: small models tolerate (and need) larger steps."""
    if n_params < 100_000_000:
        return 3e-3
    return 1e-3 if n_params < 1_000_000_000 else 3e-4


def config_warnings(config: Config) -> list[str]:
    """Legal but risky settings (N1, N2, P2), worded as advice; the trainer logs them at start."""
    out: list[str] = []
    sched = config.optimizer.learning_rate_scheduler
    lr = sched.learning_rate
    steps = config.tokens.train_steps
    n_params = config.model.model_config_.parameter_count
    typical = _typical_lr(n_params)
    if config.optimizer.clip_grad is None:
        out.append(
            "optimizer.clip_grad is null, so gradient clipping is off: one bad batch can push the weights "
            "to NaN mid-run. Set optimizer.clip_grad: 1.0 unless you mean it."
        )
    if lr > 10 * typical:
        out.append(
            f"optimizer.learning_rate_scheduler.learning_rate={lr:g} is {lr / typical:.0f}x the usual "
            f"{typical:g} for a {n_params / 1e6:.1f}M-parameter model; expect loss spikes or NaN. "
            f"Try learning_rate: {typical:g} or lower."
        )
    if lr < 1e-6:
        out.append(
            f"optimizer.learning_rate_scheduler.learning_rate={lr:g} is so small the model will barely "
            f"move; the usual value for this size is about {typical:g}."
        )
    if sched.lr_warmup_steps > steps:
        out.append(
            f"optimizer.learning_rate_scheduler.lr_warmup_steps={sched.lr_warmup_steps} is longer than "
            f"tokens.train_steps={steps}: the warm-up is cut to the run's {steps} steps, so the learning "
            "rate reaches its peak at the last step and never decays. For a whole schedule set "
            f"lr_warmup_steps below {steps} (e.g. {steps // 10})."
        )
    if config.model.dtype == "float16":
        out.append(
            "model.dtype=float16 overflows above 65504: it trains with dynamic loss scaling, and a step "
            "whose gradients overflow is skipped (logged). Prefer model.dtype: bfloat16 where the hardware "
            "has it: same memory, float32's range, no loss scaling and no skipped steps."
        )
    par = config.parallelism
    accumulation = config.tokens.batch_accumulation_per_replica
    if par.pp > 1 and accumulation < 4 * par.pp:
        bubble = par.engine.bubble(par.pp, accumulation, par.pp_virtual_stages)
        # The engines that would idle less, each as the rules would take it: an interleaving one with at
        # least 2 virtual stages, any other with 1.
        faster = []
        for engine in ENGINES.values():
            virtual = max(par.pp_virtual_stages, 2) if engine.interleaves else 1
            idle = engine.bubble(par.pp, accumulation, virtual)
            if idle < bubble:
                chunks = ""
                if virtual < par.pp_virtual_stages:
                    chunks = f" with pp_virtual_stages={virtual}"
                changes = {"parallelism.pp_engine": engine.name, "parallelism.pp_virtual_stages": virtual}
                faster.append((f"pp_engine={engine.name}{chunks} (idles {idle:.0%})", changes))
        others = fixes_that_hold(config, faster)
        ending = "."
        if others:
            ending = f", or {' or '.join(others)}."
        out.append(
            f"tokens.batch_accumulation_per_replica={accumulation} micro-batches with pp={par.pp}: the "
            f"pipeline idles for about {bubble:.0%} of each step (P2). Use at least 4 * pp = {4 * par.pp} "
            f"micro-batches (lower tokens.micro_batch_size to keep the batch){ending}"
        )
    zero = config.optimizer.zero
    if zero.shards_optimizer and par.dp * par.cp == 1:
        out.append(
            f"optimizer.zero_stage={zero.number} with parallelism.dp=1 (and cp=1): {zero.name} shards over "
            "the dp x cp ranks, so with one it saves nothing. Raise parallelism.dp to save memory."
        )
    if config.model.init_method.std > 0.1:
        out.append(
            f"model.init_method.std={config.model.init_method.std:g} is large: activations grow layer by "
            "layer and the first steps can be NaN. The usual value is 0.02."
        )
    return out + data_warnings(config)


def data_warnings(config: Config) -> list[str]:
    """Data stages the run never reaches, and random tokens said aloud."""
    out = []
    steps = config.tokens.train_steps
    for i, stage in enumerate(config.data.stages or []):
        if stage.start_training_step > steps:
            out.append(
                f"data.stages.{i} ({stage.name!r}) starts at step {stage.start_training_step}, after the "
                f"run's last step (tokens.train_steps={steps}): it is never read. Raise train_steps, or move "
                "its start_training_step earlier."
            )
    for i, stage in enumerate(config.data.stage_list()):
        if not stage.synthetic:
            continue
        where = config.data.stage_path(i)
        named = f" ({stage.name!r})" if config.data.stages else ""
        out.append(
            f"{where}.synthetic{named}: this run trains on random token ids, uniform over the vocabulary, to "
            f"measure throughput: the loss cannot fall below ln(vocab_size). Set {where}.dataset_folder (or "
            f"{where}.text_dataset) instead to train a model."
        )
    return out


def rank_imbalance(stages: list[Stage], pp: int) -> float:
    """The busiest pp rank's compute per micro-batch (all its chunks) over the mean rank's: the others
    wait."""
    costs = [sum(s.cost for s in stages if s.index % pp == rank) for rank in range(pp)]
    return max(costs) * pp / sum(costs)


def imbalance_warning(config: Config, stages: list[Stage]) -> str | None:
    """M3: a warning when one pp rank computes much more than the mean, with fixes that the config rules
    accept and that balance the ranks better."""
    par = config.parallelism
    mcfg = config.model.model_config_
    sequence = config.tokens.sequence_length
    ratio = rank_imbalance(stages, par.pp)
    if ratio <= 1 + IMBALANCE_WARNING:
        return None
    slowest = max(stages, key=lambda s: s.cost)

    def imbalance(layers: int, virtual: int) -> float:
        if layers < par.pp * virtual:  # too few layers for a stage each: not a layout at all
            return float("inf")
        finer = mcfg.model_copy(update={"num_hidden_layers": layers})
        return rank_imbalance(partition(finer, sequence, par.pp * virtual), par.pp)

    virtual = par.pp_virtual_stages + 1 if par.pp_virtual_stages > 1 else 2
    fixes: list[str] = []
    if imbalance(mcfg.num_hidden_layers, virtual) < ratio:
        if virtual == 2:
            more_chunks = f"parallelism.pp_engine=interleaved-1f1b with pp_virtual_stages={virtual}"
        else:
            more_chunks = f"parallelism.pp_virtual_stages={virtual}"
        overrides = {"parallelism.pp_engine": "interleaved-1f1b", "parallelism.pp_virtual_stages": virtual}
        fixes = fixes_that_hold(config, [(more_chunks, overrides)])
    # More layers give the LM head room on the last stage: the smallest count that balances within the limit.
    candidates = range(mcfg.num_hidden_layers + 1, 4 * mcfg.num_hidden_layers + 4 * par.pp)
    balanced = (n for n in candidates if imbalance(n, par.pp_virtual_stages) <= 1 + IMBALANCE_WARNING)
    layers = next(balanced, None)
    if layers is not None:
        fixes.append(
            f"model.model_config.num_hidden_layers={layers} (room for the LM head on the last stage)"
        )
    head_layers = mcfg.head_flops / mcfg.layer_flops(sequence)
    if fixes:
        advice = f" Balance them with {', or '.join(fixes)}."
    else:
        advice = (
            f" The final norm + LM head alone cost {head_layers:.1f} layers' worth: fewer pipeline stages "
            "(parallelism.pp) balance better."
        )
    return (
        f"pipeline stage {slowest.index} ({slowest.describe()}) makes its pp rank compute {ratio:.2f}x the "
        f"mean rank, and every other rank waits for it on each micro-batch (M3).{advice}"
    )
