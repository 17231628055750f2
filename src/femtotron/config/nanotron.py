"""A nanotron config (huggingface/nanotron at 2411b02, src/nanotron/config/) translated into femtotron's.

`KEYS` is the one table: every key of nanotron's config classes and what femtotron does with it. Each is
honored (same name, same meaning), translated (to another femtotron key, perhaps with its value changed:
one report line each), of no effect (one summary line says why), or refused (every problem at once, each
with its YAML line, the reason and what to do instead). A key that is not in the table is refused as
unknown (one of `FORMER_KEYS`, which nanotron's own examples still hold, saying where it went).
docs/nanotron.md is rendered from the table (`render_table`). Imported only when load.py sees a
nanotron config.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from femtotron.config.rules import Problem, raise_problems
from femtotron.run_lock import LOCKED_ENV

HONORED = "honored"
TRANSLATED = "translated"
NO_EFFECT = "no effect"
REFUSED = "refused"
# A value a translation drops: femtotron's default means the same.
DROP = object()
# A list whose items are translated key by key (data_stages): reported once they are placed.
SECTION = object()


class Refusal(ValueError):
    """A value femtotron cannot run: the message says why and what to do instead."""


@dataclass(frozen=True, kw_only=True)
class Key:
    """How femtotron treats one nanotron key. `transform(value, parent)` gets the mapping holding the key, or
    with `whole` the whole config."""

    action: str
    target: str = ""
    why: str = ""
    transform: Callable[[Any, Mapping[str, Any]], Any] | None = None
    whole: bool = False


def same() -> Key:
    return Key(action=HONORED)


def to(target: str, transform: Callable[[Any, Mapping[str, Any]], Any] | None = None, why: str = "") -> Key:
    return Key(action=TRANSLATED, target=target, transform=transform, why=why)


def no_effect(why: str) -> Key:
    return Key(action=NO_EFFECT, why=why)


def refused(why: str) -> Key:
    return Key(action=REFUSED, why=why)


def unless_default(default: Any, why: str) -> Key:
    """No effect at nanotron's default value (or null); any other value is refused with `why`."""

    def check(value: Any, parent: Mapping[str, Any]) -> Any:
        if value is None or value == default:
            return DROP
        raise Refusal(why)

    return Key(action=NO_EFFECT, why=f"only at {default!r}; other values refused: {why}", transform=check)


def _dropping(*empty: Any) -> Callable[[Any, Mapping[str, Any]], Any]:
    """Keep the value, except these, which mean femtotron's default."""
    return lambda value, parent: DROP if value in empty else value


def _default_if_null(default: Any) -> Callable[[Any, Mapping[str, Any]], Any]:
    return lambda value, parent: default if value is None else value


def _no_validation(value: Any, parent: Mapping[str, Any]) -> Any:
    return 0 if value in (-1, None) else value


def _dtype(value: Any, parent: Mapping[str, Any]) -> Any:
    return DROP if value is None else str(value).removeprefix("torch.")


def _upper(value: Any, parent: Mapping[str, Any]) -> Any:
    return DROP if value is None else str(value).upper()


def _min_lr(value: Any, parent: Mapping[str, Any]) -> Any:
    return parent.get("learning_rate") if value is None else value


