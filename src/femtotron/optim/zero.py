"""AdamW (and Muon) over fp32 master weights, sharded over data-parallel ranks with ZeRO.

With bf16 (or fp16) parameters the optimizer keeps an fp32 master copy of the elements it steps (so small
updates are not rounded away) and Adam's two moments: 12 bytes per parameter. Under ZeRO-1 each rank keeps
them only for the elements it owns in parallel/flat_layout.py (1/dp of every bucket), gets their dp-summed
gradients by reduce-scatter, and all-gathers the new parameters: 2 + 4 + 12/dp bytes per parameter (bf16
weights, fp32 gradients) instead of 2 + 4 + 12. fp32 parameters are their own masters: 4 + 4 + 8/dp.
ZeRO-2 also keeps only the owned shard of the gradients between steps: 2 + (4 + 12)/dp.

With optimizer_factory.name=muon the decoder layers' weight matrices follow Muon (optim/muon.py) with one
fp32 momentum (4 bytes, not Adam's 8) and everything else AdamW, each over the same owned pieces.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from femtotron.optim.muon import MOMENTUM, Muon
from femtotron.parallel.data_parallel import DataParallel
from femtotron.parallel.tensor_parallel import TensorParallel


def decays(name: str, param: torch.Tensor, exclude: list[str] | None) -> bool:
    """Whether AdamW decays a parameter. Without optimizer.weight_decay_exclude_named_params the matrices are
    decayed and the norm scales (1-D) are not; with it, as nanotron, all but those a pattern matches."""
    if exclude is None:
        return param.dim() >= 2
    return not any(re.match(pattern, name) for pattern in exclude)


ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


class ZeroOptimizer:
    def __init__(
        self,
        params: list[nn.Parameter],
        data_parallel: DataParallel,
        cfg: Any,
        tp: TensorParallel | None = None,
    ) -> None:
        """`params` are laid out and held by `data_parallel`'s layout and state, and their gradients reduced
        by it; `cfg` is the `optimizer` config section; `tp` (Muon only): the group its matrices are split
        over (None: one process, nothing split)."""
        self.data_parallel = data_parallel
        self.model_state = data_parallel.state
        self.pieces = data_parallel.layout.pieces
        self.model_pieces = self.model_state.owned_params()
        if self.model_state.param_dtype == torch.float32:
            self.masters = self.model_pieces  # the optimizer updates the model's own storage
        else:
            master_flat = torch.cat(self.model_pieces).float() if self.model_pieces else torch.zeros(0)
            self.masters = list(master_flat.split([piece.end - piece.start for piece in self.pieces]))
        self._grads: list[torch.Tensor] | None = None
        factory = cfg.optimizer_factory
        exclude = cfg.weight_decay_exclude_named_params
        names = data_parallel.layout.names
        decayed = [decays(names[piece.param], params[piece.param], exclude) for piece in self.pieces]
        self.muon = None
        if factory.name == "muon":
            self.muon = Muon(params, self.model_state, tp or TensorParallel.single(), factory)
            muon_weight_decay = factory.muon_weight_decay
            if muon_weight_decay is None:
                muon_weight_decay = cfg.weight_decay
            self.muon_decay_per_piece = [muon_weight_decay if d else 0.0 for d in decayed]
            peak = cfg.learning_rate_scheduler.learning_rate
            self.muon_lr_ratio = (factory.muon_learning_rate or peak) / peak
        stepped_by_muon = set(self.muon.piece_indices if self.muon else [])
        # Adam's pieces: every owned piece that Muon does not step
        self.adam_pieces = [i for i in range(len(self.pieces)) if i not in stepped_by_muon]
        groups = []
        for want in (True, False):
            members = [self.masters[i] for i in self.adam_pieces if decayed[i] == want]
            if members:
                groups.append({"params": members, "weight_decay": cfg.weight_decay if want else 0.0})
        # A rank can own no element at all (ZeRO-1 over many ranks and buckets that are mostly padding): it
        # steps nothing, but still takes part in the all-gather.
        self.adam = None
        if groups:
            self.adam = torch.optim.AdamW(
                groups,
                lr=cfg.learning_rate_scheduler.learning_rate,
                betas=(factory.adam_beta1, factory.adam_beta2),
                eps=factory.adam_eps,
                fused=factory.torch_adam_is_fused or None,
                foreach=None if factory.torch_adam_is_fused else True,
            )
        self.steps = 0  # applied (fp16 steps skipped on overflow are not)

    @property
    def state_kinds(self) -> tuple[str, ...]:
        """What `state` gives besides the master weights: Adam's moments, and Muon's momentum."""
        return (*ADAM_MOMENTS, MOMENTUM) if self.muon else ADAM_MOMENTS

    def grads(self) -> list[torch.Tensor]:
        """The fp32 gradients of the owned pieces, summed over dp (call after `finish_reduction`)."""
        if self._grads is None:
            # .float() of an fp32 gradient is the gradient itself, not a copy
            self._grads = [g.float() for g in self.model_state.owned_grads()]
        return self._grads

    def step(self, lr: float) -> None:
        self.steps += 1
        for group in self.adam.param_groups if self.adam else []:
            group["lr"] = lr
        grads = self.grads()
        for i in self.adam_pieces:
            self.masters[i].grad = grads[i]
        if self.adam is not None:
            self.adam.step()
        with torch.no_grad():
            if self.muon is not None:
                self.muon.step(self.masters, grads, lr * self.muon_lr_ratio, self.muon_decay_per_piece)
            if self.masters is not self.model_pieces and self.masters:
                torch._foreach_copy_(self.model_pieces, self.masters)
        self.model_state.gather_params()

    def zero_grad(self) -> None:
        self.data_parallel.zero_grad()
        self._grads = None
        for master in self.masters:
            master.grad = None

    def state(self, kind: str) -> list[torch.Tensor | None]:
        """Per owned piece, its "master" weights, Adam's "exp_avg" / "exp_avg_sq" or Muon's "momentum" (1-D
        views; zeros before the first step; None for a piece the other optimizer steps)."""
        if kind == "master":
            return self.masters
        if kind == MOMENTUM:
            return [self.muon.momentum.get(i) if self.muon else None for i in range(len(self.pieces))]
        self.prepare_state(self.steps)
        adam = set(self.adam_pieces)
        return [self.adam.state[m][kind] if i in adam else None for i, m in enumerate(self.masters)]

    def prepare_state(self, steps: int) -> None:
        """Give every owned piece Adam state as torch's AdamW would after `steps` steps, keeping moments that
        exist (zeros where none): a loaded checkpoint then fills them in place."""
        self.steps = steps
        for group in self.adam.param_groups if self.adam else []:
            on_device = group["fused"] or group["capturable"]  # torch keeps the step count there, else on CPU
            for master in group["params"]:
                state = self.adam.state[master]
                device = master.device if on_device else "cpu"
                state["step"] = torch.tensor(float(steps), dtype=torch.float32, device=device)
                for kind in ("exp_avg", "exp_avg_sq"):
                    if kind not in state:  # not setdefault: it would allocate zeros on every call
                        state[kind] = torch.zeros_like(master)
