"""The config's sections and the fields and numbers of the whole (`ConfigFields`), without its rules.

The rules (config/rules.py) read these types, and `Config` (config/config.py) checks the rules when it is
validated, so the models live here, below both: the rules never import `Config`, and nothing imports in a
circle. No torch, no network: a config is checked before any process exists, so a bad one fails in a
second with a message instead of hanging a cluster.
"""

from __future__ import annotations

import math
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

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

from femtotron.config.pipeline_engines import ENGINES, Engine
from femtotron.config.zero_stages import ZERO_STAGES, ZeroStage


class _Section(BaseModel):
    # A misspelled key must be an error, never a silently ignored setting; no number is inf or nan (an
    # rms_norm_eps of inf trained to a constant model, exit 0).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# `%date` in general.run: this start's date, set once by `femtotron train` so that every process it
# starts expands it alike (under torchrun rank 0's is taken: cli.cmd_train).
RUN_DATE = "FEMTOTRON_RUN_DATE"


def run_date() -> str:
    return os.environ.get(RUN_DATE) or datetime.now(timezone.utc).strftime("%Y%m%d_%H%M%S")


class GeneralArgs(_Section):
    project: str = "femtotron"
    run: str = "run"  # nanotron's templates: %date (UTC, YYYYmmdd_HHMMSS), %jobid (SLURM_JOB_ID, or local)
    seed: NonNegativeInt = 42
    # M2: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless that variable is set already
    cuda_expandable_segments: bool = True

    @field_validator("run")
    @classmethod
    def _expand_templates(cls, run: str) -> str:
        if "%date" in run:
            run = run.replace("%date", run_date())
        run = run.replace("%jobid", os.environ.get("SLURM_JOB_ID", "local"))
        # The run directory is logging.output_dir/general.run: a run may write nowhere else.
        if not run or Path(run).is_absolute() or ".." in Path(run).parts:
            raise ValueError(
                "it would put the run directory outside logging.output_dir: give a relative name "
                "without '..' (e.g. exp1 or exp1/lr3e-4), and the directory above it as logging.output_dir"
            )
        return run


class RopeScaling(_Section):
    """Llama 3.1's long-context RoPE (`rope_type: llama3`): frequencies of wavelength over original context /
    low_freq_factor are divided by `factor`, under original / high_freq_factor kept, a smooth ramp between."""

    rope_type: Literal["llama3"] = "llama3"
    factor: PositiveFloat = 8.0
    low_freq_factor: PositiveFloat = 1.0
    high_freq_factor: PositiveFloat = 4.0
    original_max_position_embeddings: PositiveInt = 8192


class MoEConfig(_Section):
    """A mixture of experts in place of the MLP of every layer but `dense_layers` (models/moe.py). Dropless
    unless capacity_factor."""

    num_experts: PositiveInt = 8
    num_experts_per_tok: PositiveInt = 2  # top-k
    intermediate_size: PositiveInt = 14336  # each expert's FFN size
    # Experts every token goes through, fused into one MLP of num_shared_experts * intermediate_size
    # (DeepSeek); shared_expert_gate scales its output by sigmoid(x . w) per token (Qwen2-MoE).
    num_shared_experts: NonNegativeInt = 0
    shared_expert_gate: bool = False
    # topk_then_softmax: softmax over the k chosen logits (Mixtral, Qwen3-MoE; = softmax then top-k
    # renormalised); softmax_then_topk: the chosen experts' probabilities of a softmax over all experts
    # (Qwen2-MoE, DeepSeek-V2).
    router_norm: Literal["topk_then_softmax", "softmax_then_topk"] = "topk_then_softmax"
    aux_loss_coef: NonNegativeFloat = 0.01  # load balancing (Switch): 1 when balanced, E / k when collapsed
    z_loss_coef: NonNegativeFloat = 0.0  # router z-loss (ST-MoE): mean squared log-sum-exp of the logits
    # None: dropless. Else each expert takes at most ceil(factor * tokens * k / num_experts) of a rank's
    # tokens per micro-batch, in token order; the rest skip it (counted as dropped).
    capacity_factor: PositiveFloat | None = None
    # Layers with a dense MLP of LlamaConfig.intermediate_size instead of the experts (Qwen-MoE's
    # mlp_only_layers and decoder_sparse_step, nanotron's moe_config.layers).
    dense_layers: list[NonNegativeInt] = []


