"""LLaMA: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP, on tensor-parallel layers.

Parameter names are Hugging Face's `LlamaForCausalLM`'s without `model.`, except two fused weights (one
matmul, and contiguous per-tp-rank blocks; `models/hf_conversion.py` maps them): `self_attn.qkv_proj`, per
key/value head its group's query heads, then its key, then its value (Megatron's layout: a tp rank's rows
are whole GQA groups); `mlp.gate_up_proj`, gate and up as one (2, intermediate_size, hidden_size) weight.
Every parameter is made by `make_param` and carries its `ShardInfo`.

The features other model families add (config/sections.py `LlamaConfig`, models/families.py says which
family turns on which) are each a few lines here: biases on qkv_proj, per-head q/k norms, a head_dim of its
own, layers without RoPE, Granite's multipliers, and a sliding window.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from femtotron.attention import causal_attention
from femtotron.batch import IGNORE_INDEX, TokenPlacement
from femtotron.config import LlamaConfig
from femtotron.config.config import RopeScaling
from femtotron.errors import ConfigError
from femtotron.models.moe import MoE, RouterStats
from femtotron.parallel.context_parallel import ContextParallel, ring_attention
from femtotron.parallel.expert_parallel import ExpertParallel
from femtotron.parallel.members import Parallel
from femtotron.parallel.pipeline.partition import Stage
from femtotron.parallel.sharding import make_param
from femtotron.parallel.tensor_parallel import (
    SEQUENCE_DIM,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    enter_column_parallel,
    gather_full,
    shard_size,
    sum_gradient_over_tp,
    sum_over_tp,
    vocab_parallel_cross_entropy,
)
from femtotron.precision import linear


class ParamFactory:
    """Creates named parameters with the model's seed, dtype, device and init std."""

    def __init__(self, std: float, seed: int, dtype: torch.dtype, device: torch.device) -> None:
        self.std = std
        self.seed = seed
        self.dtype = dtype
        self.device = device

    def __call__(self, name: str, shape: tuple[int, ...], std: float | None, **kw: Any) -> nn.Parameter:
        return make_param(name, shape, std=std, seed=self.seed, dtype=self.dtype, device=self.device, **kw)


class RMSNorm(nn.Module):
    def __init__(self, make: ParamFactory, name: str, dim: int, eps: float, tp: TensorParallel) -> None:
        super().__init__()
        self.eps = eps
        self.weight = make(f"{name}.weight", (dim,), None)  # replicated over tp
        self.output_split_dim = SEQUENCE_DIM if tp.sequence_parallel else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (bf16 loses the small variances), scale in the model's dtype.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class HeadNorm(nn.Module):
    """An RMSNorm over each query or key head (Qwen3's q_norm, k_norm): one (head_dim,) weight shared by every
    head. A tp rank normalises its own heads, so the weight's gradient is summed over tp."""

    def __init__(self, make: ParamFactory, name: str, head_dim: int, eps: float, tp: TensorParallel) -> None:
        super().__init__()
        self.eps = eps
        self.tp = tp
        self.weight = make(f"{name}.weight", (head_dim,), None)  # replicated over tp
        self.output_split_dim = 1  # (batch, heads, sequence, head_dim): the heads are split over tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = sum_gradient_over_tp(self.weight, self.tp)
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class HeadsNorm(nn.Module):
    """An RMSNorm over all the query or key heads of a token together (OLMo2's q_norm, k_norm): one weight per
    feature, split over tp with the heads; each rank's sum of squares is summed over tp."""

    def __init__(self, make: ParamFactory, name: str, width: int, eps: float, tp: TensorParallel) -> None:
        super().__init__()
        self.eps = eps
        self.tp = tp
        self.width = width
        self.weight = make(f"{name}.weight", (width,), None, shard_dim=0, rank=tp.rank, world=tp.size)
        self.output_split_dim = 1  # (batch, heads, sequence, head_dim): the heads are split over tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, heads, sequence, head_dim = x.shape
        flat = x.transpose(1, 2).reshape(batch, sequence, heads * head_dim).float()
        squares = sum_over_tp(flat.pow(2).sum(-1, keepdim=True), self.tp)
        normed = (flat * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype)
        return (self.weight * normed).view(batch, sequence, heads, head_dim).transpose(1, 2)


