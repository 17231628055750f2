"""The typed config schema (nanotron's key names), its cross-field rules, and checks a launcher runs.

Nothing here imports torch or touches the network: a config is checked before any process exists,
so a bad one fails in a second with a message instead of hanging a cluster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from femtotron.errors import ConfigError

# Validation context flag: the loader checks the rules itself so it can report them next to field errors.
SKIP_RULES = "femtotron_skip_rules"


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


class _Section(BaseModel):
    # A misspelled key must be an error, never a silently ignored setting.
    model_config = ConfigDict(extra="forbid")


class GeneralArgs(_Section):
    project: str = "femtotron"
    run: str = "run"
    seed: NonNegativeInt = 42
    # M2: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless that variable is set already
    cuda_expandable_segments: bool = True


class LlamaConfig(_Section):
    vocab_size: PositiveInt = 32000
    hidden_size: PositiveInt = 4096
    intermediate_size: PositiveInt = 11008
    num_hidden_layers: PositiveInt = 32
    num_attention_heads: PositiveInt = 32
    num_key_value_heads: PositiveInt | None = None  # None: one KV head per query head (no GQA)
    max_position_embeddings: PositiveInt = 2048
    rope_theta: PositiveFloat = 10000.0
    rms_norm_eps: PositiveFloat = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: Literal["silu"] = "silu"

    @model_validator(mode="after")
    def _resolve_kv_heads(self) -> LlamaConfig:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class InitMethod(_Section):
    std: PositiveFloat = 0.02


class ModelArgs(_Section):
    # `model_config` is pydantic's own class attribute, so the field is `model_config_` in Python
    # and `model_config` in YAML, exactly as in nanotron.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model_config_: LlamaConfig = Field(default_factory=LlamaConfig, alias="model_config")
    init_method: InitMethod = Field(default_factory=InitMethod)
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"


class TokenizerArgs(_Section):
    tokenizer_name_or_path: str | None = None  # path to a tokenizer.json


class ParallelismArgs(_Section):
    dp: PositiveInt = 1
    tp: PositiveInt = 1
    pp: PositiveInt = 1
    pp_engine: Literal["1f1b", "afab", "interleaved-1f1b"] = "1f1b"
    pp_virtual_stages: PositiveInt = 1  # model chunks per pp rank; > 1 only with interleaved-1f1b
    tp_mode: Literal["ALL_REDUCE", "REDUCE_SCATTER"] = "ALL_REDUCE"
    recompute_layer: bool = False  # recompute each decoder layer's forward in backward (less memory)
    dp_bucket_size_mb: PositiveFloat = 25  # gradients reduced over dp in buckets of about this size
    init_timeout_seconds: PositiveFloat = 300
    collective_timeout_seconds: PositiveFloat = 600
    # an op in flight this long on any rank: every rank's state is gathered into one report and the job stops
    hang_timeout_seconds: PositiveFloat = 600


class TokensArgs(_Section):
    sequence_length: PositiveInt = 2048
    micro_batch_size: PositiveInt = 1
    batch_accumulation_per_replica: PositiveInt = 1
    train_steps: PositiveInt = Field(description="number of optimizer steps, an integer >= 1")
    val_check_interval: NonNegativeInt = 0  # 0: no validation
    limit_val_batches: PositiveInt = 8


class LRSchedulerArgs(_Section):
    learning_rate: PositiveFloat = 3e-4
    lr_warmup_steps: NonNegativeInt = 0
    lr_warmup_style: Literal["linear", "constant"] = "linear"
    lr_decay_style: Literal["cosine", "linear", "1-sqrt", "constant"] = "cosine"
    lr_decay_steps: NonNegativeInt | None = None  # None: decay until the last step
    lr_decay_starting_step: NonNegativeInt | None = None  # None: right after warm-up
    min_decay_lr: NonNegativeFloat = 0.0


class AdamWArgs(_Section):
    name: Literal["adamW"] = "adamW"
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.95, ge=0, lt=1)
    adam_eps: PositiveFloat = 1e-8
    torch_adam_is_fused: bool = True


class LossScaleArgs(_Section):
    """Dynamic loss scaling, used only with model.dtype=float16 (optim/loss_scale.py)."""

    initial_scale: PositiveFloat = 2.0**16
    growth_factor: float = Field(2.0, gt=1)
    backoff_factor: float = Field(0.5, gt=0, lt=1)
    growth_interval: PositiveInt = 1000  # clean steps before the scale grows
    min_scale: PositiveFloat = 1.0  # an overflow at this scale stops the run


class OptimizerArgs(_Section):
    zero_stage: NonNegativeInt = 0  # 0 or 1; 2 and 3 are refused by a rule
    weight_decay: NonNegativeFloat = 0.01
    clip_grad: PositiveFloat | None = 1.0  # None: no gradient clipping
    on_non_finite: Literal["stop", "skip"] = "stop"  # a non-finite loss or grad norm: stop, or drop the step
    accumulate_grad_in_fp32: bool = True
    learning_rate_scheduler: LRSchedulerArgs = Field(default_factory=LRSchedulerArgs)
    optimizer_factory: AdamWArgs = Field(default_factory=AdamWArgs)
    loss_scale: LossScaleArgs = Field(default_factory=LossScaleArgs)


DatasetSpec = str | list[str] | dict[str, float]


class DataArgs(_Section):
    dataset_folder: DatasetSpec = Field(
        description="a .bin/.idx path prefix or a directory, a list of them, or {prefix: weight}"
    )
    validation_folder: DatasetSpec | None = None
    seed: NonNegativeInt = 1234

    @field_validator("dataset_folder", "validation_folder", mode="wrap")
    @classmethod
    def _one_clear_error(cls, value: Any, handler: Any) -> Any:
        """Replace pydantic's three union-branch errors with one sentence, and reject empty specs."""
        if value is None:
            return handler(value)
        shape = (
            "must be a .bin/.idx path prefix or directory (string), "
            "a list of them, or a mapping {prefix: weight}"
        )
        try:
            spec = handler(value)
        except ValidationError:
            raise ValueError(shape) from None
        if not spec:
            raise ValueError(shape + ", and not empty")
        if isinstance(spec, dict) and not all(math.isfinite(w) and w > 0 for w in spec.values()):
            raise ValueError("every blend weight must be a finite number > 0 (drop a dataset instead of "
                             "giving it weight 0)")
        return spec