class LlamaConfig(_Section):
    vocab_size: PositiveInt = 32000
    hidden_size: PositiveInt = 4096
    intermediate_size: PositiveInt = 11008
    num_hidden_layers: PositiveInt = 32
    num_attention_heads: PositiveInt = 32
    num_key_value_heads: PositiveInt | None = None  # None: one KV head per query head (no GQA)
    max_position_embeddings: PositiveInt = 2048
    rope_theta: PositiveFloat = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: PositiveFloat = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: Literal["silu"] = "silu"
    moe: MoEConfig | None = None  # None: a dense Llama
    # PaLM's z-loss on the LM head: each counted token adds coef * log(Z)^2 (Z the softmax's normaliser) to
    # the loss, keeping the logits from drifting upwards in long bf16 runs (1e-4 is usual); 0: off.
    logits_z_loss_coef: NonNegativeFloat = 0.0
    # The features the model families of models/families.py turn on, each usable on its own.
    head_dim: PositiveInt | None = None  # None: hidden_size / num_attention_heads (Qwen3 sets its own)
    qkv_bias: bool = False  # biases on q, k and v (Qwen2, Qwen2.5, Qwen2-MoE)
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE (Qwen3, Qwen3-MoE)
    # what each q/k norm spans: one head (one head_dim weight shared by all), or all the heads of the
    # projection together (OLMo2: a weight per query or key feature)
    qk_norm_span: Literal["head", "all_heads"] = "head"
    # "before": each block's input is normalised (Llama); "after": its output, before it joins the residual
    # stream (OLMo2)
    norm_placement: Literal["before", "after"] = "before"
    no_rope_layers: list[NonNegativeInt] = []  # layers whose attention has no RoPE (SmolLM3: every 4th)
    # Granite's scalings: the embedding's output and each block's residual branch multiplied, the attention
    # scores scaled by attention_multiplier instead of 1/sqrt(head_dim), the logits divided by logits_scaling.
    embedding_multiplier: PositiveFloat = 1.0
    residual_multiplier: PositiveFloat = 1.0
    attention_multiplier: PositiveFloat | None = None
    logits_scaling: PositiveFloat = 1.0
    # A sliding window (Mistral, Phi-3, Qwen2 with use_sliding_window): each query sees only the keys fewer
    # than sliding_window positions before it, itself included, in every layer but full_attention_layers.
    sliding_window: PositiveInt | None = None
    full_attention_layers: list[NonNegativeInt] = []

    @model_validator(mode="after")
    def _resolve_heads(self) -> LlamaConfig:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        return self

    # The model's numbers, computed here once: the model, the pipeline partition, MFU and the rules use them.

    @property
    def attention_width(self) -> int:
        """The width of the query heads together, and of the attention output: hidden_size unless head_dim is
        set apart from it."""
        return self.num_attention_heads * self.head_dim

    @property
    def layer_parameters(self) -> float:
        """A decoder layer's parameters, the mean over the layers (a dense layer among experts has fewer): q,
        k, v, o, the gated MLP (or router, experts, shared experts), two RMSNorms."""
        return self._layers_parameters(active=False) / self.num_hidden_layers

    @property
    def active_layer_parameters(self) -> float:
        """The parameters one token goes through in a layer (the mean): with experts, k of them (and the
        shared)."""
        return self._layers_parameters(active=True) / self.num_hidden_layers

    def has_experts(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    @property
    def moe_layers(self) -> list[int]:
        """The layers with experts, listed (for a model being built; `moe_layer_count` for any depth)."""
        return [i for i in range(self.num_hidden_layers) if self.has_experts(i)]

    @property
    def moe_layer_count(self) -> int:
        """How many layers have experts (counted, not listed: the pipeline's estimates take any depth)."""
        if self.moe is None:
            return 0
        layers = self.num_hidden_layers
        return layers - len({i for i in self.moe.dense_layers if i < layers})

    def _layers_parameters(self, active: bool) -> int:
        """All the decoder layers' parameters (`active`: those one token goes through)."""
        moe_layers = self.moe_layer_count
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        mlps = (self.num_hidden_layers - moe_layers) * dense_mlp + moe_layers * self._experts_parameters(
            active
        )
        return self.num_hidden_layers * self._attention_and_norms + mlps

    @property
    def _attention_and_norms(self) -> int:
        h = self.hidden_size
        kv = self.num_key_value_heads * self.head_dim  # the width of k and of v: smaller than h under GQA
        # q and o are h x attention_width, k and v are h x kv, and each RMSNorm has h weights.
        matrices = 2 * h * self.attention_width + 2 * h * kv
        return matrices + self._attention_vectors + 2 * h

    @property
    def _attention_vectors(self) -> int:
        """The q, k, v biases and the q/k norms' weights: parameters that are not matmul weights."""
        kv_width = self.num_key_value_heads * self.head_dim
        biases = (self.attention_width + 2 * kv_width) * self.qkv_bias
        norms = 2 * self.head_dim if self.qk_norm_span == "head" else self.attention_width + kv_width
        return biases + norms * self.qk_norm

    def _experts_parameters(self, active: bool) -> int:
        """A mixture of experts' router, experts (`active`: k of them) and shared experts."""
        h = self.hidden_size
        moe = self.moe
        if moe is None:
            return 0
        experts = moe.num_experts_per_tok if active else moe.num_experts
        shared = 3 * h * moe.num_shared_experts * moe.intermediate_size + h * moe.shared_expert_gate
        return h * moe.num_experts + experts * 3 * h * moe.intermediate_size + shared

    @property
    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def parameter_count(self) -> int:
        """Every parameter: embedding, layers, final norm and LM head (the embedding itself when tied)."""
        return self._counted(active=False)

    @property
    def active_parameter_count(self) -> int:
        """The parameters one token goes through (all of them in a dense model)."""
        return self._counted(active=True)

    def _counted(self, active: bool) -> int:
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self.embedding_parameters + self._layers_parameters(active) + self.hidden_size

    def windowed(self, layer: int) -> bool:
        """Whether `layer`'s attention has the sliding window."""
        return self.sliding_window is not None and layer not in self.full_attention_layers

    def layer_flops(self, sequence_length: int) -> float:
        """Forward FLOPs per token of a decoder layer (the mean of the model's layers): 2 per matmul weight it
        goes through, and attention's scores and weighted sum, 4 * attention_width per key a query sees."""
        matmuls = self.active_layer_parameters - 2 * self.hidden_size - self._attention_vectors
        layers = self.num_hidden_layers
        full = len({i for i in self.full_attention_layers if i < layers}) if self.sliding_window else layers
        seen = full * self._keys_seen(sequence_length, False)
        seen += (layers - full) * self._keys_seen(sequence_length, True)
        return 2.0 * matmuls + 4.0 * self.attention_width * seen / layers

    def _keys_seen(self, sequence_length: int, windowed: bool) -> float:
        """The mean number of keys a query sees: half the sequence under the causal mask; with a window w
        shorter than the sequence, w for all but the first w queries (w - w^2 / 2s)."""
        window = self.sliding_window
        if not windowed or window is None or sequence_length <= window:
            return sequence_length / 2
        return window - window**2 / (2 * sequence_length)

    @property
    def head_flops(self) -> float:
        """Forward FLOPs per token of the LM head (also when tied: the matmul is done either way)."""
        return 2.0 * self.embedding_parameters

    def flops_per_token(self, sequence_length: int) -> float:
        """Forward + backward FLOPs per trained token: backward costs twice the forward."""
        return 3.0 * (self.num_hidden_layers * self.layer_flops(sequence_length) + self.head_flops)


class InitMethod(_Section):
    std: PositiveFloat = 0.02


class ModelArgs(_Section):
    # `model_config` is pydantic's own class attribute, so the field is `model_config_` in Python
    # and `model_config` in YAML, exactly as in nanotron.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model_config_: LlamaConfig = Field(default_factory=LlamaConfig, alias="model_config")
    init_method: InitMethod = Field(default_factory=InitMethod)
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    compile: bool = False  # torch.compile each decoder layer (models/compile.py)
    # Attention stops at each end-of-document token of a packed sample and RoPE positions restart there.
    document_masking: bool = False
    # The first weights: a Hugging Face Llama directory, a run directory or a checkpoint (serialize/init.py).
    init_from: str | None = None
    # The transformers class `export-hf` writes (import-hf sets the one it read; models/families.py lists
    # them). None: the first whose model computes model_config.
    hf_architecture: str | None = None


class TokenizerArgs(_Section):
    tokenizer_name_or_path: str | None = None  # path to a tokenizer.json
    # How `generate` begins a prompt. False: after the EOS token, as femtotron's data separates documents.
    # True: with what the tokenizer's post-processor adds (a BOS, or nothing), as a Hugging Face model was
    # trained; import-hf sets it, with the ids its generation_config.json stops at.
    add_special_tokens: bool = False
    eos_token_ids: list[NonNegativeInt] = []  # the ids generation stops at; empty: the tokenizer's EOS


class ParallelismArgs(_Section):
    dp: PositiveInt = 1
    tp: PositiveInt = 1
    pp: PositiveInt = 1
    cp: PositiveInt = 1  # context parallel: each sequence split over cp ranks, attention as a ring
    # expert parallel: each MoE layer's experts split over ep of the dp x cp ranks (ep divides dp * cp)
    ep: PositiveInt = 1
    pp_engine: Literal[tuple(ENGINES)] = "1f1b"
    pp_virtual_stages: PositiveInt = 1  # model chunks per pp rank; > 1 only with interleaved-1f1b
    tp_mode: Literal["ALL_REDUCE", "REDUCE_SCATTER"] = "ALL_REDUCE"
    recompute_layer: bool = False  # recompute each decoder layer's forward in backward (less memory)
    dp_bucket_size_mb: PositiveFloat = 25  # gradients reduced over dp in buckets of about this size
    init_timeout_seconds: PositiveFloat = 300
    collective_timeout_seconds: PositiveFloat = 600
    # an op in flight this long on any rank: every rank's state is gathered into one report and the job stops
    hang_timeout_seconds: PositiveFloat = 600

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def engine(self) -> Engine:
        return ENGINES[self.pp_engine]


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


class OptimizerFactoryArgs(_Section):
    # "muon": the decoder layers' weight matrices follow Muon (optim/muon.py), every other parameter AdamW
    name: Literal["adamW", "muon"] = "adamW"
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.95, ge=0, lt=1)
    adam_eps: PositiveFloat = 1e-8
    torch_adam_is_fused: bool = True
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    muon_nesterov: bool = True
    muon_ns_steps: PositiveInt = 5  # Newton-Schulz iterations
    # None: learning_rate_scheduler.learning_rate; Muon's follows the same schedule, scaled by this / that
    muon_learning_rate: PositiveFloat | None = None
    muon_weight_decay: NonNegativeFloat | None = None  # None: optimizer.weight_decay

    @field_validator("name", mode="before")
    @classmethod
    def _in_any_case(cls, name: Any) -> Any:
        """`adamw` (PyTorch's and torchtitan's spelling) is adamW: the names differ in more than case."""
        names = get_args(cls.model_fields["name"].annotation)
        return next(
            (known for known in names if isinstance(name, str) and name.lower() == known.lower()), name
        )