class KVCache:
    """Keys and values of the positions so far, per attention module: a new position costs only its own."""

    def __init__(self) -> None:
        self.length = 0
        self.kv = {}

    def extend(self, attn: nn.Module, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if attn in self.kv:
            old_k, old_v = self.kv[attn]
            k = torch.cat([old_k, k], dim=2)
            v = torch.cat([old_v, v], dim=2)
        self.kv[attn] = (k, v)
        return k, v


# The cos and sin tables hold max_positions * head_dim floats each: past this a config from elsewhere is
# refused rather than allowed to take the machine's memory (4 GiB: 4M positions at head_dim 128).
MAX_ROTARY_BYTES = 2**32


class Rotary(nn.Module):
    """Rotary position embedding with the rotate-half layout Hugging Face checkpoints use."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        device = device or torch.device("cpu")
        if device.type == "meta":  # shapes only (doctor, the checkpoint tools): no tables computed
            self.register_buffer("cos", torch.empty(max_positions, head_dim, device=device), persistent=False)
            self.register_buffer("sin", torch.empty(max_positions, head_dim, device=device), persistent=False)
            return
        if 2 * 4 * max_positions * head_dim > MAX_ROTARY_BYTES:
            raise ConfigError(
                f"model.model_config.max_position_embeddings={max_positions} with head_dim={head_dim}: "
                f"RoPE's tables would take {8 * max_positions * head_dim / 2**30:,.0f} GiB (at most "
                f"{MAX_ROTARY_BYTES // 2**30} GiB). Lower max_position_embeddings to the context the model "
                "is used with."
            )
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        if scaling is not None:  # llama3: slow the low frequencies down, keep the high, ramp between
            wavelength = 2 * math.pi / inv_freq
            original = scaling.original_max_position_embeddings
            low = scaling.low_freq_factor
            high = scaling.high_freq_factor
            ramp = (original / wavelength - low) / (high - low)
            inv_freq = inv_freq * (ramp.clamp(0, 1) * (1 - 1 / scaling.factor) + 1 / scaling.factor)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos().float().to(device), persistent=False)
        self.register_buffer("sin", angles.sin().float().to(device), persistent=False)

    def forward(self, x: torch.Tensor, positions: int | torch.Tensor = 0) -> torch.Tensor:
        """x: (batch, heads, seq, head_dim) at `positions`: an int start, or a (batch, seq) tensor of them."""
        if isinstance(positions, int):
            cos = self.cos[positions : positions + x.shape[-2]]
            sin = self.sin[positions : positions + x.shape[-2]]
        else:
            cos = self.cos[positions].unsqueeze(1)
            sin = self.sin[positions].unsqueeze(1)
        cos = cos.to(x.dtype)
        sin = sin.to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(
        self,
        make: ParamFactory,
        name: str,
        cfg: LlamaConfig,
        out_std: float,
        rotary: Rotary | None,
        parallel: Parallel,
        window: int | None,
    ) -> None:
        """Args:
        make: draws each parameter with its shard metadata (sharding.ParamFactory).
        name: the module's name in the whole model, e.g. `layers.0.self_attn`.
        cfg: the model config.
        out_std: the init std of the output projection (scaled down with depth).
        rotary: the position embedding; None: none in this layer (`no_rope_layers`).
        parallel: the tp, cp and ep this layer talks over.
        window: the sliding window's size; None: the layer attends to the whole sequence.
        """
        super().__init__()
        tp = parallel.tp
        heads = cfg.num_attention_heads
        kv_heads = cfg.num_key_value_heads
        hidden = cfg.hidden_size
        if heads % kv_heads or kv_heads % tp.size:
            raise ConfigError(
                f"model.model_config.num_attention_heads={heads}, num_key_value_heads={kv_heads}, "
                f"parallelism.tp={tp.size}: every tp rank must hold whole groups of query heads with their "
                "key/value head, so num_key_value_heads must divide num_attention_heads and be divisible "
                f"by tp. Choose tp dividing {kv_heads}."
            )
        self.head_dim = cfg.head_dim
        self.group_size = heads // kv_heads
        self.local_kv_heads = kv_heads // tp.size
        qkv_rows = (heads + 2 * kv_heads) * self.head_dim
        # Per key/value head: its group's query heads, its key head, its value head (as `forward` reads them).
        per_kv_head = (self.group_size * self.head_dim, self.head_dim, self.head_dim)
        self.qkv_proj = ColumnParallelLinear(
            make,
            f"{name}.qkv_proj",
            hidden,
            qkv_rows,
            make.std,
            tp,
            bias=cfg.qkv_bias,
            fused_rows=per_kv_head,
        )
        self.o_proj = RowParallelLinear(make, f"{name}.o_proj", cfg.attention_width, hidden, out_std, tp)
        self.q_norm = None
        self.k_norm = None
        eps = cfg.rms_norm_eps
        if cfg.qk_norm and cfg.qk_norm_span == "head":
            self.q_norm = HeadNorm(make, f"{name}.q_norm", self.head_dim, eps, tp)
            self.k_norm = HeadNorm(make, f"{name}.k_norm", self.head_dim, eps, tp)
        elif cfg.qk_norm:
            self.q_norm = HeadsNorm(make, f"{name}.q_norm", cfg.attention_width, eps, tp)
            self.k_norm = HeadsNorm(make, f"{name}.k_norm", kv_heads * self.head_dim, eps, tp)
        self.rotary = rotary
        self.window = window
        # The kernels scale the scores by 1/sqrt(head_dim): another scale (Granite's) is applied to q.
        self.query_scale = 1.0
        if cfg.attention_multiplier is not None:
            self.query_scale = cfg.attention_multiplier * math.sqrt(self.head_dim)
        self.cp = parallel.cp
        self.output_split_dim = self.o_proj.output_split_dim

    def _positioned(self, x: torch.Tensor, positions: int | torch.Tensor) -> torch.Tensor:
        return x if self.rotary is None else self.rotary(x, positions)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, placement: TokenPlacement | None = None
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        b, s, _ = qkv.shape  # the whole sequence, also when x is a sequence shard
        qkv = qkv.view(b, s, self.local_kv_heads, self.group_size + 2, self.head_dim)
        q = qkv[:, :, :, :-2].reshape(b, s, -1, self.head_dim).transpose(1, 2)
        k = qkv[:, :, :, -2].transpose(1, 2)
        v = qkv[:, :, :, -1].transpose(1, 2)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        if placement is not None:  # a cp rank's part of the sequences, or documents (or both)
            q = self._positioned(q, placement.positions)
            k = self._positioned(k, placement.positions)
            out = ring_attention(q, k, v, placement, self.cp, self.window)
        else:
            start = cache.length if cache is not None else 0
            q = self._positioned(q, start)
            k = self._positioned(k, start)
            if cache is not None:
                k, v = cache.extend(self, k, v)
            # Against a cache the new position sees all the earlier ones (one at a time after the first).
            out = causal_attention(q, k, v, causal=start == 0, window=self.window)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(
        self, make: ParamFactory, name: str, hidden: int, inner: int, out_std: float, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            make, f"{name}.gate_up_proj", hidden, inner, make.std, tp, parts=2
        )
        self.down_proj = RowParallelLinear(make, f"{name}.down_proj", inner, hidden, out_std, tp)
        self.output_split_dim = self.down_proj.output_split_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        make: ParamFactory,
        index: int,
        cfg: LlamaConfig,
        rotary: Rotary,
        parallel: Parallel,
        stats: RouterStats | None,
    ) -> None:
        super().__init__()
        name = f"layers.{index}"
        tp = parallel.tp
        # Residual-output projections are scaled down by depth so the residual stream's variance
        # does not grow with the number of layers (GPT-2 / Megatron init).
        out_std = make.std / math.sqrt(2 * cfg.num_hidden_layers)
        hidden = cfg.hidden_size
        eps = cfg.rms_norm_eps
        # The norms by their Hugging Face names: before each block, input_layernorm before attention and
        # post_attention_layernorm before the MLP (Llama); after (OLMo2), post_attention_layernorm on the
        # attention's output and post_feedforward_layernorm on the MLP's.
        self.norms_after = cfg.norm_placement == "after"
        if not self.norms_after:
            self.input_layernorm = RMSNorm(make, f"{name}.input_layernorm", hidden, eps, tp)
        self.post_attention_layernorm = RMSNorm(make, f"{name}.post_attention_layernorm", hidden, eps, tp)
        if self.norms_after:
            self.post_feedforward_layernorm = RMSNorm(
                make, f"{name}.post_feedforward_layernorm", hidden, eps, tp
            )
        layer_rotary = None if index in cfg.no_rope_layers else rotary
        window = cfg.sliding_window if cfg.windowed(index) else None
        self.self_attn = Attention(make, f"{name}.self_attn", cfg, out_std, layer_rotary, parallel, window)
        if not cfg.has_experts(index):
            self.mlp = MLP(make, f"{name}.mlp", hidden, cfg.intermediate_size, out_std, tp)
        else:
            inner = cfg.moe.num_shared_experts * cfg.moe.intermediate_size
            shared_mlp = MLP(make, f"{name}.mlp.shared_expert", hidden, inner, out_std, tp) if inner else None
            self.mlp = MoE(make, f"{name}.mlp", index, cfg, out_std, parallel, stats, shared_mlp)
        self.output_split_dim = self.mlp.output_split_dim
        self.residual_multiplier = cfg.residual_multiplier

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, placement: TokenPlacement | None = None
    ) -> torch.Tensor:
        if self.norms_after:
            x = x + self._scaled(self.post_attention_layernorm(self.self_attn(x, cache, placement)))
            return x + self._scaled(self.post_feedforward_layernorm(self.mlp(x)))
        x = x + self._scaled(self.self_attn(self.input_layernorm(x), cache, placement))
        return x + self._scaled(self.mlp(self.post_attention_layernorm(x)))

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        return branch if self.residual_multiplier == 1.0 else branch * self.residual_multiplier


class DecoderLayers(nn.ModuleDict):
    """A stage's decoder layers, keyed by their index in the whole model: parameter names (so init,
    checkpoints, HF conversion) are the same in every pipeline layout."""

    def __getitem__(self, index: int | str) -> nn.Module:
        return super().__getitem__(str(index))


class Llama(nn.Module):
    """The model, or this rank's part of it: one pipeline stage (layers, with the embedding on the first
    stage, the final norm and LM head on the last), split over tp; every tp rank gets the same results.

    `recompute_layer`: while gradients are enabled each decoder layer keeps only its input and runs its
    forward again in backward (one (batch, sequence, hidden) tensor per layer instead of its intermediates,
    for about one more forward pass); the replay, tp collectives included, is bit-identical.
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        *,
        std: float,
        seed: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel | None = None,
        cp: ContextParallel | None = None,
        ep: ExpertParallel | None = None,
        stage: Stage | None = None,
        recompute_layer: bool = False,
        router_stats: RouterStats | None = None,
        param_device: torch.device | None = None,
    ) -> None:
        """Args:
        cfg: the model config.
        std: the init std of the weights (model.init_method.std).
        seed: the init seed; a parameter's values depend on it and its name only, whatever the layout.
        dtype: the parameters' dtype.
        device: where the buffers (rotary tables, router statistics) are made.
        tp: the tensor-parallel group (None: one process).
        cp: the context-parallel group (None: one process).
        ep: the expert-parallel group (None: one process).
        stage: the layers, embedding and head this chunk holds (None: the whole model).
        recompute_layer: recompute each decoder layer's forward in its backward.
        router_stats: what the MoE layers routed, shared by a rank's chunks (None: made here if MoE).
        param_device: where the parameters are made (default `device`); on the meta device ZeRO-3's
            ModelState (parallel/model_state.py) draws their values later, a bucket at a time.
        """
        super().__init__()
        self.cfg = cfg
        self.recompute_layer = recompute_layer
        single = Parallel.single()
        self.parallel = Parallel(tp=tp or single.tp, cp=cp or single.cp, ep=ep or single.ep)
        self.tp = tp = self.parallel.tp
        whole = Stage(index=0, layers=range(cfg.num_hidden_layers), embedding=True, head=True, cost=0.0)
        self.stage = stage = stage or whole
        make = ParamFactory(std, seed, dtype, param_device or device)
        self.rotary = Rotary(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, device=device
        )
        hidden = cfg.hidden_size
        vocab = cfg.vocab_size
        tied = cfg.tie_word_embeddings
        if stage.embedding or (stage.head and tied):
            # A tied LM head on a later stage holds its own copy of the embedding (same name, same
            # init); the trainer sums the two copies' gradients so they stay equal.
            tie = "embed_tokens.weight" if tied else None
            self.embed_tokens = VocabParallelEmbedding(make, "embed_tokens", vocab, hidden, std, tp, tie)
        # One per rank, shared by its model chunks (the trainer reads it after each step).
        self.router_stats = router_stats or (RouterStats(cfg, device) if cfg.moe else None)
        layers = {
            str(i): DecoderLayer(make, i, cfg, self.rotary, self.parallel, self.router_stats)
            for i in stage.layers
        }
        self.layers = DecoderLayers(layers)
        if stage.head:
            self.norm = RMSNorm(make, "norm", hidden, cfg.rms_norm_eps, tp)
            if not tied:
                self.lm_head = ColumnParallelLinear(make, "lm_head", hidden, vocab, std, tp, pad=True)
        self.vocab_start = tp.rank * shard_size(cfg.vocab_size, tp.size)

    @property
    def padded_vocab_size(self) -> int:
        return shard_size(self.cfg.vocab_size, self.tp.size) * self.tp.size

    def hidden_states(
        self, inputs: torch.Tensor, cache: KVCache | None = None, placement: TokenPlacement | None = None
    ) -> torch.Tensor:
        x = inputs
        if self.stage.embedding:
            x = self.embed_tokens(inputs)
            if self.cfg.embedding_multiplier != 1.0:
                x = x * self.cfg.embedding_multiplier
        recompute = self.recompute_layer and torch.is_grad_enabled()
        for layer in self.layers.values():
            # Non-reentrant checkpoint: backward runs through the ordinary autograd graph (the
            # recomputed tensors stand in for the dropped ones), so gradients, gradient hooks and
            # the pipeline's backward from a stage's output work as without it.
            if recompute:
                x = checkpoint(layer, x, None, placement, use_reentrant=False, context_fn=self._replay)
            else:
                x = layer(x, cache, placement)
        if cache is not None:
            cache.length += inputs.shape[1]
        return x

    def _replay(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """Contexts of a recomputed layer's first forward and of its replay: the replay records no routing."""
        replay = self.router_stats.replay() if self.router_stats else contextlib.nullcontext()
        return contextlib.nullcontext(), replay

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for this rank's vocabulary shard [vocab_start, vocab_start + padded_vocab / tp)."""
        x = self.norm(x)
        if self.cfg.tie_word_embeddings:
            logits = linear(enter_column_parallel(x, self.tp), self.embed_tokens.weight)
        else:
            logits = self.lm_head(x)
        return logits if self.cfg.logits_scaling == 1.0 else logits / self.cfg.logits_scaling

    def run_stage(
        self, inputs: torch.Tensor, targets: torch.Tensor, placement: TokenPlacement | None = None
    ) -> torch.Tensor:
        """The stage's input (token ids on the first stage, else activations) to its output: activations, or
        on the last stage the summed loss over valid targets (fp32), which the trainer divides by the global
        batch's token count, so every micro-batch / dp / cp / pp split gives the same loss."""
        x = self.hidden_states(inputs, placement=placement)
        return self.head_loss(x, targets) if self.stage.head else x

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(
            self.head_logits(x),
            targets,
            vocab_start=self.vocab_start,
            vocab_size=self.cfg.vocab_size,
            ignore_index=IGNORE_INDEX,
            tp=self.tp,
            z_loss_coef=self.cfg.logits_z_loss_coef,
        )

    def logits(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Full-vocabulary logits of the whole model (gathered over tp: evaluation, generation). With `cache`,
        `input_ids` continue its positions (all at first, then one by one) and it keeps their keys/values."""
        logits = gather_full(self.head_logits(self.hidden_states(input_ids, cache)), -1, self.tp)
        return logits[..., : self.cfg.vocab_size]

    def forward(
        self, input_ids: torch.Tensor, targets: torch.Tensor, placement: TokenPlacement | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole model: summed loss over valid targets (fp32) and how many there were."""
        return self.run_stage(input_ids, targets, placement), (targets != IGNORE_INDEX).sum()