class CheckpointsArgs(_Section):
    checkpoints_path: str | None = None  # None: <run dir>/checkpoints
    checkpoint_interval: NonNegativeInt = 0  # save a checkpoint every N steps (and after the last); 0: never
    save_initial_state: bool = False  # also save one before the first step
    save_final_state: bool = True  # full-shape weights in the run directory at the end
    resume_checkpoint_path: str | None = None  # a step-NNNNNNN checkpoint, or a checkpoints directory (its latest)
    keep_last_n: PositiveInt | None = None  # delete older checkpoints beyond the newest N; None: keep all


class LoggingArgs(_Section):
    output_dir: str = "runs"
    iteration_step_info_interval: PositiveInt = 1
    log_level: Literal["debug", "info", "warning", "error"] = "info"


class Config(_Section):
    """A whole training run. Loading one builds nothing; every rule below is checked here."""

    general: GeneralArgs = Field(default_factory=GeneralArgs)
    model: ModelArgs = Field(default_factory=ModelArgs)
    tokenizer: TokenizerArgs = Field(default_factory=TokenizerArgs)
    parallelism: ParallelismArgs = Field(default_factory=ParallelismArgs)
    tokens: TokensArgs
    optimizer: OptimizerArgs = Field(default_factory=OptimizerArgs)
    data: DataArgs
    checkpoints: CheckpointsArgs = Field(default_factory=CheckpointsArgs)
    logging: LoggingArgs = Field(default_factory=LoggingArgs)

    @model_validator(mode="after")
    def _resolve_and_check(self, info: ValidationInfo) -> Config:
        sched = self.optimizer.learning_rate_scheduler
        if sched.lr_decay_starting_step is None:
            sched.lr_decay_starting_step = sched.lr_warmup_steps
        if sched.lr_decay_steps is None:
            sched.lr_decay_steps = max(0, self.tokens.train_steps - sched.lr_decay_starting_step)
        problems = [] if (info.context or {}).get(SKIP_RULES) else rule_problems(self)
        if problems:
            raise ValueError("\n".join(str(p) for p in problems))
        return self

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step, over all micro-batches and data-parallel replicas."""
        t = self.tokens
        return t.micro_batch_size * t.batch_accumulation_per_replica * self.parallelism.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.tokens.sequence_length

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.output_dir) / self.general.run

    @property
    def head_dim(self) -> int:
        return self.model.model_config_.head_dim

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-dumpable dict with the YAML key names; `load_config_dict` turns it back into this."""
        return self.model_dump(mode="json", by_alias=True)


