"""The Hugging Face model families femtotron reads and writes, each in one place.

A `Family` says what transformers calls it (its class and model_type), which of the model's features
(`LlamaConfig`'s fields in FEATURES) it turns on and how its config.json spells them (its sliding window
among them), the config.json values
that mean "off" for what femtotron's model does not compute (refused when on), and how its tensors are named
on disk. The model, tensor parallelism, checkpoints and doctor know only the features; `import-hf`,
`export-hf` and `init_from` know the families through this file alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from femtotron.config import LlamaConfig
from femtotron.config.sections import MoEConfig
from femtotron.errors import ConfigError

# config.json keys that are LlamaConfig fields of the same name and meaning, in every family.
FIELDS = tuple(
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
    "max_position_embeddings rms_norm_eps tie_word_embeddings hidden_act head_dim".split()
)
# The fields a family turns on, with the value that means "off" (a from-scratch Llama's).
FEATURES = {
    "qkv_bias": False,
    "qk_norm": False,
    "qk_norm_span": "head",
    "norm_placement": "before",
    "no_rope_layers": [],
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": None,
    "logits_scaling": 1.0,
    "moe": None,
    "sliding_window": None,
    "full_attention_layers": [],
}
GRANITE_SCALINGS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
# What femtotron's model does not have, as config.json spells "not used", in most families: attention_bias
# also puts a bias on o_proj (Llama, Qwen3), which femtotron's model lacks.
NOT_USED = {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1, "attention_dropout": 0.0}
FULL_ATTENTION = "full_attention"


@dataclass(frozen=True, kw_only=True)
class Family:
    architecture: str  # the transformers class, config.json's "architectures"
    model_type: str
    features: frozenset[str] = frozenset()  # the FEATURES it can turn on
    requires: frozenset[str] = frozenset()  # those it always has (Qwen2's biases, Qwen3's q/k norms)
    # its own config.json keys -> LlamaConfig values (beyond FIELDS and RoPE), and back
    read: Callable[[dict[str, Any]], dict[str, Any]] = lambda hf: {}
    write: Callable[[LlamaConfig], dict[str, Any]] = lambda cfg: {}
    not_used: dict[str, Any] = field(default_factory=lambda: dict(NOT_USED))
    # the layers its config.json gives the sliding window (`sliding_window` positions)
    sliding: Callable[[dict[str, Any]], list[int]] = lambda hf: []
    moe_fits: Callable[[MoEConfig], bool] = lambda moe: False
    experts: tuple[str, str, str, str] | None = None  # the MoE block's name, and an expert's gate, up, down
    fused_on_disk: bool = False  # Phi-3: qkv_proj and gate_up_proj are single tensors on disk too

    def computes(self, cfg: LlamaConfig) -> bool:
        """Whether transformers' class computes `cfg`: every feature `cfg` turns on is one it has, and those
        it always has are on."""
        if cfg.moe is not None and not self.moe_fits(cfg.moe):
            return False
        on = {name for name, off in FEATURES.items() if getattr(cfg, name) != off}
        return self.requires <= on <= self.features


def _smollm3_read(hf: dict[str, Any]) -> dict[str, Any]:
    """SmolLM3's `no_rope_layers` has a 1 for each layer with RoPE; absent, every `no_rope_layer_interval`-th
    layer has none (transformers' default)."""
    interval = hf.get("no_rope_layer_interval", 4)
    layers = hf.get("num_hidden_layers", 36)
    uses_rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    return {"no_rope_layers": [i for i, rope in enumerate(uses_rope) if not rope]}


def _smollm3_write(cfg: LlamaConfig) -> dict[str, Any]:
    uses_rope = [int(i not in cfg.no_rope_layers) for i in range(cfg.num_hidden_layers)]
    return {"no_rope_layers": uses_rope} | _window_by_layer_type(cfg)


def _granite_read(hf: dict[str, Any]) -> dict[str, Any]:
    # Granite's attention_multiplier is the scores' scale itself (1.0 by default, not 1/sqrt(head_dim)).
    return {key: hf.get(key, 1.0) for key in GRANITE_SCALINGS}


def _granite_write(cfg: LlamaConfig) -> dict[str, Any]:
    values = {key: getattr(cfg, key) for key in GRANITE_SCALINGS}
    if values["attention_multiplier"] is None:
        values["attention_multiplier"] = cfg.head_dim**-0.5
    return values


def _mixtral_read(hf: dict[str, Any]) -> dict[str, Any]:
    moe = {
        "num_experts": hf.get("num_local_experts", 8),
        "num_experts_per_tok": hf.get("num_experts_per_tok", 2),
        "intermediate_size": hf.get("intermediate_size", 14336),  # transformers' default
        "aux_loss_coef": hf.get("router_aux_loss_coef", 0.001),
    }
    return {"moe": moe}


def _mixtral_write(cfg: LlamaConfig) -> dict[str, Any]:
    moe = cfg.moe
    return {
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "intermediate_size": moe.intermediate_size,
        "router_aux_loss_coef": moe.aux_loss_coef,
        "sliding_window": cfg.sliding_window,
    }


def _router_norm(hf: dict[str, Any]) -> str:
    """Qwen's `norm_topk_prob`: the k chosen probabilities renormalised, or a softmax over all experts'."""
    return "topk_then_softmax" if hf.get("norm_topk_prob") else "softmax_then_topk"


def _qwen_moe_read(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE (Qwen1.5-MoE) and Qwen3-MoE's experts. Qwen2-MoE's shared experts are one MLP of
    `shared_expert_intermediate_size`, which femtotron holds as that many experts of moe_intermediate_size.
    A layer in `mlp_only_layers`, or off every `decoder_sparse_step`-th, has a dense MLP instead."""
    inner = hf.get("moe_intermediate_size", 1408 if "shared_expert_intermediate_size" in hf else 768)
    step = hf.get("decoder_sparse_step", 1)
    only = hf.get("mlp_only_layers") or []
    layers = range(hf.get("num_hidden_layers", 0))
    moe = {
        "dense_layers": [i for i in layers if i in only or (i + 1) % step != 0],
        "num_experts": hf.get("num_experts", hf.get("num_local_experts", 60)),
        "num_experts_per_tok": hf.get("num_experts_per_tok", 4),
        "intermediate_size": inner,
        "aux_loss_coef": hf.get("router_aux_loss_coef", 0.001),
        "router_norm": _router_norm(hf),
    }
    shared = hf.get("shared_expert_intermediate_size", 0)
    if shared:
        if shared % inner:
            raise ConfigError(
                f"shared_expert_intermediate_size={shared}: femtotron's shared experts are a multiple of "
                f"moe_intermediate_size={inner}"
            )
        moe |= {"num_shared_experts": shared // inner, "shared_expert_gate": True}
    return {"moe": moe}


def _qwen_moe_write(cfg: LlamaConfig) -> dict[str, Any]:
    moe = cfg.moe
    values = {
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_intermediate_size": moe.intermediate_size,
        "router_aux_loss_coef": moe.aux_loss_coef,
        "norm_topk_prob": moe.router_norm == "topk_then_softmax",
        "decoder_sparse_step": 1,
        "mlp_only_layers": moe.dense_layers,
    }
    if moe.num_shared_experts:
        values["shared_expert_intermediate_size"] = moe.num_shared_experts * moe.intermediate_size
    return values


def _qwen2_moe_read(hf: dict[str, Any]) -> dict[str, Any]:
    return _qwen_moe_read(hf) | {"qkv_bias": hf.get("qkv_bias", True)}  # transformers' default: biases


def _qwen2_moe_write(cfg: LlamaConfig) -> dict[str, Any]:
    return _qwen_moe_write(cfg) | {"qkv_bias": cfg.qkv_bias} | _window_by_layer_type(cfg)


def _qwen3_moe_write(cfg: LlamaConfig) -> dict[str, Any]:
    return _qwen_moe_write(cfg) | _window_when_used(cfg)


def _all_layers(hf: dict[str, Any]) -> list[int]:
    """Mistral, Mixtral, Phi-3: every layer has the window when `sliding_window` is set."""
    return list(range(hf.get("num_hidden_layers", 0))) if hf.get("sliding_window") else []


def _all_layers_when_used(hf: dict[str, Any]) -> list[int]:
    """Qwen3-MoE: every layer has the window under `use_sliding_window`."""
    return _all_layers(hf) if hf.get("use_sliding_window") else []


def _by_layer_type(default: Callable[[dict[str, Any], int], bool]) -> Callable[[dict[str, Any]], list[int]]:
    """Qwen2, Qwen3, Qwen2-MoE, SmolLM3: under `use_sliding_window`, the layers `layer_types` names
    "sliding_attention"; without layer_types (configs before transformers 4.53) those `default` picks."""

    def sliding(hf: dict[str, Any]) -> list[int]:
        if not (hf.get("use_sliding_window") and hf.get("sliding_window")):
            return []
        layers = range(hf.get("num_hidden_layers", 0))
        types = hf.get("layer_types") or ["sliding_attention" if default(hf, i) else "" for i in layers]
        return [i for i, kind in enumerate(types) if kind == "sliding_attention"]

    return sliding


def _window_everywhere(cfg: LlamaConfig) -> dict[str, Any]:
    return {"sliding_window": cfg.sliding_window}


def _window_when_used(cfg: LlamaConfig) -> dict[str, Any]:
    return {"use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window}


def _window_by_layer_type(cfg: LlamaConfig) -> dict[str, Any]:
    kinds = ["sliding_attention" if cfg.windowed(i) else FULL_ATTENTION for i in range(cfg.num_hidden_layers)]
    return _window_when_used(cfg) | {"layer_types": kinds}


# transformers' layer types for a config without them: Qwen2 and Qwen3 slide from max_window_layers on,
# Qwen2-MoE on the even layers below it, SmolLM3 on its layers without RoPE.
_QWEN_WINDOW = _by_layer_type(lambda hf, i: i >= hf.get("max_window_layers", 28))
_QWEN2_MOE_WINDOW = _by_layer_type(lambda hf, i: i % 2 == 0 and i < hf.get("max_window_layers", 28))
_SMOLLM3_WINDOW = _by_layer_type(lambda hf, i: i in _smollm3_read(hf)["no_rope_layers"])
WINDOWS = frozenset({"sliding_window", "full_attention_layers"})


QWEN_NOT_USED = {"attention_dropout": 0.0}  # Qwen2 has no attention_bias key: its q, k, v always have biases
MIXTURES = ("moe",)
QWEN_EXPERTS = ("mlp", "gate_proj", "up_proj", "down_proj")

SLIDING = frozenset({"sliding_window"})  # a window on every layer
OLMO2 = frozenset({"qk_norm", "qk_norm_span", "norm_placement"})  # norms after each block, q/k over all heads
# In the order `export-hf` tries them for a model of femtotron's own: the first that computes it.
FAMILIES = (
    Family(architecture="LlamaForCausalLM", model_type="llama"),
    Family(
        architecture="MistralForCausalLM",
        model_type="mistral",
        features=SLIDING,
        write=_window_everywhere,
        sliding=_all_layers,
    ),
    Family(
        architecture="Qwen2ForCausalLM",
        requires=frozenset({"qkv_bias"}),
        model_type="qwen2",
        features=frozenset({"qkv_bias", *WINDOWS}),
        read=lambda hf: {"qkv_bias": True},
        write=_window_by_layer_type,
        not_used=QWEN_NOT_USED,
        sliding=_QWEN_WINDOW,
    ),
    Family(
        architecture="Qwen3ForCausalLM",
        requires=frozenset({"qk_norm"}),
        model_type="qwen3",
        features=frozenset({"qk_norm", *WINDOWS}),
        read=lambda hf: {"qk_norm": True},
        write=_window_by_layer_type,
        sliding=_QWEN_WINDOW,
    ),
    Family(
        architecture="SmolLM3ForCausalLM",
        model_type="smollm3",
        features=frozenset({"no_rope_layers", *WINDOWS}),
        read=_smollm3_read,
        write=_smollm3_write,
        sliding=_SMOLLM3_WINDOW,
    ),
    Family(
        architecture="Olmo2ForCausalLM",
        model_type="olmo2",
        features=OLMO2,
        requires=OLMO2,
        read=lambda hf: {"qk_norm": True, "qk_norm_span": "all_heads", "norm_placement": "after"},
        not_used={"attention_bias": False, "attention_dropout": 0.0},
    ),
    Family(
        architecture="GraniteForCausalLM",
        model_type="granite",
        features=frozenset(GRANITE_SCALINGS),
        read=_granite_read,
        write=_granite_write,
    ),
    Family(
        architecture="Phi3ForCausalLM",
        model_type="phi3",
        features=SLIDING,
        write=_window_everywhere,
        not_used={"attention_dropout": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0},
        sliding=_all_layers,
        fused_on_disk=True,
    ),
    Family(
        architecture="MixtralForCausalLM",
        requires=frozenset(MIXTURES),
        model_type="mixtral",
        features=frozenset({*MIXTURES, *SLIDING}),
        read=_mixtral_read,
        write=_mixtral_write,
        not_used=NOT_USED | {"router_jitter_noise": 0.0},
        sliding=_all_layers,
        moe_fits=lambda moe: (
            moe.num_shared_experts == 0 and not moe.dense_layers and moe.router_norm == "topk_then_softmax"
        ),
        experts=("block_sparse_moe", "w1", "w3", "w2"),
    ),
    Family(
        architecture="Qwen3MoeForCausalLM",
        requires=frozenset({"qk_norm", *MIXTURES}),
        model_type="qwen3_moe",
        features=frozenset({"qk_norm", *MIXTURES, *SLIDING}),
        read=lambda hf: _qwen_moe_read(hf) | {"qk_norm": True},
        write=_qwen3_moe_write,
        not_used=NOT_USED,
        sliding=_all_layers_when_used,
        moe_fits=lambda moe: moe.num_shared_experts == 0,
        experts=QWEN_EXPERTS,
    ),
    Family(
        architecture="Qwen2MoeForCausalLM",
        requires=frozenset(MIXTURES),
        model_type="qwen2_moe",
        features=frozenset({"qkv_bias", *MIXTURES, *WINDOWS}),
        read=_qwen2_moe_read,
        write=_qwen2_moe_write,
        not_used=QWEN_NOT_USED,
        sliding=_QWEN2_MOE_WINDOW,
        moe_fits=lambda moe: moe.num_shared_experts > 0 and moe.shared_expert_gate,
        experts=QWEN_EXPERTS,
    ),
)
BY_ARCHITECTURE = {family.architecture: family for family in FAMILIES}
BY_MODEL_TYPE = {family.model_type: family for family in FAMILIES}
# Families transformers has that femtotron refuses, with what it lacks for them.
REFUSED = {
    "Gemma2ForCausalLM": "Gemma 2 needs GeGLU, (1 + w) norms, norms both before and after each block, and "
    "soft-capped attention scores and logits, which femtotron's model does not have",
    "Gemma3ForCausalLM": "Gemma 3 needs GeGLU, (1 + w) norms, norms both before and after each block, and a "
    "RoPE of their own for its sliding-window layers, which femtotron's model does not have",
    "Starcoder2ForCausalLM": "Starcoder2 uses LayerNorm with biases and a GELU MLP, not RMSNorm and SwiGLU",
}


def family_named(architecture: str) -> Family:
    if architecture in BY_ARCHITECTURE:
        return BY_ARCHITECTURE[architecture]
    raise ConfigError(
        f"model.hf_architecture={architecture!r}: femtotron writes {', '.join(BY_ARCHITECTURE)}. Choose one, "
        "or leave it unset for the first that computes the model."
    )


def family_of(cfg: LlamaConfig, architecture: str | None = None) -> Family:
    """The family `export-hf` writes `cfg` as: `architecture` (model.hf_architecture, set by `import-hf`),
    else the first of FAMILIES whose transformers class computes it."""
    candidates = [family_named(architecture)] if architecture else list(FAMILIES)
    for family in candidates:
        if family.computes(cfg):
            return family
    on = sorted(name for name, off in FEATURES.items() if getattr(cfg, name) != off)
    able = [f.architecture for f in FAMILIES if f.computes(cfg)]
    if architecture and able:
        fix = f"model.hf_architecture one of {', '.join(able)}"
    else:  # no family has these features together, or not this mixture of experts
        fix = (
            "turn off some of these features; a mixture of experts must be Mixtral's (no shared experts, "
            "router_norm topk_then_softmax), Qwen2-MoE's (gated shared experts) or Qwen3-MoE's (none shared)"
        )
    which = f"{architecture} does not compute" if architecture else "no transformers class computes"
    raise ConfigError(
        f"model.model_config turns on {', '.join(on) or 'no feature'}: {which} that. Fix: {fix}."
    )
