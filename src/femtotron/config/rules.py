"""The config's cross-field rules, its warnings, and the checks a launcher runs (L1).

Each rule is a small function that returns a `Problem` naming every field involved and a fix, or
None; `RULES` lists them all. A fix is only suggested when the config with it applied breaks no rule
on the fields it touches (`holds`), so advice never goes in a circle.

The rules read a config's fields only, so they take `ConfigFields` (config/sections.py): `Config` calls
them from its validator, and importing it here would make the two modules import each other.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NoReturn, TypeVar

from femtotron.config.sections import ConfigFields, LlamaConfig
from femtotron.config.zero_stages import ZERO_STAGES
from femtotron.errors import ConfigError
from femtotron.mesh import WORLD_DIMENSIONS, Mesh

M = "model.model_config."
# The most decoder layers a model may have. The largest trained have about 130; a config from elsewhere with
# 1e9 would make everything built per layer (the model, the checks of it) exhaust the machine.
MAX_LAYERS = 1024
# The most micro-batches a replica accumulates per step: thousands at the largest batches trained; doctor
# walks a pipeline's schedule action by action (a billion took minutes), and so would every step.
MAX_MICRO_BATCHES = 2**16
# The most elements one tensor may have: 2^40, 2 TiB in bf16, 14 times the largest GPU's memory. A size
# past it is a typo or a hostile file's, and would overflow even the meta device's byte counts (doctor builds
# there).
MAX_TENSOR_ELEMENTS = 2**40
# A config of any class, given back as the same class by `with_changes` (a `Config` stays a `Config`).
AnyConfig = TypeVar("AnyConfig", bound=ConfigFields)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: the dotted paths involved, where each was set, and what to do."""

    fields: tuple[str, ...]
    message: str
    locations: tuple[str, ...] = ()

    @property
    def path(self) -> str:
        return self.fields[0] if self.fields else ""

    def __str__(self) -> str:
        locations = self.locations or ("",) * len(self.fields)
        where = [f"{f} ({loc})" if loc else f for f, loc in zip(self.fields, locations, strict=True)]
        return f"{', '.join(where)}: {self.message}" if where else self.message


def raise_problems(header: str, problems: list[Problem]) -> NoReturn:
    """Raise one ConfigError listing every problem; `.problems` keeps them for callers and tests."""
    error = ConfigError("\n".join([f"{header}:", *(f"  - {p}" for p in problems)]))
    error.problems = problems
    raise error


def with_changes(cfg: AnyConfig, changes: dict[str, Any]) -> AnyConfig:
    """`cfg` with dotted keys set, e.g. {"parallelism.pp": 2} (not validated: `holds` checks the rules)."""
    nested: dict[str, Any] = {}
    for key, value in changes.items():
        *parents, leaf = key.replace(M, "model.model_config_.").split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    def apply(model: Any, update: dict[str, Any]) -> Any:
        changed = {k: apply(getattr(model, k), v) if isinstance(v, dict) else v for k, v in update.items()}
        return model.model_copy(update=changed)

    return apply(cfg, nested)


def holds(cfg: ConfigFields, changes: dict[str, Any]) -> bool:
    """Whether applying `changes` leaves no rule broken on the fields it touches."""
    touched = set(changes)
    return not any(touched & set(p.fields) for p in rule_problems(with_changes(cfg, changes)))