def parameter_count(model_config: LlamaConfig) -> int:
    """Exact number of parameters of the Llama described (no biases; lm_head shared when tied)."""
    m = model_config
    kv = m.num_key_value_heads or m.num_attention_heads
    head_dim = m.hidden_size // m.num_attention_heads
    attention = 2 * m.hidden_size * m.hidden_size + 2 * m.hidden_size * kv * head_dim  # q, o + k, v
    mlp = 3 * m.hidden_size * m.intermediate_size  # gate, up, down
    layer = attention + mlp + 2 * m.hidden_size  # + input and post-attention RMSNorm
    embeddings = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    return embeddings + m.num_hidden_layers * layer + m.hidden_size  # + final norm


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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


def _working_tp(cfg: Config) -> list[int]:
    """tp values that split this model's heads, MLP (and sequence, for REDUCE_SCATTER) evenly."""
    m, seq = cfg.model.model_config_, cfg.tokens.sequence_length
    rs = cfg.parallelism.tp_mode == "REDUCE_SCATTER"
    return [
        t
        for t in _divisors(math.gcd(m.num_attention_heads, m.num_key_value_heads or 1))
        if m.intermediate_size % t == 0 and (not rs or seq % t == 0)
    ]


def rule_problems(cfg: Config) -> list[Problem]:
    """Every cross-field rule the config breaks, each naming all the fields involved and a fix."""
    m, par, tok = cfg.model.model_config_, cfg.parallelism, cfg.tokens
    sched = cfg.optimizer.learning_rate_scheduler
    kv = m.num_key_value_heads or m.num_attention_heads
    M = "model.model_config."
    out: list[Problem] = []

    def add(fields: tuple[str, ...], message: str) -> None:
        out.append(Problem(fields, message))

    heads_fields = (M + "hidden_size", M + "num_attention_heads")
    if m.hidden_size % m.num_attention_heads:
        add(heads_fields, f"hidden_size={m.hidden_size} must be divisible by num_attention_heads="
            f"{m.num_attention_heads} (each head gets hidden_size / num_attention_heads dims). "
            f"Fix: {_head_fix(m.hidden_size, m.num_attention_heads)}.")
    elif m.head_dim % 2:
        add(heads_fields, f"head_dim = hidden_size / num_attention_heads = {m.hidden_size}/"
            f"{m.num_attention_heads} = {m.head_dim} is odd; RoPE rotates pairs of dims, so it must be even. "
            f"Fix: {_head_fix(m.hidden_size, m.num_attention_heads)}.")
    if m.num_attention_heads % kv:
        add((M + "num_attention_heads", M + "num_key_value_heads"),
            f"num_attention_heads={m.num_attention_heads} must be divisible by num_key_value_heads={kv} "
            "(each key/value head serves a whole group of query heads). "
            f"Fix: num_key_value_heads one of {_join(_divisors(m.num_attention_heads))}.")
    if m.num_attention_heads % par.tp or kv % par.tp:
        add((M + "num_attention_heads", M + "num_key_value_heads", "parallelism.tp"),
            f"num_attention_heads={m.num_attention_heads} and num_key_value_heads={kv} must both be divisible "
            f"by tp={par.tp} (each tensor-parallel rank holds whole query and key/value heads). "
            f"Fix: tp values that would work: {_join(_working_tp(cfg))}.")
    if m.intermediate_size % par.tp:
        add((M + "intermediate_size", "parallelism.tp"),
            f"intermediate_size={m.intermediate_size} must be divisible by tp={par.tp} (the MLP is split over tp "
            f"ranks). Fix: intermediate_size={_nearest_multiples(m.intermediate_size, par.tp)}, "
            f"or tp one of {_join(_working_tp(cfg))}.")
    stages = par.pp * par.pp_virtual_stages
    if m.num_hidden_layers < stages:
        if par.pp_virtual_stages == 1:
            add((M + "num_hidden_layers", "parallelism.pp"),
                f"num_hidden_layers={m.num_hidden_layers} must be >= pp={par.pp} (every pipeline stage needs at "
                f"least one layer). Fix: pp={m.num_hidden_layers} or less, or num_hidden_layers={par.pp} or more.")
        else:
            add((M + "num_hidden_layers", "parallelism.pp", "parallelism.pp_virtual_stages"),
                f"num_hidden_layers={m.num_hidden_layers} must be >= pp * pp_virtual_stages = {par.pp} * "
                f"{par.pp_virtual_stages} = {stages} (every virtual stage needs at least one layer). Fix: "
                f"pp_virtual_stages={max(m.num_hidden_layers // par.pp, 1)} or less, or fewer pp.")
    interleaved = par.pp_engine == "interleaved-1f1b"
    if interleaved and par.pp < 2:
        add(("parallelism.pp_engine", "parallelism.pp"),
            "pp_engine=interleaved-1f1b interleaves model chunks over several pipeline ranks, so pp must be >= 2. "
            "Fix: pp_engine=1f1b (with pp=1 every engine is the same).")
    if interleaved and par.pp_virtual_stages < 2:
        add(("parallelism.pp_engine", "parallelism.pp_virtual_stages"),
            "pp_engine=interleaved-1f1b gives each pp rank several model chunks, so pp_virtual_stages must be "
            f">= 2 (it is {par.pp_virtual_stages}). Fix: pp_virtual_stages=2, or pp_engine=1f1b.")
    if not interleaved and par.pp_virtual_stages > 1:
        add(("parallelism.pp_engine", "parallelism.pp_virtual_stages"),
            f"pp_virtual_stages={par.pp_virtual_stages} needs pp_engine=interleaved-1f1b (pp_engine={par.pp_engine} "
            "runs one model chunk per pp rank). Fix: pp_engine=interleaved-1f1b, or pp_virtual_stages=1.")
    accumulation = tok.batch_accumulation_per_replica
    if interleaved and par.pp > 1 and accumulation % par.pp:
        add(("parallelism.pp_engine", "tokens.batch_accumulation_per_replica", "parallelism.pp"),
            f"pp_engine=interleaved-1f1b sends micro-batches through the chunks in groups of pp, so "
            f"batch_accumulation_per_replica={accumulation} must be divisible by pp={par.pp}. Fix: "
            f"batch_accumulation_per_replica={_nearest_multiples(accumulation, par.pp)}.")
    if tok.sequence_length > m.max_position_embeddings:
        add(("tokens.sequence_length", M + "max_position_embeddings"),
            f"sequence_length={tok.sequence_length} must be <= max_position_embeddings="
            f"{m.max_position_embeddings} (RoPE is only set up for that many positions). "
            f"Fix: sequence_length={m.max_position_embeddings}, or max_position_embeddings={tok.sequence_length}.")
    if par.tp_mode == "REDUCE_SCATTER" and tok.sequence_length % par.tp:
        add(("parallelism.tp_mode", "tokens.sequence_length", "parallelism.tp"),
            f"tp_mode=REDUCE_SCATTER splits the sequence over tp ranks, so sequence_length={tok.sequence_length} "
            f"must be divisible by tp={par.tp}. Fix: sequence_length="
            f"{_nearest_multiples(tok.sequence_length, par.tp)}, or tp_mode=ALL_REDUCE.")
    if sched.lr_warmup_steps > tok.train_steps:
        add(("optimizer.learning_rate_scheduler.lr_warmup_steps", "tokens.train_steps"),
            f"lr_warmup_steps={sched.lr_warmup_steps} must be <= train_steps={tok.train_steps} (the run would end "
            f"before warm-up does). Fix: lr_warmup_steps={max(tok.train_steps // 10, 0)} (10% of train_steps), "
            f"or train_steps={sched.lr_warmup_steps * 10}.")
    if cfg.optimizer.zero_stage > 1:
        add(("optimizer.zero_stage",),
            f"zero_stage={cfg.optimizer.zero_stage} (sharded gradients or parameters) is not implemented: femtotron "
            "has ZeRO-1, which shards the fp32 master weights and Adam moments over dp, 12 of the 18 bytes a "
            "bf16 parameter costs. Fix: zero_stage=1; to save more memory raise tp or pp, set "
            "parallelism.recompute_layer=true, or lower tokens.micro_batch_size.")
    scaling = cfg.optimizer.loss_scale
    if scaling.min_scale > scaling.initial_scale:
        add(("optimizer.loss_scale.min_scale", "optimizer.loss_scale.initial_scale"),
            f"min_scale={scaling.min_scale:g} must be <= initial_scale={scaling.initial_scale:g} (the scale only "
            f"goes down to min_scale). Fix: min_scale=1, or initial_scale={scaling.min_scale:g}.")
    if sched.min_decay_lr > sched.learning_rate:
        add(("optimizer.learning_rate_scheduler.min_decay_lr", "optimizer.learning_rate_scheduler.learning_rate"),
            f"min_decay_lr={sched.min_decay_lr:g} must be <= learning_rate={sched.learning_rate:g} (decay "
            f"goes down to it). Fix: min_decay_lr={sched.learning_rate / 10:g} (a tenth of learning_rate).")
    return out


