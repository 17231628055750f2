"""What one micro-batch is, as every room sees it: the data loader makes it, context parallelism splits it,
the model and the trainer consume it. It lives below all of them, so none has to import another for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100  # a target that does not count in the loss (a masked position)


@dataclass
class TokenPlacement:
    """Where a micro-batch's local tokens sit: what attention needs beyond the tokens themselves."""

    positions: torch.Tensor  # (batch, local sequence): RoPE positions
    # Masking: (cp, batch, local sequence), the document of each token that each cp rank holds (here the
    # queries are [cp rank], a block from cp rank r has the keys [r]).
    documents: torch.Tensor | None
    visible: tuple[bool, ...]  # per cp rank: whether any query here sees any of its keys

    def to(self, device: torch.device) -> TokenPlacement:
        documents = None if self.documents is None else self.documents.to(device)
        return TokenPlacement(positions=self.positions.to(device), documents=documents, visible=self.visible)


@dataclass
class MicroBatch:
    """Token ids and targets (the next ids; IGNORE_INDEX: not counted), (micro_batch_size, sequence_length),
    or this cp rank's part with where its tokens sit (`placement`, context_parallel.py; None: whole)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    placement: TokenPlacement | None = None

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor) -> MicroBatch:
        """From (batch, sequence + 1) samples: every position predicts the next token."""
        return cls(inputs=tokens[:, :-1], targets=tokens[:, 1:])

    def to(self, device: torch.device) -> MicroBatch:
        """To CUDA through pinned memory: a copy from pageable memory waits for the work queued on the GPU,
        one from pinned memory is queued behind it (reading it on the host, `int()`, waits for it)."""
        placement = None if self.placement is None else self.placement.to(device)
        if device.type != "cuda":
            return MicroBatch(
                inputs=self.inputs.to(device), targets=self.targets.to(device), placement=placement
            )
        inputs = self.inputs.pin_memory().to(device, non_blocking=True)
        targets = self.targets.pin_memory().to(device, non_blocking=True)
        return MicroBatch(inputs=inputs, targets=targets, placement=placement)

    @property
    def counted_targets(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())