class LossScaleArgs(_Section):
    """Dynamic loss scaling, used only with model.dtype=float16 (optim/loss_scale.py)."""

    initial_scale: PositiveFloat = 2.0**16
    growth_factor: float = Field(2.0, gt=1)
    backoff_factor: float = Field(0.5, gt=0, lt=1)
    growth_interval: PositiveInt = 1000  # clean steps before the scale grows
    min_scale: PositiveFloat = 1.0  # an overflow at this scale stops the run


class OptimizerArgs(_Section):
    # 1: optimizer state sharded over dp x cp (ZeRO-1); 2: the gradients too (ZeRO-2); 3: the parameters too,
    # each unit (embedding, decoder layer, head) gathered while it runs (ZeRO-3, parallel/fully_sharded.py)
    zero_stage: NonNegativeInt = 0
    # ZeRO-3: free a unit's gathered parameters after its forward and gather them again for its backward
    # (false: keep them until its backward; less communication, more memory; FSDP's knob of the same name)
    reshard_after_forward: bool = True
    # ZeRO-3: reduce-scatter a unit's gradients as its backward ends in every micro-batch (whole gradients
    # never outlive a unit's backward); false: only after the step's last micro-batch, one reduction per step
    # as ZeRO-2's (less traffic under accumulation or pp > 1; every unit's whole gradients kept meanwhile)
    reduce_every_micro_batch: bool = True
    weight_decay: NonNegativeFloat = 0.01
    # None: the matrices are decayed, norm scales not. A list (nanotron's rule): every parameter is decayed
    # except those whose name a pattern matches from its start (re.match), e.g. ["embed_tokens", ".*norm"];
    # names as in `layers.0.self_attn.qkv_proj.weight` (models/llama.py).
    weight_decay_exclude_named_params: list[str] | None = None
    clip_grad: PositiveFloat | None = 1.0  # None: no gradient clipping
    on_non_finite: Literal["stop", "skip"] = "stop"  # a non-finite loss or grad norm: stop, or drop the step
    accumulate_grad_in_fp32: bool = True
    learning_rate_scheduler: LRSchedulerArgs = Field(default_factory=LRSchedulerArgs)
    optimizer_factory: OptimizerFactoryArgs = Field(default_factory=OptimizerFactoryArgs)
    loss_scale: LossScaleArgs = Field(default_factory=LossScaleArgs)

    @field_validator("weight_decay_exclude_named_params")
    @classmethod
    def _compiles(cls, patterns: list[str] | None) -> list[str] | None:
        for pattern in patterns or []:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(
                    f"{pattern!r} is not a regular expression ({e}); escape it, e.g. '\\.'"
                ) from None
        return patterns

    @property
    def zero(self) -> ZeroStage:
        """The record of `zero_stage` (one the rules accept: zero_stage_implemented)."""
        return ZERO_STAGES[self.zero_stage]