def check_world_size(config: Config, world_size: int) -> None:
    """Raise ConfigError unless dp * tp * pp == world_size, listing the layouts that would work (L1)."""
    par = config.parallelism
    product = par.dp * par.tp * par.pp
    if product == world_size:
        return
    fields = ("parallelism.dp", "parallelism.tp", "parallelism.pp")
    valid = [layout for layout in _layouts(world_size) if not rule_problems(_with_layout(config, *layout))]
    # Suggest keeping the user's tp and pp when that works: it changes the least.
    keep = (world_size // (par.tp * par.pp), par.tp, par.pp)
    best = keep if keep in valid else (valid[0] if valid else None)
    listing = "; ".join(f"dp={d} tp={t} pp={p}" for d, t, p in valid[:12])
    if len(valid) > 12:
        listing += f"; ... and {len(valid) - 12} more"
    processes = f"{product} process{'es' if product > 1 else ''}"
    message = (
        f"dp={par.dp} * tp={par.tp} * pp={par.pp} = {product}, but WORLD_SIZE={world_size} processes were "
        f"launched; dp * tp * pp must equal WORLD_SIZE. Fix: launch {processes}, or choose a layout "
        f"for {world_size}: {listing or 'none fits this model'}."
    )
    if best:
        dp, tp, pp = best
        message += f" For example, add the overrides: parallelism.dp={dp} parallelism.tp={tp} parallelism.pp={pp}"
    raise_problems("Parallel layout does not match the number of processes", [Problem(fields, message)])


def _layouts(world_size: int) -> list[tuple[int, int, int]]:
    """All (dp, tp, pp) with dp * tp * pp == world_size, most data-parallel first (the simplest layout)."""
    triples = [(world_size // (t * p), t, p) for t in _divisors(world_size) for p in _divisors(world_size // t)]
    return sorted(triples, key=lambda layout: (-layout[0], layout[1], layout[2]))


def _with_layout(config: Config, dp: int, tp: int, pp: int) -> Config:
    parallelism = config.parallelism.model_copy(update={"dp": dp, "tp": tp, "pp": pp})
    return config.model_copy(update={"parallelism": parallelism})


def _typical_lr(n_params: int) -> float:
    """Rough usual peak AdamW lr by model size: small models tolerate (and need) larger steps."""
    if n_params < 100_000_000:
        return 3e-3
    return 1e-3 if n_params < 1_000_000_000 else 3e-4


def pipeline_bubble(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """The share of a step a pipeline stage idles (P2): fill and drain take pp - 1 stage-steps, which
    interleaving shortens by its number of virtual stages (AFAB and 1F1B idle alike; 1F1B holds fewer
    activations)."""
    idle = (pp - 1) / virtual_stages
    return idle / (micro_batches + idle)


def config_warnings(config: Config) -> list[str]:
    """Legal but risky settings (N1, N2), worded as advice; the trainer logs them at start."""
    out: list[str] = []
    lr = config.optimizer.learning_rate_scheduler.learning_rate
    n_params = parameter_count(config.model.model_config_)
    typical = _typical_lr(n_params)
    if config.optimizer.clip_grad is None:
        out.append("optimizer.clip_grad is null, so gradient clipping is off: one bad batch can push the weights "
                   "to NaN mid-run. Set optimizer.clip_grad: 1.0 unless you mean it.")
    if lr > 10 * typical:
        out.append(f"optimizer.learning_rate_scheduler.learning_rate={lr:g} is {lr / typical:.0f}x the usual "
                   f"{typical:g} for a {n_params / 1e6:.1f}M-parameter model; expect loss spikes or NaN. "
                   f"Try learning_rate: {typical:g} or lower.")
    if lr < 1e-6:
        out.append(f"optimizer.learning_rate_scheduler.learning_rate={lr:g} is so small the model will barely "
                   f"move; the usual value for this size is about {typical:g}.")
    if config.model.dtype == "float16":
        out.append("model.dtype=float16 overflows above 65504: it trains with dynamic loss scaling, and a step "
                   "whose gradients overflow is skipped (logged). Prefer model.dtype: bfloat16 where the hardware "
                   "has it: same memory, float32's range, no loss scaling and no skipped steps.")
    par, accumulation = config.parallelism, config.tokens.batch_accumulation_per_replica
    if par.pp > 1 and accumulation < 4 * par.pp:
        out.append(f"tokens.batch_accumulation_per_replica={accumulation} micro-batches with pp={par.pp}: the "
                   f"pipeline idles for about {pipeline_bubble(par.pp, accumulation, par.pp_virtual_stages):.0%} of "
                   f"each step (P2). Use at least 4 * pp = {4 * par.pp} micro-batches (lower "
                   "tokens.micro_batch_size to keep the batch), or pp_engine=interleaved-1f1b.")
    if config.optimizer.zero_stage == 1 and par.dp == 1:
        out.append("optimizer.zero_stage=1 with parallelism.dp=1: ZeRO-1 shards optimizer state over dp ranks, so "
                   "with one replica it saves nothing. Raise parallelism.dp to save memory.")
    if config.model.init_method.std > 0.1:
        out.append(f"model.init_method.std={config.model.init_method.std:g} is large: activations grow layer by "
                   "layer and the first steps can be NaN. The usual value is 0.02.")
    return out
