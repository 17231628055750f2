"""Full-shape femtotron weights <-> Hugging Face `LlamaForCausalLM` state dicts.

Only the two fused weights need work (see models/llama.py): `qkv_proj` holds, per key/value head,
that group's query rows, then the key rows, then the value rows; `gate_up_proj` stacks gate and up
as (2, intermediate_size, hidden_size). Everything else maps by name (HF adds a `model.` prefix to all but
`lm_head`).
"""

from __future__ import annotations

import torch

from femtotron.config import LlamaConfig


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
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix = "model." + name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.unbind(0)
            out[prefix + "gate_proj.weight"], out[prefix + "up_proj.weight"] = gate, up
        else:
            out[name if name == "lm_head.weight" else "model." + name] = tensor
    return {name: tensor.contiguous() for name, tensor in out.items()}


def from_hf(hf_state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    kv_heads, group, head_dim = _head_shapes(cfg)
    state = {name.removeprefix("model."): tensor for name, tensor in hf_state.items()}
    out = {}
    for name, tensor in state.items():
        if name.endswith("self_attn.q_proj.weight"):
            prefix = name.removesuffix("q_proj.weight")
            q = tensor.view(kv_heads, group, head_dim, -1)
            k = state[prefix + "k_proj.weight"].view(kv_heads, 1, head_dim, -1)
            v = state[prefix + "v_proj.weight"].view(kv_heads, 1, head_dim, -1)
            out[prefix + "qkv_proj.weight"] = torch.cat([q, k, v], dim=1).flatten(0, 2)
        elif name.endswith("mlp.gate_proj.weight"):
            prefix = name.removesuffix("gate_proj.weight")
            out[prefix + "gate_up_proj.weight"] = torch.stack([tensor, state[prefix + "up_proj.weight"]])
        elif not name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
            out[name] = tensor
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)  # HF may list the tied head; it is the embedding
    return {name: tensor.contiguous() for name, tensor in out.items()}