def fixes_that_hold(cfg: ConfigFields, candidates: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The texts of the candidate fixes that hold, in their order."""
    return [text for text, changes in candidates if holds(cfg, changes)]


def _divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending, by trial division up to sqrt(n) in at most 2^20 steps: all of them
    for any n up to 2^40 (every real size); of a larger n (a hostile config's), those below 2^20 and their
    cofactors, so the fixes suggested stay true."""
    small = [d for d in range(1, min(math.isqrt(n), 2**20) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _join(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


def _nearest_multiples(n: int, k: int) -> str:
    low = n // k * k
    return f"{low} or {low + k}" if low else str(k)


def _head_fix(hidden: int, heads: int) -> str:
    """Head counts near `heads` that split `hidden` into even head dims, and hidden sizes that fit `heads`."""
    fitting = sorted((d for d in _divisors(hidden) if (hidden // d) % 2 == 0), key=lambda d: abs(d - heads))
    sizes = f"hidden_size to {_nearest_multiples(hidden, 2 * heads)}"
    if not fitting:  # an odd hidden_size has no even head_dim at all
        return f"set {sizes}"
    return f"set num_attention_heads to one of {_join(sorted(fitting[:4]))}, or {sizes}"


def working_tp(cfg: ConfigFields) -> list[int]:
    """tp values that split this model's heads, MLP (and sequence, for REDUCE_SCATTER) evenly."""
    m = cfg.model.model_config_
    seq = cfg.tokens.sequence_length
    rs = cfg.parallelism.tp_mode == "REDUCE_SCATTER"
    candidates = _divisors(math.gcd(m.num_attention_heads, m.num_key_value_heads))
    return [t for t in candidates if m.intermediate_size % t == 0 and (not rs or seq % t == 0)]


def heads_split_hidden(cfg: ConfigFields) -> Problem | None:
    m = cfg.model.model_config_
    fields = (M + "hidden_size", M + "num_attention_heads")
    if m.head_dim != m.hidden_size // m.num_attention_heads:  # set on its own (Qwen3): need not fill hidden
        if m.head_dim % 2 == 0:
            return None
        return Problem(
            (M + "head_dim",),
            f"head_dim={m.head_dim} is odd; RoPE rotates pairs of dims, so it must be even. Fix: head_dim="
            f"{m.head_dim + 1}.",
        )
    if m.hidden_size % m.num_attention_heads:
        return Problem(
            fields,
            f"hidden_size={m.hidden_size} must be divisible by num_attention_heads="
            f"{m.num_attention_heads} (each head gets hidden_size / num_attention_heads dims). "
            f"Fix: {_head_fix(m.hidden_size, m.num_attention_heads)}.",
        )
    if m.head_dim % 2:
        return Problem(
            fields,
            f"head_dim = hidden_size / num_attention_heads = {m.hidden_size}/"
            f"{m.num_attention_heads} = {m.head_dim} is odd; RoPE rotates pairs of dims, so it must be "
            f"even. Fix: {_head_fix(m.hidden_size, m.num_attention_heads)}.",
        )
    return None


def kv_heads_split_heads(cfg: ConfigFields) -> Problem | None:
    m = cfg.model.model_config_
    if m.num_attention_heads % m.num_key_value_heads == 0:
        return None
    return Problem(
        (M + "num_attention_heads", M + "num_key_value_heads"),
        f"num_attention_heads={m.num_attention_heads} must be divisible by num_key_value_heads="
        f"{m.num_key_value_heads} (each key/value head serves a whole group of query heads). "
        f"Fix: num_key_value_heads one of {_join(_divisors(m.num_attention_heads))}.",
    )


def heads_split_over_tp(cfg: ConfigFields) -> Problem | None:
    m = cfg.model.model_config_
    tp = cfg.parallelism.tp
    if m.num_attention_heads % tp == 0 and m.num_key_value_heads % tp == 0:
        return None
    return Problem(
        (M + "num_attention_heads", M + "num_key_value_heads", "parallelism.tp"),
        f"num_attention_heads={m.num_attention_heads} and num_key_value_heads={m.num_key_value_heads} must "
        f"both be divisible by tp={tp} (each tensor-parallel rank holds whole query and key/value heads). "
        f"Fix: tp values that would work: {_join(working_tp(cfg))}.",
    )


def mlp_splits_over_tp(cfg: ConfigFields) -> Problem | None:
    m = cfg.model.model_config_
    tp = cfg.parallelism.tp
    if m.intermediate_size % tp == 0 or m.moe_layer_count == m.num_hidden_layers:  # no dense MLP
        return None
    return Problem(
        (M + "intermediate_size", "parallelism.tp"),
        f"intermediate_size={m.intermediate_size} must be divisible by tp={tp} (the MLP is split over tp "
        f"ranks). Fix: intermediate_size={_nearest_multiples(m.intermediate_size, tp)}, "
        f"or tp one of {_join(working_tp(cfg))}.",
    )


def experts_split_over_tp_and_ep(cfg: ConfigFields) -> Problem | None:
    moe = cfg.model.model_config_.moe
    par = cfg.parallelism
    if moe is None:
        return None
    if moe.num_experts_per_tok > moe.num_experts:
        return Problem(
            (f"{M}moe.num_experts_per_tok", f"{M}moe.num_experts"),
            f"each token takes num_experts_per_tok={moe.num_experts_per_tok} of the num_experts="
            f"{moe.num_experts} experts. Fix: num_experts_per_tok <= {moe.num_experts}.",
        )
    for field, n, over, split in (
        ("intermediate_size", moe.intermediate_size, "tp", par.tp),
        ("num_experts", moe.num_experts, "ep", par.ep),
    ):
        if n % split:
            return Problem(
                (f"{M}moe.{field}", f"parallelism.{over}"),
                f"{field}={n} is not divisible by {over}={split} (the experts are split over {over} ranks). "
                f"Fix: {over} one of {_join(_divisors(n))}, or {field}={_nearest_multiples(n, split)}.",
            )
    return None


def experts_split_over_data_parallel_ranks(cfg: ConfigFields) -> Problem | None:
    par = cfg.parallelism
    moe = cfg.model.model_config_.moe
    if par.ep == 1 or (moe is not None and (par.dp * par.cp) % par.ep == 0):
        return None
    if moe is None:
        return Problem(
            ("parallelism.ep", f"{M}moe"),
            f"ep={par.ep} splits the experts of a mixture of experts, but the model is dense (no "
            f"model_config.moe). Fix: ep=1, or give the model a moe section.",
        )
    return Problem(
        ("parallelism.ep", "parallelism.dp", "parallelism.cp"),
        f"ep={par.ep} must divide dp * cp = {par.dp * par.cp}: the experts are split over ep of the ranks "
        f"that hold the same dense parameters. Fix: ep one of {_join(_divisors(par.dp * par.cp))}, or raise "
        "dp.",
    )


def layers_within_bound(cfg: ConfigFields) -> Problem | None:
    layers = cfg.model.model_config_.num_hidden_layers
    if layers <= MAX_LAYERS:
        return None
    return Problem(
        (M + "num_hidden_layers",),
        f"num_hidden_layers={layers} is more than {MAX_LAYERS} (rule: at most {MAX_LAYERS}; the largest "
        f"models have about 130). Fix: num_hidden_layers={MAX_LAYERS} or fewer; check the config's source.",
    )


def micro_batches_within_bound(cfg: ConfigFields) -> Problem | None:
    accumulation = cfg.tokens.batch_accumulation_per_replica
    if accumulation <= MAX_MICRO_BATCHES:
        return None
    return Problem(
        ("tokens.batch_accumulation_per_replica",),
        f"{accumulation:,} micro-batches per step is more than {MAX_MICRO_BATCHES:,} (rule: at most "
        f"{MAX_MICRO_BATCHES:,}; the largest batches trained take thousands). Fix: raise "
        "tokens.micro_batch_size or parallelism.dp instead; check the config's source.",
    )


def model_tensor_too_large(m: LlamaConfig, prefix: str = M) -> Problem | None:
    """The first of the model's largest tensors with more than MAX_TENSOR_ELEMENTS elements, its fields named
    with `prefix` (config.json's have none)."""
    sizes = {
        "the embedding": {"vocab_size": m.vocab_size, "hidden_size": m.hidden_size},
        "an MLP weight": {"hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size},
        "the query weight": {
            "hidden_size": m.hidden_size,
            "num_attention_heads": m.num_attention_heads,
            "head_dim": m.head_dim,
        },
        "each of RoPE's tables": {
            "max_position_embeddings": m.max_position_embeddings,
            "head_dim": m.head_dim,
        },
    }
    if m.moe is not None:
        sizes["each of a layer's expert weights"] = {
            "moe.num_experts": m.moe.num_experts,
            "moe.intermediate_size": m.moe.intermediate_size,
            "hidden_size": m.hidden_size,
        }
        sizes["the shared experts' weights"] = {
            "moe.num_shared_experts": m.moe.num_shared_experts,
            "moe.intermediate_size": m.moe.intermediate_size,
            "hidden_size": m.hidden_size,
        }
    return _too_large({what: {prefix + k: v for k, v in fields.items()} for what, fields in sizes.items()})


def tensors_within_bound(cfg: ConfigFields) -> Problem | None:
    m = cfg.model.model_config_
    tokens = {
        "tokens.micro_batch_size": cfg.tokens.micro_batch_size,
        "tokens.sequence_length": cfg.tokens.sequence_length,
    }
    return model_tensor_too_large(m) or _too_large(
        {
            "a micro-batch's activations": {**tokens, M + "hidden_size": m.hidden_size},
            "a micro-batch's logits": {**tokens, M + "vocab_size": m.vocab_size},
        }
    )


def _too_large(sizes: dict[str, dict[str, int]]) -> Problem | None:
    for what, fields in sizes.items():
        elements = math.prod(fields.values())
        if elements > MAX_TENSOR_ELEMENTS:
            product = " * ".join(f"{field.rsplit('.', 1)[-1]}={value}" for field, value in fields.items())
            return Problem(
                tuple(fields),
                f"{product} = {elements:,} elements in {what}, more than {MAX_TENSOR_ELEMENTS:,} (rule: "
                "at most 2^40 elements in a tensor, 2 TiB in bf16: no machine holds more). Fix: give the "
                "sizes of the model meant (hidden_size 4096, vocab_size 128256, intermediate_size 14336 for "
                "Llama 3 8B); check the config's source.",
            )
    return None


def listed_layers_exist(cfg: ConfigFields) -> Problem | None:
    """no_rope_layers, full_attention_layers and moe.dense_layers name layers of the model; the second only
    with a window."""
    m = cfg.model.model_config_
    lists = {"no_rope_layers": m.no_rope_layers, "full_attention_layers": m.full_attention_layers}
    if m.moe is not None:
        lists["moe.dense_layers"] = m.moe.dense_layers
    for key, listed in lists.items():
        outside = sorted(i for i in set(listed) if i >= m.num_hidden_layers)
        if outside:
            return Problem(
                (M + key, M + "num_hidden_layers"),
                f"{key} lists layers {outside}, but the model has layers 0 to {m.num_hidden_layers - 1}. "
                "Fix: list the indices (from 0) of layers that exist.",
            )
    if m.full_attention_layers and m.sliding_window is None:
        return Problem(
            (M + "full_attention_layers", M + "sliding_window"),
            "full_attention_layers lists the layers without the sliding window, but sliding_window is not "
            "set. Fix: set sliding_window, or remove full_attention_layers.",
        )
    return None


def enough_layers_for_the_stages(cfg: ConfigFields) -> Problem | None:
    layers = cfg.model.model_config_.num_hidden_layers
    par = cfg.parallelism
    if layers >= par.pp * par.pp_virtual_stages:
        return None
    if par.pp_virtual_stages == 1:
        return Problem(
            (M + "num_hidden_layers", "parallelism.pp"),
            f"num_hidden_layers={layers} must be >= pp={par.pp} (every pipeline stage needs at least one "
            f"layer). Fix: pp={layers} or less, or num_hidden_layers={par.pp} or more.",
        )
    fewer = range(layers // par.pp, 1, -1)
    candidates = [(f"pp_virtual_stages={v}", {"parallelism.pp_virtual_stages": v}) for v in fewer]
    no_interleaving = {"parallelism.pp_engine": "1f1b", "parallelism.pp_virtual_stages": 1}
    candidates.append(("pp_engine=1f1b with pp_virtual_stages=1 (no interleaving)", no_interleaving))
    fewer_chunks = fixes_that_hold(cfg, candidates)
    fix = ", or ".join([*fewer_chunks[:1], f"num_hidden_layers={par.pp * par.pp_virtual_stages} or more"])
    return Problem(
        (M + "num_hidden_layers", "parallelism.pp", "parallelism.pp_virtual_stages"),
        f"num_hidden_layers={layers} must be >= pp * pp_virtual_stages = {par.pp} * {par.pp_virtual_stages} "
        f"= {par.pp * par.pp_virtual_stages} (every virtual stage needs at least one layer). Fix: {fix}.",
    )


def interleaving_needs_several_ranks(cfg: ConfigFields) -> Problem | None:
    par = cfg.parallelism
    if not par.engine.interleaves or par.pp >= 2:
        return None
    return Problem(
        ("parallelism.pp_engine", "parallelism.pp"),
        f"pp_engine={par.pp_engine} interleaves model chunks over several pipeline ranks, so pp must be "
        ">= 2. Fix: pp_engine=1f1b (with pp=1 it runs as afab and interleaving would).",
    )


def interleaving_needs_several_chunks(cfg: ConfigFields) -> Problem | None:
    par = cfg.parallelism
    if not par.engine.interleaves or par.pp_virtual_stages >= 2:
        return None
    return Problem(
        ("parallelism.pp_engine", "parallelism.pp_virtual_stages"),
        f"pp_engine={par.pp_engine} gives each pp rank several model chunks, so pp_virtual_stages must be "
        f">= 2 (it is {par.pp_virtual_stages}). Fix: pp_virtual_stages=2, or pp_engine=1f1b.",
    )


def chunks_need_interleaving(cfg: ConfigFields) -> Problem | None:
    par = cfg.parallelism
    if par.engine.interleaves or par.pp_virtual_stages == 1:
        return None
    return Problem(
        ("parallelism.pp_engine", "parallelism.pp_virtual_stages"),
        f"pp_virtual_stages={par.pp_virtual_stages} needs pp_engine=interleaved-1f1b (pp_engine="
        f"{par.pp_engine} runs one model chunk per pp rank). Fix: pp_engine=interleaved-1f1b, or "
        "pp_virtual_stages=1.",
    )


def interleaving_takes_micro_batches_in_groups_of_pp(cfg: ConfigFields) -> Problem | None:
    par = cfg.parallelism
    accumulation = cfg.tokens.batch_accumulation_per_replica
    if not par.engine.interleaves or par.pp < 2 or accumulation % par.pp == 0:
        return None
    return Problem(
        ("parallelism.pp_engine", "tokens.batch_accumulation_per_replica", "parallelism.pp"),
        f"pp_engine={par.pp_engine} sends micro-batches through the chunks in groups of pp, so "
        f"batch_accumulation_per_replica={accumulation} must be divisible by pp={par.pp}. Fix: "
        f"batch_accumulation_per_replica={_nearest_multiples(accumulation, par.pp)}.",
    )


def sequence_fits_the_positions(cfg: ConfigFields) -> Problem | None:
    sequence = cfg.tokens.sequence_length
    positions = cfg.model.model_config_.max_position_embeddings
    if sequence <= positions:
        return None
    return Problem(
        ("tokens.sequence_length", M + "max_position_embeddings"),
        f"sequence_length={sequence} must be <= max_position_embeddings={positions} (RoPE is only set up for "
        f"that many positions). Fix: sequence_length={positions}, or max_position_embeddings={sequence}.",
    )


def sequence_splits_over_cp_and_tp(cfg: ConfigFields) -> Problem | None:
    par = cfg.parallelism
    sequence = cfg.tokens.sequence_length
    chunks = 2 * par.cp if par.cp > 1 else 1  # cp's zigzag: 2 * cp chunks, two per cp rank
    split = chunks * (par.tp if par.tp_mode == "REDUCE_SCATTER" else 1)
    if sequence % split == 0:
        return None
    fields = ["tokens.sequence_length"]
    why = []
    if par.cp > 1:
        fields.append("parallelism.cp")
        why.append(f"cp={par.cp} cuts every sequence into 2 * cp = {chunks} chunks (two per cp rank)")
    if par.tp_mode == "REDUCE_SCATTER":
        fields += ["parallelism.tp_mode", "parallelism.tp"]
        why.append(f"tp_mode=REDUCE_SCATTER splits each rank's part of it over tp={par.tp} ranks")
    other = " or tp_mode=ALL_REDUCE" if par.tp_mode == "REDUCE_SCATTER" else ""
    return Problem(
        tuple(fields),
        f"{'; '.join(why)}, so sequence_length={sequence} must be divisible by {split}. Fix: "
        f"sequence_length={_nearest_multiples(sequence, split)}{other}.",
    )


def zero_stage_implemented(cfg: ConfigFields) -> Problem | None:
    """zero_stage names a record of ZERO_STAGES: every other reader asks `optimizer.zero`."""
    stage = cfg.optimizer.zero_stage
    if stage in (known.number for known in ZERO_STAGES):
        return None
    sharding = [f"{known.number} ({known.adds})" for known in ZERO_STAGES if known.shards_optimizer]
    return Problem(
        ("optimizer.zero_stage",),
        f"zero_stage={stage} does not exist: ZeRO has stages {', '.join(sharding[:-1])} and {sharding[-1]}. "
        f"Fix: zero_stage={ZERO_STAGES[-1].number} to shard everything.",
    )


# ZeRO-3's own settings, each with what its value false does: below stage 3 it would change nothing.
ZERO3_SETTINGS = {
    "reshard_after_forward": "keeps ZeRO-3's gathered parameters from forward to backward",
    "reduce_every_micro_batch": "reduces ZeRO-3's gradients once per step, not after each micro-batch",
}


def zero3_settings_need_zero3(cfg: ConfigFields) -> Problem | None:
    optimizer = cfg.optimizer
    changed = [key for key in ZERO3_SETTINGS if not getattr(optimizer, key)]
    if not changed:
        return None
    # Every rule runs, this one too on a stage ZeRO does not have: that has no record (zero_stage_implemented
    # says so) and shards nothing.
    if zero_stage_implemented(cfg) is None and optimizer.zero.shards_parameters:
        return None
    key = changed[0]
    return Problem(
        (f"optimizer.{key}", "optimizer.zero_stage"),
        f"{key}=false {ZERO3_SETTINGS[key]}, but zero_stage={optimizer.zero_stage} does not shard the "
        f"parameters, so it would change nothing. Fix: remove optimizer.{key}, or set "
        "optimizer.zero_stage=3.",
    )


def muon_settings_need_muon(cfg: ConfigFields) -> Problem | None:
    factory = cfg.optimizer.optimizer_factory
    fields = type(factory).model_fields
    changed = [
        name for name in fields if name.startswith("muon_") and getattr(factory, name) != fields[name].default
    ]
    if factory.name == "muon" or not changed:
        return None
    paths = tuple(f"optimizer.optimizer_factory.{name}" for name in changed)
    return Problem(
        ("optimizer.optimizer_factory.name", *paths),
        f"{', '.join(changed)} set, but optimizer_factory.name={factory.name}: only Muon reads them, so they "
        "would change nothing. Fix: optimizer_factory.name=muon, or remove them.",
    )


def loss_scale_range(cfg: ConfigFields) -> Problem | None:
    scaling = cfg.optimizer.loss_scale
    if scaling.min_scale <= scaling.initial_scale:
        return None
    return Problem(
        ("optimizer.loss_scale.min_scale", "optimizer.loss_scale.initial_scale"),
        f"min_scale={scaling.min_scale:g} must be <= initial_scale={scaling.initial_scale:g} (the scale "
        f"only goes down to min_scale). Fix: min_scale=1, or initial_scale={scaling.min_scale:g}.",
    )


def decay_ends_below_the_peak(cfg: ConfigFields) -> Problem | None:
    sched = cfg.optimizer.learning_rate_scheduler
    if sched.min_decay_lr <= sched.learning_rate:
        return None
    return Problem(
        ("optimizer.learning_rate_scheduler.min_decay_lr", "optimizer.learning_rate_scheduler.learning_rate"),
        f"min_decay_lr={sched.min_decay_lr:g} must be <= learning_rate={sched.learning_rate:g} (decay goes "
        f"down to it). Fix: min_decay_lr={sched.learning_rate / 10:g} (a tenth of learning_rate).",
    )


_SOURCES = (
    "dataset_folder (tokenized data: a .bin/.idx prefix, a datatrove folder, a directory, a list or "
    "{prefix: weight}), text_dataset (text tokenized at start) or synthetic: true (random tokens, for "
    "throughput)"
)


def data_has_one_source(cfg: ConfigFields) -> Problem | None:
    """The data section, or each of its stages, names exactly one source of samples."""
    data = cfg.data
    if data.stages:
        given = data.sources_set
        if given:
            return Problem(
                tuple(f"data.{key}" for key in ("stages", *given)),
                f"with data.stages every stage names its own data; {', '.join(given)} beside them would be "
                "unused. Fix: move it into the first stage, or delete data.stages.",
            )
        for i, stage in enumerate(data.stages):
            if len(stage.sources_set) != 1:
                return _source_problem(f"data.stages.{i}.", stage.sources_set)
        return None
    return None if len(data.sources_set) == 1 else _source_problem("data.", data.sources_set)


def _source_problem(prefix: str, given: list[str]) -> Problem:
    if not given:
        return Problem(
            (prefix + "dataset_folder",),
            f"no training data: set {prefix}{_SOURCES}, or list data.stages.",
        )
    return Problem(
        tuple(prefix + key for key in given),
        f"{' and '.join(given)} are set together; a source of samples is one of them. Fix: keep one.",
    )


def text_needs_a_tokenizer(cfg: ConfigFields) -> Problem | None:
    """Text is tokenized at start with the run's tokenizer: there must be one."""
    if cfg.tokenizer.tokenizer_name_or_path is not None:
        return None
    for index, stage in enumerate(cfg.data.stage_list()):
        if stage.text_dataset is not None:
            return Problem(
                (f"{cfg.data.stage_path(index)}.text_dataset", "tokenizer.tokenizer_name_or_path"),
                "text is tokenized at start with the run's tokenizer, and none is set. Fix: set "
                "tokenizer.tokenizer_name_or_path to a tokenizer.json or a Hugging Face tokenizer directory.",
            )
    return None


def stages_in_order(cfg: ConfigFields) -> Problem | None:
    """Data stages start at step 1, in increasing order, under names of their own."""
    stages = cfg.data.stages or []
    names = [stage.name for stage in stages]
    starts = [stage.start_training_step for stage in stages]
    if stages and starts[0] != 1:
        return Problem(
            ("data.stages.0.start_training_step",),
            f"the first data stage starts at step {starts[0]}: steps 1 to {starts[0] - 1} would have no "
            "data. Fix: start_training_step: 1.",
        )
    for i in range(1, len(stages)):
        if starts[i] <= starts[i - 1]:
            return Problem(
                (f"data.stages.{i}.start_training_step", f"data.stages.{i - 1}.start_training_step"),
                f"stage {names[i]!r} starts at step {starts[i]}, not after stage {names[i - 1]!r} (step "
                f"{starts[i - 1]}): stages are listed in the order they start. Fix: reorder them, or give "
                "each its own start step.",
            )
    for i, name in enumerate(names):
        if name in names[:i]:
            return Problem(
                (f"data.stages.{i}.name",),
                f"two data stages are named {name!r}: a checkpoint records its stage by name. Fix: "
                "rename one.",
            )
    return None


RULES: list[Callable[[ConfigFields], Problem | None]] = [
    heads_split_hidden,
    kv_heads_split_heads,
    heads_split_over_tp,
    mlp_splits_over_tp,
    experts_split_over_tp_and_ep,
    experts_split_over_data_parallel_ranks,
    layers_within_bound,
    micro_batches_within_bound,
    tensors_within_bound,
    listed_layers_exist,
    enough_layers_for_the_stages,
    interleaving_needs_several_ranks,
    interleaving_needs_several_chunks,
    chunks_need_interleaving,
    interleaving_takes_micro_batches_in_groups_of_pp,
    sequence_fits_the_positions,
    sequence_splits_over_cp_and_tp,
    zero_stage_implemented,
    zero3_settings_need_zero3,
    muon_settings_need_muon,
    loss_scale_range,
    decay_ends_below_the_peak,
    data_has_one_source,
    stages_in_order,
    text_needs_a_tokenizer,
]


def rule_problems(cfg: ConfigFields) -> list[Problem]:
    """Every cross-field rule the config breaks, each naming all the fields involved and a fix."""
    return [problem for rule in RULES if (problem := rule(cfg)) is not None]


def check_world_size(config: ConfigFields, world_size: int) -> None:
    """Raise ConfigError unless the mesh's size (dp * cp * tp * pp) is world_size, listing the layouts that
    would work (L1)."""
    mesh = Mesh.of(config.parallelism)
    if mesh.world_size == world_size:
        return
    fields = tuple(f"parallelism.{name}" for name in WORLD_DIMENSIONS)
    valid = [
        layout
        for layout in _layouts(world_size, mesh.ep)
        if not rule_problems(with_changes(config, _sizes(layout)))
    ]
    # Suggest keeping every size but dp's when that works: it changes the least.
    keep = replace(mesh, dp=world_size // (mesh.world_size // mesh.dp))
    if keep in valid:
        best = keep
    elif valid:
        best = valid[0]
    else:
        best = None
    listing = "; ".join(layout.describe() for layout in valid[:12])
    if len(valid) > 12:
        listing += f"; ... and {len(valid) - 12} more"
    processes = f"{mesh.world_size} process{'es' if mesh.world_size > 1 else ''}"
    product = " * ".join(f"{name}={mesh.size(name)}" for name in WORLD_DIMENSIONS)  # cp too, even at 1
    experts = f" (ep={mesh.ep} is carved out of dp * cp: no processes of its own)" if mesh.ep > 1 else ""
    message = (
        f"{product} = {mesh.world_size}{experts}, but WORLD_SIZE={world_size} processes were launched; "
        f"{' * '.join(WORLD_DIMENSIONS)} must equal WORLD_SIZE. Fix: launch {processes}, or choose a layout "
        f"for {world_size}: {listing or 'none fits this model'}."
    )
    if best:
        overrides = " ".join(f"{field}={value}" for field, value in _sizes(best).items())
        message += f" For example, add the overrides: {overrides}"
    raise_problems("Parallel layout does not match the number of processes", [Problem(fields, message)])


def _sizes(layout: Mesh) -> dict[str, int]:
    """The layout as config overrides, {"parallelism.dp": 2, ...}, in the order messages name them."""
    return {f"parallelism.{name}": layout.size(name) for name in WORLD_DIMENSIONS}


def _layouts(world_size: int, ep: int) -> list[Mesh]:
    """All meshes of world_size processes, most data-parallel first (the simplest layout), then the least
    context parallel (cp only when the sequence needs it)."""
    layouts = [
        Mesh(dp=world_size // (c * t * p), cp=c, tp=t, pp=p, ep=ep)
        for c in _divisors(world_size)
        for t in _divisors(world_size // c)
        for p in _divisors(world_size // (c * t))
    ]
    return sorted(layouts, key=lambda layout: (-layout.dp, layout.cp, layout.tp, layout.pp))
