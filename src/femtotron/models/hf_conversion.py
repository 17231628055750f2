"""Full-shape femtotron weights <-> Hugging Face `LlamaForCausalLM` (and `MixtralForCausalLM`,
`Qwen2MoeForCausalLM`) state dicts.

Only the fused weights need work (see models/llama.py): `qkv_proj` holds, per key/value head,
that group's query rows, then the key rows, then the value rows; `gate_up_proj` stacks gate and up
as (2, intermediate_size, hidden_size), and the experts' as (experts, 2, intermediate, hidden), where HF
checkpoints hold each expert's three matrices under its own names (`EXPERT_NAMES`). The router is HF's
`gate`. Everything else maps by name (HF adds a `model.` prefix to all but `lm_head`).
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

from femtotron.config import LlamaConfig
from femtotron.errors import ConfigError

# Per model type: the MoE block's name, and each expert's gate, up and down matrices.
EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen2_moe": ("mlp", *"gate_proj up_proj down_proj".split()),
}
EXPERT = re.compile(r"(layers\.\d+)\.(?:block_sparse_moe|mlp)\.(?:experts\.(\d+)\.(\w+)|gate)\.weight")


def hf_kind(cfg: LlamaConfig) -> str:
    """The transformers model type that computes `cfg`: llama, mixtral or qwen2_moe."""
    moe = cfg.moe
    if moe is None:
        return "llama"
    if moe.num_shared_experts == 0 and moe.router_norm == "topk_then_softmax":
        return "mixtral"
    if moe.num_shared_experts and moe.shared_expert_gate:
        return "qwen2_moe"
    raise ConfigError(
        "model.model_config.moe: transformers has no model with this mixture of experts: MixtralForCausalLM "
        "needs num_shared_experts=0 and router_norm=topk_then_softmax, Qwen2MoeForCausalLM "
        "num_shared_experts >= 1 with shared_expert_gate=true."
    )


def _head_shapes(cfg: LlamaConfig) -> tuple[int, int, int]:
    return cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim


def to_hf(state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    kv_heads, group, head_dim = _head_shapes(cfg)
    out = {}
    for name, tensor in state.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            prefix = "model." + name.removesuffix("qkv_proj.weight")
            grouped = tensor.view(kv_heads, group + 2, head_dim, -1)
            out[prefix + "q_proj.weight"] = grouped[:, :group].reshape(kv_heads * group * head_dim, -1)
            out[prefix + "k_proj.weight"] = grouped[:, group].reshape(kv_heads * head_dim, -1)
            out[prefix + "v_proj.weight"] = grouped[:, group + 1].reshape(kv_heads * head_dim, -1)
        elif name.endswith("gate_up_proj.weight"):
            prefix = "model." + name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.unbind(0)
            out[prefix + "gate_proj.weight"] = gate
            out[prefix + "up_proj.weight"] = up
        elif ".mlp.router." in name or ".mlp.experts." in name:
            block, gate, up, down = EXPERT_NAMES[hf_kind(cfg)]
            prefix = f"model.{name.split('.mlp.')[0]}.{block}."
            each = f"{prefix}experts.{{}}.{{}}.weight"
            if name.endswith("router.weight"):
                out[prefix + "gate.weight"] = tensor
            elif name.endswith("gate_up_proj"):
                for j, (gate_matrix, up_matrix) in enumerate(tensor):
                    out[each.format(j, gate)] = gate_matrix
                    out[each.format(j, up)] = up_matrix
            else:
                out.update({each.format(j, down): matrix for j, matrix in enumerate(tensor)})
        else:
            out[name if name == "lm_head.weight" else "model." + name] = tensor
    return {name: tensor.contiguous() for name, tensor in out.items()}


def from_hf(hf_state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    kv_heads, group, head_dim = _head_shapes(cfg)
    state = {name.removeprefix("model."): tensor for name, tensor in hf_state.items()}
    out = {}
    experts: defaultdict[str, dict[tuple[str, int], torch.Tensor]] = defaultdict(dict)
    for name, tensor in state.items():
        if match := EXPERT.fullmatch(name):
            layer, index, role = match.groups()
            if index is None:
                out[f"{layer}.mlp.router.weight"] = tensor
            else:
                experts[layer][role, int(index)] = tensor
        elif name.endswith("self_attn.q_proj.weight"):
            prefix = name.removesuffix("q_proj.weight")
            q = tensor.view(kv_heads, group, head_dim, -1)
            k = state[prefix + "k_proj.weight"].view(kv_heads, 1, head_dim, -1)
            v = state[prefix + "v_proj.weight"].view(kv_heads, 1, head_dim, -1)
            out[prefix + "qkv_proj.weight"] = torch.cat([q, k, v], dim=1).flatten(0, 2)
        elif name.endswith("gate_proj.weight"):
            prefix = name.removesuffix("gate_proj.weight")
            out[prefix + "gate_up_proj.weight"] = torch.stack([tensor, state[prefix + "up_proj.weight"]])
        elif not name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
            out[name] = tensor
    for layer, matrices in experts.items():
        _, gate, up, down = EXPERT_NAMES[hf_kind(cfg)]
        each = range(cfg.moe.num_experts)
        pairs = [torch.stack([matrices[gate, j], matrices[up, j]]) for j in each]
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(pairs)
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([matrices[down, j] for j in each])
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)  # HF may list the tied head; it is the embedding
    return {name: tensor.contiguous() for name, tensor in out.items()}
