"""Full-shape femtotron weights <-> the state dicts of the Hugging Face families in models/families.py.

Only the fused weights need work (see models/llama.py): `qkv_proj` (weight and bias) holds, per key/value
head, that group's query rows, then the key rows, then the value rows; `gate_up_proj` stacks gate and up as
(2, intermediate_size, hidden_size), and the experts' as (experts, 2, intermediate, hidden), where HF
checkpoints hold each expert's three matrices under its own names (`Family.experts`). The router is HF's
`gate`. Phi-3 keeps q, k, v as one `qkv_proj` and gate, up as one `gate_up_proj` on disk, concatenated
(`disk_rows`). Everything else maps by name (HF adds a `model.` prefix to all but `lm_head`).
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

from femtotron.config import LlamaConfig
from femtotron.models.families import Family, family_of

EXPERT = re.compile(r"(layers\.\d+)\.(?:block_sparse_moe|mlp)\.(?:experts\.(\d+)\.(\w+)|gate)\.weight")
FUSED_ON_DISK = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _head_shapes(cfg: LlamaConfig) -> tuple[int, int, int]:
    return cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim


def _part_rows(cfg: LlamaConfig) -> dict[str, int]:
    """The rows of each part of a tensor Phi-3 fuses on disk."""
    kv = cfg.num_key_value_heads * cfg.head_dim
    inner = cfg.intermediate_size
    return {"q_proj": cfg.attention_width, "k_proj": kv, "v_proj": kv, "gate_proj": inner, "up_proj": inner}


def disk_rows(name: str, cfg: LlamaConfig, family: Family) -> tuple[str, int]:
    """Where HF's separate tensor `name` (e.g. model.layers.0.self_attn.k_proj.weight) is on disk: the name
    of the tensor holding it and its first row there (Phi-3: a part of qkv_proj or gate_up_proj)."""
    if family.fused_on_disk:
        rows = _part_rows(cfg)
        for fused, parts in FUSED_ON_DISK.items():
            for index, part in enumerate(parts):
                if f".{part}." in name:
                    return name.replace(part, fused), sum(rows[p] for p in parts[:index])
    return name, 0


def to_hf(
    state: dict[str, torch.Tensor], cfg: LlamaConfig, family: Family | None = None
) -> dict[str, torch.Tensor]:
    family = family or family_of(cfg)
    kv_heads, group, head_dim = _head_shapes(cfg)
    out = {}
    for name, tensor in state.items():
        if ".self_attn.qkv_proj." in name:  # its weight, or its bias
            module, kind = name.rsplit(".qkv_proj.", 1)
            prefix = f"model.{module}."
            rest = tensor.shape[1:]  # (hidden,) for the weight, () for the bias
            grouped = tensor.view(kv_heads, group + 2, head_dim, *rest)
            out[f"{prefix}q_proj.{kind}"] = grouped[:, :group].reshape(-1, *rest)
            out[f"{prefix}k_proj.{kind}"] = grouped[:, group].reshape(-1, *rest)
            out[f"{prefix}v_proj.{kind}"] = grouped[:, group + 1].reshape(-1, *rest)
        elif name.endswith("gate_up_proj.weight"):
            prefix = "model." + name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.unbind(0)
            out[prefix + "gate_proj.weight"] = gate
            out[prefix + "up_proj.weight"] = up
        elif ".mlp.router." in name or ".mlp.experts." in name:
            block, gate, up, down = family.experts
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
    if family.fused_on_disk:
        out = _fused(out, cfg, family)
    return {name: tensor.contiguous() for name, tensor in out.items()}


def _fused(state: dict[str, torch.Tensor], cfg: LlamaConfig, family: Family) -> dict[str, torch.Tensor]:
    """`state` with the parts Phi-3 fuses on disk concatenated, in `disk_rows`' order."""
    parts: defaultdict[str, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    out = {}
    for name, tensor in state.items():
        disk_name, first = disk_rows(name, cfg, family)
        if disk_name == name:
            out[name] = tensor
        else:
            parts[disk_name].append((first, tensor))
    for disk_name, pieces in parts.items():
        out[disk_name] = torch.cat([tensor for _, tensor in sorted(pieces, key=lambda piece: piece[0])])
    return out


def _separated(
    hf_state: dict[str, torch.Tensor], cfg: LlamaConfig, family: Family
) -> dict[str, torch.Tensor]:
    """`hf_state` with the tensors Phi-3 fuses on disk split into HF's separate ones."""
    if not family.fused_on_disk:
        return hf_state
    out = dict(hf_state)
    rows = _part_rows(cfg)
    for name, tensor in hf_state.items():
        for fused, parts in FUSED_ON_DISK.items():
            if f".{fused}." in name:
                del out[name]
                pieces = tensor.split([rows[part] for part in parts])
                out.update({name.replace(fused, part): t for part, t in zip(parts, pieces, strict=True)})
    return out


def from_hf(
    hf_state: dict[str, torch.Tensor], cfg: LlamaConfig, family: Family | None = None
) -> dict[str, torch.Tensor]:
    family = family or family_of(cfg)
    kv_heads, group, head_dim = _head_shapes(cfg)
    hf_state = _separated(hf_state, cfg, family)
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
        elif ".self_attn.q_proj." in name:
            module, kind = name.rsplit(".q_proj.", 1)
            rest = tensor.shape[1:]
            q = tensor.view(kv_heads, group, head_dim, *rest)
            k = state[f"{module}.k_proj.{kind}"].view(kv_heads, 1, head_dim, *rest)
            v = state[f"{module}.v_proj.{kind}"].view(kv_heads, 1, head_dim, *rest)
            out[f"{module}.qkv_proj.{kind}"] = torch.cat([q, k, v], dim=1).flatten(0, 2)
        elif name.endswith("gate_proj.weight"):
            prefix = name.removesuffix("gate_proj.weight")
            out[prefix + "gate_up_proj.weight"] = torch.stack([tensor, state[prefix + "up_proj.weight"]])
        elif not re.search(r"\.(k_proj|v_proj|up_proj)\.(weight|bias)$", name):
            out[name] = tensor
    for layer, matrices in experts.items():
        _, gate, up, down = family.experts
        each = range(cfg.moe.num_experts)
        pairs = [torch.stack([matrices[gate, j], matrices[up, j]]) for j in each]
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(pairs)
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([matrices[down, j] for j in each])
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)  # HF may list the tied head; it is the embedding
    return {name: tensor.contiguous() for name, tensor in out.items()}
