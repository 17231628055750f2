"""LLaMA: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.

Parameter names follow Hugging Face's `LlamaForCausalLM` without its `model.` prefix, so weights
convert by name. Every parameter is made by `make_param` and carries its `ShardInfo`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from femtotron.metrics import cpu_has_bf16_matmul
from femtotron.parallel.sharding import make_param

IGNORE_INDEX = -100
# Read once: /proc/cpuinfo does not change while we run.
CPU_MULTIPLIES_BF16 = cpu_has_bf16_matmul()


def emulated_low_precision(x: torch.Tensor) -> bool:
    """True for bf16/fp16 tensors on a CPU without bf16 matrix units.

    There PyTorch emulates low-precision matmuls: ~70x slower than fp32 for a linear layer and 2-4x
    for attention (forward + backward, measured on an AVX2 CPU). Computing those in fp32 instead
    gives what a GPU tensor core computes anyway (low-precision inputs, fp32 accumulation, output
    rounded back) at fp32 speed.
    """
    return x.dtype != torch.float32 and x.device.type == "cpu" and not CPU_MULTIPLIES_BF16


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if emulated_low_precision(x):
        return F.linear(x.float(), weight.float()).to(x.dtype)
    return F.linear(x, weight)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    gqa = k.shape[1] != q.shape[1]
    if emulated_low_precision(q):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                              enable_gqa=gqa).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


class ParamFactory:
    """Creates named parameters with the model's seed, dtype, device and init std."""

    def __init__(self, std: float, seed: int, dtype: torch.dtype, device: torch.device) -> None:
        self.std, self.seed, self.dtype, self.device = std, seed, dtype, device

    def __call__(self, name: str, shape: tuple[int, ...], std: float | None, **kw: Any) -> nn.Parameter:
        return make_param(name, shape, std=std, seed=self.seed, dtype=self.dtype, device=self.device, **kw)


class Linear(nn.Module):
    def __init__(self, make: ParamFactory, name: str, d_in: int, d_out: int, std: float) -> None:
        super().__init__()
        self.weight = make(f"{name}.weight", (d_out, d_in), std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class Embedding(nn.Module):
    def __init__(self, make: ParamFactory, name: str, vocab: int, dim: int, tie_group: str | None) -> None:
        super().__init__()
        self.weight = make(f"{name}.weight", (vocab, dim), make.std, tie_group=tie_group)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, make: ParamFactory, name: str, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = make(f"{name}.weight", (dim,), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (bf16 loses the small variances), scale in the model's dtype.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding with the rotate-half layout Hugging Face checkpoints use."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, heads, seq, head_dim)."""
        seq = x.shape[-2]
        cos, sin = self.cos[:seq].to(x.dtype), self.sin[:seq].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, make: ParamFactory, name: str, cfg: Any, out_std: float, rotary: Rotary) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        h, kv = cfg.hidden_size, self.n_kv_heads * self.head_dim
        self.q_proj = Linear(make, f"{name}.q_proj", h, h, make.std)
        self.k_proj = Linear(make, f"{name}.k_proj", h, kv, make.std)
        self.v_proj = Linear(make, f"{name}.v_proj", h, kv, make.std)
        self.o_proj = Linear(make, f"{name}.o_proj", h, h, out_std)
        self.rotary = rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary(q), self.rotary(k)
        out = causal_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, make: ParamFactory, name: str, hidden: int, inner: int, out_std: float) -> None:
        super().__init__()
        self.gate_proj = Linear(make, f"{name}.gate_proj", hidden, inner, make.std)
        self.up_proj = Linear(make, f"{name}.up_proj", hidden, inner, make.std)
        self.down_proj = Linear(make, f"{name}.down_proj", inner, hidden, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, make: ParamFactory, index: int, cfg: Any, rotary: Rotary) -> None:
        super().__init__()
        name = f"layers.{index}"
        # Residual-output projections are scaled down by depth so the residual stream's variance
        # does not grow with the number of layers (GPT-2 / Megatron init).
        out_std = make.std / math.sqrt(2 * cfg.num_hidden_layers)
        self.input_layernorm = RMSNorm(make, f"{name}.input_layernorm", cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(make, f"{name}.self_attn", cfg, out_std, rotary)
        self.post_attention_layernorm = RMSNorm(
            make, f"{name}.post_attention_layernorm", cfg.hidden_size, cfg.rms_norm_eps
        )
        self.mlp = MLP(make, f"{name}.mlp", cfg.hidden_size, cfg.intermediate_size, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """The whole model on one device. `forward` returns the summed loss and the token count."""

    def __init__(self, cfg: Any, *, std: float, seed: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        make = ParamFactory(std, seed, dtype, device)
        rotary = Rotary(cfg.hidden_size // cfg.num_attention_heads, cfg.max_position_embeddings, cfg.rope_theta)
        self.rotary = rotary.to(device)
        tie_group = "embed_tokens.weight" if cfg.tie_word_embeddings else None
        self.embed_tokens = Embedding(make, "embed_tokens", cfg.vocab_size, cfg.hidden_size, tie_group)
        self.layers = nn.ModuleList(DecoderLayer(make, i, cfg, self.rotary) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(make, "norm", cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(make, "lm_head", cfg.hidden_size, cfg.vocab_size, std)

    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return linear(self.norm(x), self.output_weight())

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of cross-entropy over valid targets (fp32) and how many there were.

        Returning the sum, not the mean, lets the trainer divide by the token count of the whole
        global batch, so every micro-batch / dp / pp split gives the same loss.
        """
        logits = self.logits(input_ids)
        loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum",
                                   ignore_index=IGNORE_INDEX)
        return loss_sum, (targets != IGNORE_INDEX).sum()