# A blend weight of inf or nan is let through to `_checked_spec`, whose message says what a weight must be.
DatasetSpec = str | list[str] | dict[str, Annotated[float, Field(allow_inf_nan=True)]]
_SPEC_SHAPES = {
    "text_dataset": "must be a path to text (string), a list of them, or a mapping {path: weight}",
    "tokens": "must be a .bin/.idx path prefix or directory (string), a list of them, or a mapping "
    "{prefix: weight}",
}


def _checked_spec(value: Any, handler: Any, info: ValidationInfo) -> Any:
    """Replace pydantic's three union-branch errors with one sentence, and reject empty specs."""
    if value is None:
        return handler(value)
    shape = _SPEC_SHAPES["text_dataset" if info.field_name == "text_dataset" else "tokens"]
    try:
        spec = handler(value)
    except ValidationError:
        raise ValueError(shape) from None
    if not spec:
        raise ValueError(shape + ", and not empty")
    if isinstance(spec, dict) and not all(math.isfinite(w) and w > 0 for w in spec.values()):
        raise ValueError(
            "every blend weight must be a finite number > 0 (drop a dataset instead of giving it weight 0)"
        )
    return spec


class DataSource(_Section):
    """Where training samples come from: tokenized datasets, or random tokens. Exactly one is set (a rule)."""

    dataset_folder: DatasetSpec | None = Field(
        None,
        description="a .bin/.idx path prefix, a datatrove folder or a directory, a list of them, or "
        "{prefix: weight}",
    )
    # Random token ids, uniform over the vocabulary (nanotron's `dataset: null`): for throughput benchmarks.
    # The loss cannot fall below ln(vocab_size).
    synthetic: bool = False
    # Untokenized text (nanotron's hf_dataset_or_datasets): a Hugging Face datasets directory (save_to_disk)
    # or .jsonl / .jsonl.gz / .txt files, a directory of them, a list, or {path: weight}; tokenized at start
    # with tokenizer.tokenizer_name_or_path into data.cache_dir and reused (data/text_cache.py).
    text_dataset: DatasetSpec | None = None
    text_column: str = "text"  # the column (or JSON key) holding the text

    @field_validator("dataset_folder", "text_dataset", mode="wrap")
    @classmethod
    def _one_clear_error(cls, value: Any, handler: Any, info: ValidationInfo) -> Any:
        return _checked_spec(value, handler, info)

    @property
    def sources_set(self) -> list[str]:
        """The source keys given: a valid section has exactly one."""
        given = {
            "dataset_folder": self.dataset_folder is not None,
            "synthetic": self.synthetic,
            "text_dataset": self.text_dataset is not None,
        }
        return [key for key, is_set in given.items() if is_set]