def _padded_vocab(multiple: Any, parent: Mapping[str, Any]) -> Any:
    vocab = (parent.get("model_config") or {}).get("vocab_size", 32000)
    if not isinstance(multiple, int) or multiple <= 1 or not isinstance(vocab, int):
        return DROP
    return -(-vocab // multiple) * multiple  # nanotron pads the embedding rows to this many


def _dataset_folder(value: Any, parent: Mapping[str, Any]) -> Any:
    """As nanotron's NanosetDatasetsArgs (config.py at 2411b02) reads them: a folder, or a list with one
    weight each; its loader refuses a {folder: weight} mapping (dropped in 7323ce1c, September 2024)."""
    if isinstance(value, Mapping):
        raise Refusal(
            f"{_REFUSES}: a folder or a list; write dataset_folder: {list(value)} with dataset_weights: "
            f"{list(value.values())}"
        )
    folders = parent.get("dataset_read_path") or value  # nanotron reads the local copy when given
    weights = parent.get("dataset_weights")
    if isinstance(folders, list) and isinstance(weights, list):
        if len(weights) != len(folders):
            raise Refusal(
                f"{_REFUSES}: {len(folders)} folders but dataset_weights has {len(weights)}; give one weight "
                "per folder"
            )
        return dict(zip(folders, weights, strict=True))
    return folders


def _synthetic(value: Any, parent: Mapping[str, Any]) -> Any:
    if value is None:  # nanotron's dummy data
        return True
    raise Refusal("a stage's dataset is a section of dataset keys, or null for random tokens")


def _stage_list(value: Any, parent: Mapping[str, Any]) -> Any:
    if not isinstance(value, list) or not value:
        raise Refusal("data_stages is a list of stages, each with name, start_training_step and data")
    return SECTION


# femtotron's parameter names (models/llama.py, models/moe.py) and nanotron's for the same tensor (its Llama
# and Qwen2 models at 2411b02; its Qwen2 MoE layer, nn/moe.py, holds a layer's experts in one tensor, as
# femtotron does); {i}: a layer.
_LAYER = "model.decoder.{i}.pp_block."
PARAMETER_NAMES = {
    "embed_tokens.weight": "model.token_position_embeddings.pp_block.token_embedding.weight",
    "layers.{i}.input_layernorm.weight": _LAYER + "input_layernorm.weight",
    "layers.{i}.self_attn.qkv_proj.weight": _LAYER + "attn.qkv_proj.weight",
    "layers.{i}.self_attn.qkv_proj.bias": _LAYER + "attn.qkv_proj.bias",
    "layers.{i}.self_attn.o_proj.weight": _LAYER + "attn.o_proj.weight",
    "layers.{i}.post_attention_layernorm.weight": _LAYER + "post_attention_layernorm.weight",
    "layers.{i}.mlp.gate_up_proj.weight": _LAYER + "mlp.gate_up_proj.weight",
    "layers.{i}.mlp.down_proj.weight": _LAYER + "mlp.down_proj.weight",
    "layers.{i}.mlp.router.weight": _LAYER + "mlp.router.weight",
    "layers.{i}.mlp.experts.gate_up_proj": _LAYER + "mlp.experts.merged_gate_up_proj",
    "layers.{i}.mlp.experts.down_proj": _LAYER + "mlp.experts.merged_down_proj",
    "layers.{i}.mlp.shared_expert.gate_up_proj.weight": _LAYER + "mlp.shared_expert.gate_up_proj.weight",
    "layers.{i}.mlp.shared_expert.down_proj.weight": _LAYER + "mlp.shared_expert.down_proj.weight",
    "layers.{i}.mlp.shared_expert_gate.weight": _LAYER + "mlp.shared_expert_gate.weight",
    "norm.weight": "model.final_layer_norm.pp_block.weight",
    "lm_head.weight": "model.lm_head.pp_block.weight",
}


def _model_names(config: Mapping[str, Any]) -> dict[str, list[list[str]]]:
    """For the model `config` describes: femtotron's name (generic) -> per layer, the nanotron names of the
    tensor (two for a tied embedding)."""
    model = (config.get("model") or {}).get("model_config") or {}
    moe = model.get("moe_config")
    layers = model.get("num_hidden_layers", 32)
    experts = isinstance(moe, Mapping)
    shared = experts and bool(moe.get("enable_shared_expert"))
    tied = bool(model.get("tie_word_embeddings", False))
    names: dict[str, list[list[str]]] = {}
    for ours, theirs in PARAMETER_NAMES.items():
        if (".mlp.router" in ours or ".mlp.experts" in ours) and not experts:
            continue
        if ".mlp.shared_expert" in ours and not shared:
            continue
        if ours in ("layers.{i}.mlp.gate_up_proj.weight", "layers.{i}.mlp.down_proj.weight") and experts:
            continue
        if ours == "lm_head.weight" and tied:
            continue
        if ours.endswith(".bias") and not model.get("attention_bias"):
            continue
        per_layer = range(layers) if "{i}" in ours else [0]
        names[ours] = [[theirs.format(i=i)] for i in per_layer]
    if tied:  # nanotron excludes tied parameters when a pattern matches either name
        names["embed_tokens.weight"][0].append(PARAMETER_NAMES["lm_head.weight"])
    return names


def _excluded_from_decay(value: Any, config: Mapping[str, Any]) -> Any:
    """nanotron's patterns (re.match over its names) as patterns over femtotron's names of the same tensors.
    Each is checked against the model the config describes: one matching nothing is refused."""
    if value is None:
        return DROP
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise Refusal("a list of regular expressions")
    patterns = []
    for pattern in value:
        try:
            rule = re.compile(pattern)
        except re.error as e:
            raise Refusal(f"{pattern!r} is not a regular expression ({e})") from None
        matched = [
            _femtotron_pattern(rule, ours, per_layer) for ours, per_layer in _model_names(config).items()
        ]
        if not any(matched):
            example = PARAMETER_NAMES["layers.{i}.input_layernorm.weight"].format(i=0)
            raise Refusal(
                f"{pattern!r} matches none of this model's parameters under nanotron's names (e.g. "
                f"{example}); fix or delete it"
            )
        patterns += [found for found in matched if found and found not in patterns]
    return patterns


def _femtotron_pattern(rule: re.Pattern[str], ours: str, per_layer: list[list[str]]) -> str | None:
    """The pattern over femtotron's name `ours` for the layers whose nanotron names `rule` matches, or None
    (a tied embedding's two names are one tensor, excluded when either matches, as nanotron does)."""
    layers = [i for i, names in enumerate(per_layer) if any(rule.match(name) for name in names)]
    if not layers:
        return None
    which = "\\d+" if len(layers) == len(per_layer) else "(" + "|".join(map(str, layers)) + ")"
    return re.escape(ours).replace(re.escape("{i}"), which) + "$"


def _no_rope_layers(every: Any, model_config: Mapping[str, Any]) -> Any:
    """nanotron's `no_rope_layer: N` skips RoPE in every N-th layer (layer i when (i + 1) % N == 0)."""
    if every is None:
        return DROP
    if not isinstance(every, int) or every < 1:
        raise Refusal("no_rope_layer is a whole number N >= 1: every N-th layer has no RoPE")
    layers = model_config.get("num_hidden_layers", 32)
    return [i for i in range(layers) if (i + 1) % every == 0]


def _z_loss(enabled: Any, model_config: Mapping[str, Any]) -> Any:
    return model_config.get("z_loss_coefficient", 1e-4) if enabled else DROP  # nanotron's default: 1e-4


def _profile_steps(value: Any, parent: Mapping[str, Any]) -> Any:
    """torch.profiler's schedule (skip_first, then wait, warmup, active steps) as [first, last] traced."""
    if parent.get("profiler_export_path") is None:
        return DROP
    if parent.get("repeat", 1) not in (0, 1):
        raise Refusal("femtotron traces one window of steps; set repeat: 1")
    before = sum(int(parent.get(k, 1)) for k in ("wait", "warmup")) + int(parent.get("skip_first", 3))
    return [before + 1, before + int(parent.get("active", 1))]


def _shared_experts(value: Any, parent: Mapping[str, Any]) -> Any:
    if not parent.get("enable_shared_expert"):
        return DROP
    size = parent.get("moe_intermediate_size", 1408)
    if not isinstance(value, int) or value % size:
        raise Refusal(
            f"femtotron's shared expert is a whole number of experts of moe_intermediate_size ({size}); "
            "set shared_expert_intermediate_size to a multiple of it"
        )
    return value // size


def _dense_layers(value: Any, config: Mapping[str, Any]) -> Any:
    """nanotron's moe_config.layers lists the layers with experts ([-1]: all); femtotron lists the others."""
    if value in (None, [-1]):
        return DROP
    layers = config.get("model", {}).get("model_config", {}).get("num_hidden_layers", 32)
    if not isinstance(value, list) or not all(isinstance(i, int) and 0 <= i < layers for i in value):
        raise Refusal(f"layers lists the layers with experts, from 0 to {layers - 1}, or is [-1] for all")
    return [i for i in range(layers) if i not in value]


# nanotron's MoEConfig (models_config.py at 2411b02) for the keys a moe_config leaves out: its model's
# sizes, not femtotron's defaults.
_MOE_DEFAULTS = {
    "num_experts": 8,
    "top_k": 2,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "router_aux_loss_coef": 0.01,
    "enable_shared_expert": False,
}
_REFUSES = "nanotron's loader at 2411b02 refuses it"
_NO_NETWORK = "femtotron reads local files only"
_HF_DATASETS = (
    "text (a local Hugging Face datasets directory or text files) tokenized at start into data.cache_dir; "
    "a Hub name is refused then, with the commands that fetch and tokenize it"
)
_EVALUATE = (
    "femtotron does not run evaluations during training. Export a checkpoint and evaluate it: "
    "`femtotron export-hf RUN_DIR --out hf_model` then `lighteval accelerate "
    '"model_name=hf_model" "leaderboard|hellaswag|0|0"` or `lm_eval --model hf --model_args '
    "pretrained=hf_model --tasks hellaswag`; delete the lighteval section"
)
_MODEL_ZOO = "femtotron's Llama has no such feature yet; remove the key (or set it to its default)"
_KERNEL = "a kernel choice in nanotron; femtotron's own kernels compute the same"
_SCHEDULE = "[skip_first + wait + warmup + 1, ... + active], when profiler_export_path is set"
_STAGE = "data_stages.*."
_DATASET = _STAGE + "data.dataset."
_MODEL = "model.model_config."
_MOE = _MODEL + "moe_config."
_LR = "optimizer.learning_rate_scheduler."

# Every key of nanotron's Config, in the order they are translated (a key that reads another comes after it).
KEYS: dict[str, Key] = {
    "general.project": same(),
    "general.run": to("general.run", _default_if_null("%date_%jobid"), "null: nanotron's %date_%jobid"),
    "general.seed": to("general.seed", _dropping(None), "null: femtotron's default"),
    "general.step": no_effect("femtotron resumes the step from the checkpoint itself"),
    "general.consumed_train_samples": no_effect("femtotron resumes the samples from the checkpoint itself"),
    "general.benchmark_csv_path": no_effect("femtotron's step records are in the run directory's log"),
    "general.ignore_sanity_checks": no_effect("femtotron always checks the config before it starts"),
    "parallelism.dp": same(),
    "parallelism.pp": same(),
    "parallelism.tp": same(),
    # nanotron's default engine is all-forward-all-backward
    "parallelism.pp_engine": to("parallelism.pp_engine", _default_if_null("afab"), "null: afab"),
    "parallelism.tp_mode": to("parallelism.tp_mode", _upper, "upper-cased"),
    "parallelism.tp_linear_async_communication": no_effect(
        "nanotron overlaps its tp all-gathers with the GEMMs for speed; femtotron runs them one after the "
        "other: the same numbers, without that overlap"
    ),
    "parallelism.recompute_layer": same(),
    "parallelism.tp_recompute_allgather": no_effect(
        "nanotron keeps sharded activations and gathers them again in backward (REDUCE_SCATTER mode) to save "
        "memory; femtotron keeps the gathered ones: the same numbers, more activation memory"
    ),
    "parallelism.expert_parallel_size": to("parallelism.ep"),
    "parallelism.context_parallel_size": to("parallelism.cp"),
    _MODEL + "bos_token_id": no_effect("femtotron reads special tokens from the tokenizer"),
    _MODEL + "eos_token_id": no_effect("femtotron reads the end-of-document token from the tokenizer"),
    _MODEL + "pad_token_id": no_effect("femtotron packs samples, it never pads"),
    _MODEL + "hidden_act": same(),
    _MODEL + "hidden_size": same(),
    _MODEL + "initializer_range": no_effect("nanotron initialises from model.init_method.std, as femtotron"),
    _MODEL + "intermediate_size": same(),
    _MODEL + "is_llama_config": no_effect("names nanotron's model class; femtotron's model is Llama"),
    _MODEL + "is_qwen2_config": no_effect("names nanotron's model class; femtotron builds it as a Llama"),
    _MODEL + "is_starcoder2_config": unless_default(
        False,
        "Starcoder2 (LayerNorm with biases, a GELU MLP, multi-query attention with biases, dropout) is not "
        "femtotron's model, which is a Llama (with or without experts); train a Llama or Qwen2 config",
    ),
    _MODEL + "max_position_embeddings": same(),
    _MODEL + "num_attention_heads": same(),
    _MODEL + "num_hidden_layers": same(),
    _MODEL + "num_key_value_heads": same(),
    _MODEL + "pretraining_tp": no_effect("a Hugging Face inference setting; training does not read it"),
    _MODEL + "rms_norm_eps": same(),
    _MODEL + "rope_scaling": same(),
    _MODEL + "rope_theta": same(),
    _MODEL + "rope_interleaved": unless_default(False, "femtotron's RoPE rotates halves (Llama 3's layout)"),
    _MODEL + "rope_seq_len_interpolation_factor": unless_default(None, _MODEL_ZOO),
    _MODEL + "tie_word_embeddings": same(),
    _MODEL + "use_cache": no_effect("a generation setting; training keeps no cache"),
    _MODEL + "vocab_size": same(),
    _MODEL + "_attn_implementation": no_effect(_KERNEL),
    _MODEL + "flex_attention_mask": unless_default(None, "for document masking set _use_doc_masking: true"),
    _MODEL + "attention_bias": to(_MODEL + "qkv_bias", why="biases on q, k and v (Qwen2), as nanotron's"),
    _MODEL + "sliding_window_size": to(
        _MODEL + "sliding_window",
        _dropping(None),
        "each query sees this many latest keys; nanotron's layers without RoPE attend to all "
        "(full_attention_layers)",
    ),
    _MODEL + "no_rope_layer": to(
        _MODEL + "no_rope_layers", _no_rope_layers, "N: layers N-1, 2N-1, ... (SmolLM3)"
    ),
    _MODEL + "z_loss_enabled": to(_MODEL + "logits_z_loss_coef", _z_loss, "z_loss_coefficient when true"),
    _MODEL + "z_loss_coefficient": no_effect("read with z_loss_enabled"),
    _MODEL + "_fused_rotary_emb": no_effect(_KERNEL),
    _MODEL + "_fused_rms_norm": no_effect(_KERNEL),
    _MODEL + "_use_qkv_packed": no_effect(_KERNEL),
    _MODEL + "_use_doc_masking": to("model.document_masking"),
    _MODEL + "log_attn_probs": no_effect("a nanotron debugging log"),
    _MODEL + "ring_attn_heads_k_stride": no_effect(
        "a detail of nanotron's ring kernel; femtotron's cp rings"
    ),
    _MOE + "num_experts": to(_MODEL + "moe.num_experts"),
    _MOE + "top_k": to(_MODEL + "moe.num_experts_per_tok"),
    _MOE + "moe_intermediate_size": to(_MODEL + "moe.intermediate_size"),
    _MOE + "shared_expert_intermediate_size": to(
        _MODEL + "moe.num_shared_experts",
        _shared_experts,
        "in experts of moe_intermediate_size, when enabled",
    ),
    _MOE + "router_aux_loss_coef": to(
        _MODEL + "moe.aux_loss_coef",
        lambda value, parent: 0.0,
        "0: nanotron reads it, but its MoE layer (nn/moe.py) adds no load-balancing loss",
    ),
    _MOE + "layers": Key(
        action=TRANSLATED,
        target=_MODEL + "moe.dense_layers",
        why="the layers with experts ([-1]: all); the others are dense",
        transform=_dense_layers,
        whole=True,
    ),
    _MOE + "enable_shared_expert": to(
        _MODEL + "moe.shared_expert_gate",
        _dropping(False),
        "nanotron's shared expert is scaled per token by sigmoid(x . w) (nn/moe.py)",
    ),
    _MOE + "token_dispatcher_type": no_effect("a communication pattern; the experts compute the same"),
    "model.init_method.std": same(),
    "model.init_method.scaling_method": unless_default(
        "NUM_LAYERS", "femtotron scales output projections by 1/sqrt(2 * num_hidden_layers) (NUM_LAYERS)"
    ),
    "model.init_method.use_mup": refused("SpectralMupInit is not in femtotron; delete init_method.use_mup"),
    "model.init_method.path": to("model.init_from", why="a Hugging Face directory or femtotron run"),
    "model.dtype": to("model.dtype", _dtype, "`torch.bfloat16`: `bfloat16`"),
    "model.make_vocab_size_divisible_by": to(
        _MODEL + "vocab_size", _padded_vocab, "vocab_size rounded up to a multiple (nanotron pads the rows)"
    ),
    "model.ddp_bucket_cap_mb": to("parallelism.dp_bucket_size_mb"),
    "tokenizer.tokenizer_name_or_path": same(),
    "tokenizer.tokenizer_revision": unless_default(None, f"a hub revision; {_NO_NETWORK}"),
    "tokenizer.tokenizer_max_length": no_effect("samples are tokens.sequence_length long"),
    "checkpoints.checkpoints_path": same(),
    "checkpoints.checkpoint_interval": same(),
    "checkpoints.save_initial_state": same(),
    "checkpoints.save_final_state": same(),
    "checkpoints.resume_checkpoint_path": same(),
    "checkpoints.load_lr_scheduler": same(),
    "checkpoints.load_optimizer": same(),
    "checkpoints.checkpoints_path_is_shared_file_system": no_effect(
        "every rank writes its own shard and rank 0 commits"
    ),
    "logging.log_level": same(),
    "logging.log_level_replica": no_effect(
        "femtotron's other ranks print only what differs between ranks (their errors); `train --debug` "
        "makes every rank log everything"
    ),
    "logging.iteration_step_info_interval": same(),
    "metrics_logging.log_level": no_effect(
        "femtotron logs one step record (loss, lr, grad norm, throughput, MFU, memory, communication, expert "
        "loads); nanotron's per-module statistics (log_level: 1) are not computed"
    ),
    "metrics_logging.log_detail_interval": no_effect("read with metrics_logging.log_level"),
    "tokens.sequence_length": same(),
    "tokens.train_steps": same(),
    "tokens.micro_batch_size": same(),
    "tokens.batch_accumulation_per_replica": same(),
    "tokens.val_check_interval": to("tokens.val_check_interval", _no_validation, "-1: 0, no validation"),
    "tokens.limit_val_batches": to("tokens.limit_val_batches", _dropping(0, None), "0: femtotron's default"),
    "tokens.limit_test_batches": no_effect("nanotron's training runs no test batches"),
    "optimizer.optimizer_factory.name": same(),
    "optimizer.optimizer_factory.adam_eps": same(),
    "optimizer.optimizer_factory.adam_beta1": same(),
    "optimizer.optimizer_factory.adam_beta2": same(),
    "optimizer.optimizer_factory.torch_adam_is_fused": same(),
    "optimizer.zero_stage": same(),
    "optimizer.weight_decay": same(),
    "optimizer.clip_grad": same(),
    "optimizer.accumulate_grad_in_fp32": same(),
    _LR + "learning_rate": same(),
    _LR + "lr_warmup_steps": same(),
    _LR + "lr_warmup_style": same(),
    _LR + "lr_decay_style": to(_LR + "lr_decay_style", _default_if_null("linear"), "null: linear"),
    _LR + "lr_decay_steps": same(),
    _LR + "lr_decay_starting_step": same(),
    _LR + "min_decay_lr": to(_LR + "min_decay_lr", _min_lr, "null: the learning rate (no decay)"),
    "optimizer.weight_decay_exclude_named_params": Key(
        action=TRANSLATED,
        target="optimizer.weight_decay_exclude_named_params",
        why="nanotron's regexes over its parameter names, rewritten over femtotron's (the same parameters)",
        transform=_excluded_from_decay,
        whole=True,
    ),
    "profiler.profiler_export_path": no_effect("traces go to <run dir>/profile/"),
    "profiler.skip_first": to("profiling.profile_steps", _profile_steps, _SCHEDULE),
    "profiler.wait": to("profiling.profile_steps", _profile_steps, _SCHEDULE),
    "profiler.warmup": to("profiling.profile_steps", _profile_steps, _SCHEDULE),
    "profiler.active": to("profiling.profile_steps", _profile_steps, _SCHEDULE),
    "profiler.repeat": to("profiling.profile_steps", _profile_steps, "only 1"),
    "profiler.record_shapes": no_effect("femtotron's trace settings are fixed"),
    "profiler.profile_memory": no_effect("femtotron's trace settings are fixed"),
    "profiler.with_stack": no_effect("femtotron's trace settings are fixed"),
    "profiler.export_chrome_trace": no_effect("femtotron's trace settings are fixed"),
    "lighteval": refused(_EVALUATE),
    "s3_upload": refused(
        "femtotron does not upload checkpoints; copy checkpoints_path with your own tool; delete s3_upload"
    ),
    "data_stages": to(
        "data.stages",
        _stage_list,
        "sorted by start_training_step; a single stage's keys go into data itself",
    ),
    _STAGE + "name": to("data.stages.*.name"),
    _STAGE + "start_training_step": to("data.stages.*.start_training_step"),
    _STAGE + "sequence_length": no_effect("null or tokens.sequence_length; another is refused"),
    _STAGE + "data.seed": to("data.stages.*.seed", _dropping(None), "null: data.seed"),
    _STAGE + "data.num_loading_workers": no_effect("femtotron memory-maps the data in the training process"),
    _STAGE + "data.dataset": to("data.stages.*.synthetic", _synthetic, "null: random tokens"),
    _DATASET + "dataset_folder": to(
        "data.stages.*.dataset_folder",
        _dataset_folder,
        "with dataset_weights, one per folder: {folder: weight}; dataset_read_path first; a {folder: weight} "
        "mapping is refused, as nanotron's loader refuses it",
    ),
    _DATASET + "dataset_weights": no_effect("read with dataset_folder: {folder: weight}"),
    _DATASET + "dataset_read_path": no_effect("read with dataset_folder: its folders are the ones read"),
    _DATASET + "tokenizer_name": no_effect("femtotron's tokenizer is tokenizer.tokenizer_name_or_path"),
    _DATASET + "vocab_size": no_effect("the model's vocab_size is model_config.vocab_size"),
    _DATASET + "token_size_in_bytes": no_effect("femtotron reads the token size from the folder"),
    _DATASET + "return_positions": no_effect("femtotron finds document ends in the folder's index"),
    _DATASET + "skip_in_stream": unless_default(False, "femtotron's sampler resumes exactly; set false"),
    _DATASET + "pad_samples_to_global_batch_size": unless_default(False, "femtotron never pads; set false"),
    _DATASET + "dataset_max_tokens": unless_default(None, "femtotron reads whole folders; delete it"),
    _DATASET + "shuffle_files": unless_default(False, "femtotron shuffles samples with data.seed"),
    _DATASET + "use_old_brrr_dataloader": unless_default(False, "delete it"),
    _DATASET + "hf_dataset_or_datasets": to("data.stages.*.text_dataset", why=_HF_DATASETS),
    _DATASET + "hf_dataset_splits": unless_default(
        "train", "point hf_dataset_or_datasets at the split's own directory (DATASET_DIR/SPLIT)"
    ),
    _DATASET + "hf_dataset_config_name": unless_default(
        None, "a Hub dataset's configuration: point hf_dataset_or_datasets at its local copy instead"
    ),
    _DATASET + "dataset_processing_num_proc_per_process": no_effect(
        "femtotron tokenizes with one process per 64 MiB of text, up to the CPUs it may use"
    ),
    _DATASET + "dataset_overwrite_cache": no_effect(
        "the cached tokens are named by the text's files and the tokenizer: a change tokenizes again"
    ),
    _DATASET + "text_column_name": to("data.stages.*.text_column", _dropping(None), "null: text"),
    _DATASET + "sft_dataloader": unless_default(
        False, "femtotron pretrains on packed documents; it has no supervised fine-tuning data loader"
    ),
    _DATASET + "debug_max_samples": unless_default(None, "femtotron reads whole datasets; delete it"),
}

_LLAMOE = (
    f"{_REFUSES}: a key of LlaMoE's own config class (examples/moe/config_llamoe.py), but nanotron builds "
    "model_config as a Qwen2Config first (ModelArgs), in examples/moe/train_moe.py too; "
)
_ADAM_PLACE = (
    f"{_REFUSES} here: nanotron read the Adam settings here until optimizer_factory (April 2024, "
    "abd91dc3); move it under optimizer.optimizer_factory"
)
# Keys that nanotron's own example configs at 2411b02 still hold but its loader there refuses (an older
# schema's, or an example's own model class): refused as unknown, saying where they went.
FORMER_KEYS = {
    _MODEL + "interleaved_rotary": f"{_REFUSES}: nanotron's name for rope_interleaved until 6407c9cb "
    "(March 2025); rename it rope_interleaved",
    "parallelism.moe_layer_recompute": f"{_REFUSES}: removed from nanotron in 7bc99232 (June 2025); delete "
    "it (parallelism.recompute_layer recomputes whole layers, experts included)",
    "optimizer.adam_beta1": _ADAM_PLACE,
    "optimizer.adam_beta2": _ADAM_PLACE,
    "optimizer.adam_eps": _ADAM_PLACE,
    "optimizer.torch_adam_is_fused": _ADAM_PLACE,
    _MODEL + "is_llamoe_config": _LLAMOE + "write is_qwen2_config: true with the experts in moe_config",
    _MODEL + "moe_num_experts": _LLAMOE + "write it as moe_config.num_experts, with moe_config."
    "moe_intermediate_size: intermediate_size (LlaMoE's experts are that wide)",
    _MODEL + "num_experts_per_tok": _LLAMOE + "write it as moe_config.top_k",
    _MODEL + "moe_capacity_factor": _LLAMOE + "LlaMoE's model does not read it; delete it",
}

# Every section of the table (`lighteval`, `model.model_config`, ...): null there means not set; but a
# stage's `dataset: null` is nanotron's dummy data.
_SECTIONS = {key.rsplit(".", 1)[0] for key in KEYS} - {_STAGE + "data.dataset"} | {"lighteval", "s3_upload"}


@dataclass(kw_only=True)
class Translation:
    """A nanotron config in femtotron's keys, what was done to each key, and what cannot run."""

    config: dict[str, Any]
    lines: dict[str, int]
    moves: list[tuple[str, str, Any]]  # (nanotron path, femtotron key, value) of each translated key
    no_effect: list[str]
    problems: list[Problem]

    @property
    def translated(self) -> list[str]:
        """One line per translated key: `nanotron path -> femtotron key = value`."""
        return [
            f"{path} -> {target}" + ("" if value is SECTION else f" = {value!r}")
            for path, target, value in self.moves
        ]

    def report(self, source: str, duplicates: Sequence[Problem] = ()) -> str:
        text = [f"femtotron: {source} is a nanotron config; translated into femtotron's (docs/nanotron.md):"]
        text += [f"  warning: {problem} femtotron uses the last, as nanotron does" for problem in duplicates]
        text += [f"  nanotron {line}" for line in self.translated]
        if self.no_effect:
            text.append(
                f"  no effect in femtotron ({len(self.no_effect)} keys, see docs/nanotron.md for why): "
                + ", ".join(self.no_effect)
            )
        return "\n".join(text)


def _leaves(data: Any, prefix: str = "") -> list[tuple[str, str, Any, Mapping[str, Any]]]:
    """(table key, YAML path, value, parent) for every key in `data`, list items under data_stages as `*`;
    a section refused whole (lighteval, s3_upload) is one leaf."""
    found = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if value is None and _generic(path) in _SECTIONS:  # `profiler: null`: the section is absent
            continue
        if path == "model.model_config" and isinstance(value, Mapping) and value.get("is_starcoder2_config"):
            flag = path + ".is_starcoder2_config"  # its other keys are Starcoder2's: one refusal says it all
            found.append((flag, flag, True, value))
            continue
        if path == _MOE[:-1] and isinstance(value, Mapping):
            value = {**_MOE_DEFAULTS, **value}
        if isinstance(value, Mapping) and not path.endswith(
            (".rope_scaling", ".dataset_folder", ".hf_dataset_or_datasets")
        ):
            pattern = _generic(path)
            if pattern in KEYS and KEYS[pattern].action == REFUSED:
                found.append((pattern, path, value, data))
            else:
                found += _leaves(value, path + ".")
        elif path == "data_stages" and isinstance(value, list):
            found.append((path, path, value, data))
            for i, stage in enumerate(value):
                if isinstance(stage, Mapping):
                    found += _leaves(stage, f"{path}.{i}.")
        else:
            found.append((_generic(path), path, value, data))
    return found


def _generic(path: str) -> str:
    parts = path.split(".")
    if parts[0] == "data_stages" and len(parts) > 1:
        parts[1] = "*"
    return ".".join(parts)


def translate(data: Mapping[str, Any], lines: Mapping[str, int]) -> Translation:
    """`data` (a nanotron config) in femtotron's schema; problems hold every key femtotron cannot run."""
    out: dict[str, Any] = {}
    new_lines: dict[str, int] = {}
    result = Translation(config=out, lines=new_lines, moves=[], no_effect=[], problems=[])
    where: dict[str, list[tuple[str, Any, Mapping[str, Any]]]] = {}
    for table_key, path, value, parent in _leaves(data):
        if table_key not in KEYS:
            result.problems.append(_unknown(table_key, path, lines))
        where.setdefault(table_key, []).append((path, value, parent))
    sequence = (data.get("tokens") or {}).get("sequence_length")
    for table_key, entry in KEYS.items():
        for path, value, parent in where.get(table_key, []):
            if table_key == _STAGE + "sequence_length" and value not in (None, sequence):
                message = f"a stage's own sequence_length ({value}) is not supported; set it to null"
                result.problems.append(Problem((path,), message, (_line(lines, path),)))
                continue
            _apply(entry, table_key, path, value, parent, data, lines, result)
    _place_stages(result, lines)
    _full_attention_without_rope(result)
    _softmax_then_topk(result)
    return result


def _softmax_then_topk(result: Translation) -> None:
    """nanotron's router (nn/moe.py) weighs the chosen experts by a softmax over all of them."""
    moe = result.config.get("model", {}).get("model_config", {}).get("moe")
    if moe is not None:
        moe["router_norm"] = "softmax_then_topk"


def _full_attention_without_rope(result: Translation) -> None:
    """nanotron's Qwen model gives its layers without RoPE no sliding window: full_attention_layers here."""
    model_config = result.config.get("model", {}).get("model_config", {})
    if model_config.get("sliding_window") is None or not model_config.get("no_rope_layers"):
        return
    model_config["full_attention_layers"] = list(model_config["no_rope_layers"])


def _place_stages(result: Translation, lines: Mapping[str, int]) -> None:
    """The stages, translated as `data.stages.<i>` in the order the YAML lists them, sorted by their start
    step as nanotron sorts them; a single stage's keys become data's own (femtotron's shorter form)."""
    data = result.config.get("data", {})
    stages = data.pop("stages", None)
    if not stages:
        return

    def start(index: str) -> tuple[int, int]:
        value = stages[index].get("start_training_step", 1)
        step = value if isinstance(value, int) else 0  # not a number: refused by femtotron's validation
        return step, int(index)

    order = sorted(stages, key=start)
    if len(order) == 1:
        only = stages[order[0]]
        only.pop("name", None)
        first = only.pop("start_training_step", 1)
        if first != 1:
            path = f"data_stages.{order[0]}.start_training_step"
            message = (
                f"the one data stage starts at step {first!r}: steps before it have no data; set it to 1"
            )
            result.problems.append(Problem((path,), message, (_line(lines, path),)))
        data.update(only)
        place = {f"data.stages.{order[0]}.": "data."}
        summary = "data (the keys of its one stage)"
    else:
        data["stages"] = [stages[index] for index in order]
        place = {f"data.stages.{index}.": f"data.stages.{new}." for new, index in enumerate(order)}
        summary = f"data.stages ({len(order)} stages, in the order they start)"

    def moved(key: str) -> str:
        return next((new + key[len(old) :] for old, new in place.items() if key.startswith(old)), key)

    result.lines = {moved(key): line for key, line in result.lines.items()}
    result.moves = [("data_stages", summary, SECTION)] + [
        (path, moved(target), value) for path, target, value in result.moves
    ]


def _apply(
    entry: Key,
    table_key: str,
    path: str,
    value: Any,
    parent: Mapping[str, Any],
    root: Mapping[str, Any],
    lines: Mapping[str, int],
    result: Translation,
) -> None:
    if entry.action == REFUSED:
        result.problems.append(Problem((path,), f"refused: {entry.why}", (_line(lines, path),)))
        return
    try:
        given = root if entry.whole else parent
        final = entry.transform(value, given) if entry.transform is not None else value
    except (TypeError, ValueError) as refusal:  # a Refusal, or a value of the wrong type
        shown = "null" if value is None else repr(value)
        result.problems.append(Problem((path,), f"{shown} is refused: {refusal}", (_line(lines, path),)))
        return
    if final is SECTION:  # its items are translated one by one
        return
    if entry.action == NO_EFFECT or final is DROP:
        if table_key not in result.no_effect:
            result.no_effect.append(table_key)
        return
    target = entry.target or path
    if "*" in target:  # a stage's key: data.stages.<its index in data_stages>
        target = target.replace("*", path.split(".")[1])
    _set(result.config, target, final)
    if path in lines:
        result.lines[target] = lines[path]
    if entry.action == TRANSLATED and (target != path or final != value):
        result.moves.append((path, target, final))


def _set(config: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _line(lines: Mapping[str, int], path: str) -> str:
    return f"line {lines[path]}" if path in lines else ""


def _unknown(table_key: str, path: str, lines: Mapping[str, int]) -> Problem:
    if table_key in FORMER_KEYS:
        return Problem((path,), FORMER_KEYS[table_key], (_line(lines, path),))
    section = table_key.rsplit(".", 1)[0] if "." in table_key else ""
    leaf = table_key.rsplit(".", 1)[-1]
    elsewhere = [k for k in KEYS if k.rsplit(".", 1)[-1] == leaf]
    known = sorted(k.rsplit(".", 1)[-1] for k in KEYS if k.rsplit(".", 1)[0] == section)
    where = (
        f"nanotron's schema has it at {' or '.join(elsewhere)}; move it there"
        if elsewhere
        else f"nanotron's keys here: {', '.join(known) or 'none'}"
    )
    message = (
        f"unknown key in a nanotron config (recognised by its nanotron-only sections); {where}. A config in "
        "femtotron's own keys must not mix in nanotron's sections (`femtotron convert-config` converts one)"
    )
    return Problem((path,), message, (_line(lines, path),))


_REPORTED: set[str] = set()  # the files whose translation this process has printed


def translate_or_fail(
    data: Mapping[str, Any], lines: Mapping[str, int], source: str, duplicates: Sequence[Problem] = ()
) -> Translation:
    """`translate`, raising one ConfigError with every problem; the report, with a warning for each of the
    file's `duplicates` (keys set twice: the last is kept, as nanotron keeps it), is printed once (not by
    the processes a run starts, which load the same file again)."""
    result = translate(data, lines)
    if result.problems:
        n = len(result.problems)
        header = f"Cannot run nanotron config {source} in femtotron: {n} problem{'s' if n != 1 else ''}"
        raise_problems(header, result.problems)
    first = source not in _REPORTED  # check-tp loads its config twice
    if first and os.environ.get("RANK", "0") == "0" and not os.environ.get(LOCKED_ENV):
        print(result.report(source, duplicates), file=sys.stderr)
    _REPORTED.add(source)
    return result


def render_table() -> str:
    """The Markdown table of KEYS, then FORMER_KEYS, for docs/nanotron.md."""
    rows = ["| nanotron key | femtotron | notes |", "|---|---|---|"]
    for key, entry in KEYS.items():
        if entry.action == HONORED:
            what = "honored (same key)"
        elif entry.action == TRANSLATED:
            what = f"translated to `{entry.target}`"
        else:
            what = entry.action
        notes = entry.why.replace("|", "\\|")
        rows.append(f"| `{key}` | {what} | {notes} |")
    rows += [f"| `{key}` | refused (not nanotron's at 2411b02) | {why} |" for key, why in FORMER_KEYS.items()]
    return "\n".join(rows)