class DataStage(DataSource):
    """One stage of the training data (nanotron's data_stages): its samples are drawn from its own source,
    from `start_training_step` until the next stage starts. A dataset an earlier stage read continues where
    that stage left it (data/stages.py)."""

    name: str
    start_training_step: PositiveInt
    seed: NonNegativeInt | None = None  # None: data.seed


# The name of the one stage of a data section without `stages`.
ONLY_STAGE = "training"


def stage_end(stages: list[DataStage], index: int) -> int | None:
    """The last step of stage `index`: the one before the next stage starts; None for the last stage."""
    following = index + 1
    return stages[following].start_training_step - 1 if following < len(stages) else None


class DataArgs(DataSource):
    """The training data: one source here, or `stages`, each with its own source, switching at their steps."""

    stages: list[DataStage] | None = None
    validation_folder: DatasetSpec | None = None
    seed: NonNegativeInt = 1234
    cache_dir: str | None = None  # where text_dataset is tokenized to; None: <logging.output_dir>/data_cache

    @field_validator("validation_folder", mode="wrap")
    @classmethod
    def _one_clear_validation_error(cls, value: Any, handler: Any, info: ValidationInfo) -> Any:
        return _checked_spec(value, handler, info)

    def stage_path(self, index: int) -> str:
        """Where stage `index`'s keys are in the config: `data.stages.<index>`, or `data` without stages."""
        return f"data.stages.{index}" if self.stages else "data"

    def stage_list(self) -> list[DataStage]:
        """The run's stages in order, each with its seed resolved: `stages`, or the one this section is."""
        if not self.stages:
            source = {key: getattr(self, key) for key in DataSource.model_fields}
            return [DataStage(name=ONLY_STAGE, start_training_step=1, seed=self.seed, **source)]
        return [
            stage.model_copy(update={"seed": self.seed if stage.seed is None else stage.seed})
            for stage in self.stages
        ]


class CheckpointsArgs(_Section):
    checkpoints_path: str | None = None  # None: <run dir>/checkpoints
    # resume from the newest checkpoint in checkpoints_path when there is one (a requeued job continues);
    # false: start from step 0 even then (warned), saving over them
    auto_resume: bool = True
    checkpoint_interval: NonNegativeInt = 0  # save a checkpoint every N steps (and after the last); 0: never
    save_initial_state: bool = False  # also save one before the first step
    save_final_state: bool = True  # full-shape weights in the run directory at the end
    # a step-NNNNNNN checkpoint, or a checkpoints directory (its latest)
    resume_checkpoint_path: str | None = None
    keep_last_n: PositiveInt | None = None  # delete older checkpoints beyond the newest N; None: keep all
    # true: training stops only to copy the state into host memory (pinned on CUDA) while a background thread
    # writes and commits the checkpoint. Off by default until measured on GPUs: it costs host memory of the
    # size of the rank's part of a checkpoint, and a slow disk then slows the steps it overlaps instead.
    async_save: bool = False
    # resume although the data, its blend, data.seed, tokens.sequence_length or the tokenizer changed since
    # the checkpoint (warned); false: refuse, saying what changed
    resume_with_other_data: bool = False
    # Resuming from resume_checkpoint_path (another run's checkpoint): false starts Adam afresh (zero moments,
    # step count 0) from its fp32 master weights; the run's own checkpoints always load whole.
    load_optimizer: bool = True
    # false: the learning-rate schedule (warm-up, decay) starts again at the resumed step, over the rest.
    load_lr_scheduler: bool = True


class LoggingArgs(_Section):
    output_dir: str = "runs"
    iteration_step_info_interval: PositiveInt = 1
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    tensorboard: bool = False  # also write the step records to <run dir>/tensorboard/ (rank 0)
    wandb: bool = False  # also log them to W&B: project general.project, run general.run


class ProfilingArgs(_Section):
    # [first, last]: a torch.profiler trace of these steps per rank in <run dir>/profile/; None: none
    profile_steps: tuple[PositiveInt, PositiveInt] | None = None

    @field_validator("profile_steps")
    @classmethod
    def _in_order(cls, steps: tuple[int, int] | None) -> tuple[int, int] | None:
        if steps and steps[0] > steps[1]:
            raise ValueError(f"[first, last] with first <= last, e.g. [{steps[1]}, {steps[0]}]")
        return steps


class ConfigFields(_Section):
    """A whole training run's sections and the numbers derived from them, not yet checked by the rules.

    `Config` is this with its validator; code builds and passes `Config`. The rules take this type so that
    they need not import the class that calls them.
    """

    general: GeneralArgs = Field(default_factory=GeneralArgs)
    model: ModelArgs = Field(default_factory=ModelArgs)
    tokenizer: TokenizerArgs = Field(default_factory=TokenizerArgs)
    parallelism: ParallelismArgs = Field(default_factory=ParallelismArgs)
    tokens: TokensArgs
    optimizer: OptimizerArgs = Field(default_factory=OptimizerArgs)
    data: DataArgs
    checkpoints: CheckpointsArgs = Field(default_factory=CheckpointsArgs)
    logging: LoggingArgs = Field(default_factory=LoggingArgs)
    profiling: ProfilingArgs = Field(default_factory=ProfilingArgs)

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

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-dumpable dict with the YAML key names; `load_config_dict` turns it back into this."""
        return self.model_dump(mode="json", by_alias=True)
