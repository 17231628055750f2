"""Muon: momentum orthogonalised by Newton-Schulz, for the decoder layers' weight matrices.

Muon (Jordan et al., 2024) replaces a matrix's update by the orthogonal factor of its momentum: for
M = U S V^T it steps along U V^T, every direction of the update at the same size. Liu et al. ("Muon is
Scalable for LLM Training", Moonshot AI, 2025) train with it at scale at about twice AdamW's compute
efficiency. Per matrix W with gradient G (summed over dp, clipped with the rest):

    M <- beta M + G                                 momentum (optimizer_factory.muon_momentum)
    N <- G + beta M  (Nesterov), else M              (muon_nesterov)
    O <- NewtonSchulz(N)                             ~ U V^T, muon_ns_steps iterations
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(rows, cols)) O

as Liu et al. write it (Algorithm 1). The momentum is a sum, not an average as Adam's first moment: the scale
drops out in Newton-Schulz's normalisation but for its guard against a zero norm, which an average 1 / (1 -
beta) times smaller meets sooner. The factor 0.2 sqrt(max(rows, cols)) is Liu et al.'s (section 2.2): it
gives the update the RMS of a typical AdamW update (0.2-0.4), so AdamW's learning rate and weight decay
carry over; `muon_learning_rate` and `muon_weight_decay` set others.

Which parameters: every weight of the decoder layers with two or more dimensions except the MoE routers
(`orthogonalised`). Embeddings, the LM head, norms, biases and routers take AdamW, as in both papers. A fused
weight holds several matrices and each is orthogonalised alone (the orthogonal factor of [A; B] is not
those of A and B): leading dimensions index separate matrices (an MLP's gate|up, a layer's experts), and
attention's q|k|v rows interleave per key/value head (ShardInfo.fused_rows).

Distributed (Liu et al.'s "Distributed Muon", with an owner per matrix): Newton-Schulz needs a whole
matrix, which ZeRO shards over dp and tp splits. Each rank keeps the momentum of the elements it owns (as
Adam's moments under ZeRO), forms N there and all-gathers N over its replicas a bucket at a time (in
Newton-Schulz's dtype, as ZeRO gathers the parameters). One replica per matrix computes it (with its tp
peers, which all-gather their pieces of it): the replica holding all of the matrix, else the least loaded
so far, the same choice on every replica. It writes the update over N, the others zero there, and a
reduce-scatter of the bucket (an all-reduce without ZeRO) gives every replica the update of its own
elements: a matrix larger than a bucket costs Newton-Schulz once, not once per replica, for the
reduce-scatter's bytes. A bucket whose every matrix lies in one replica's shard is computed there and not
exchanged. Buckets are gathered `ahead` (replicas - 1, at most AHEAD_AT_MOST) ahead and their updates
applied as many behind, so the owners of that many consecutive buckets compute at once (collectives run in
order: a replica cannot gather past an exchange still waiting for its owner): up to 2 x ahead + 1 buckets in
Newton-Schulz's dtype at once, during the optimizer step, when the activations are gone. Bytes received
per step: (replicas - 1) / replicas x the elements of the buckets holding Muon's matrices x the
Newton-Schulz dtype's size, twice for the exchanged buckets (the reduce-scatter; without ZeRO only the
all-reduce, 2 (replicas - 1) / replicas), plus (tp - 1) x the local elements of the tp-split matrices this
rank computes.
"""

from __future__ import annotations

import math
from collections import Counter, deque

import torch

from femtotron.parallel.model_state import ModelState
from femtotron.parallel.sharding import split_dim
from femtotron.parallel.tensor_parallel import TensorParallel, gather_full
from femtotron.precision import emulated_low_precision

# Jordan et al.'s quintic iteration x <- a x + b (x x^T) x + c (x x^T)^2 x: its coefficients push every
# singular value into about [0.7, 1.2] in a few steps, rather than slowly to exactly 1 (no worse for
# training, and stable in bf16).
COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# 2-D weights of a decoder layer that stay on AdamW: the MoE router and the shared experts' gate, whose
# rows score experts rather than transform the hidden state.
ROUTERS = (".router.weight", ".shared_expert_gate.weight")
MOMENTUM = "momentum"  # its state's name in checkpoints
# The most buckets gathered ahead of the one being computed: as many owners plus one compute at once, and
# each bucket in flight holds its N whole: at large dp this bounds that memory (2 x AHEAD_AT_MOST + 1).
AHEAD_AT_MOST = 3


def orthogonalised(name: str, param: torch.Tensor) -> bool:
    """Whether Muon steps this parameter: a weight matrix of a decoder layer, other than a router."""
    return name.startswith("layers.") and param.dim() >= 2 and not name.endswith(ROUTERS)


def newton_schulz_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """bf16 models orthogonalise in bf16 (Jordan et al.'s choice: the iteration is stable there), others in
    fp32."""
    return torch.bfloat16 if param_dtype == torch.bfloat16 else torch.float32


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if emulated_low_precision(a):  # bf16 inputs, fp32 products, rounded back: a GPU's tensor cores
        return (a.float() @ b.float()).to(a.dtype)
    return a @ b


def newton_schulz(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The orthogonal factor U V^T of update = U S V^T, approximately (batched over leading dimensions),
    computed and returned in `dtype`."""
    a, b, c = COEFFICIENTS
    x = update.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # iterate on the smaller of the two Gram matrices
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # singular values <= 1: where the iteration works
    for _ in range(steps):
        gram = _matmul(x, x.mT)
        x = a * x + _matmul(b * gram + c * _matmul(gram, gram), x)
    if tall:
        x = x.mT
    return x


def matrices(whole: torch.Tensor, fused_rows: tuple[int, ...] | None) -> list[torch.Tensor]:
    """The separate matrices of a weight (whole over tp), each batched over its leading dimensions."""
    if fused_rows is None:
        return [whole]
    blocks = whole.unflatten(-2, (-1, sum(fused_rows))).split(list(fused_rows), dim=-2)
    return [block.flatten(-3, -2) for block in blocks]


def fused(parts: list[torch.Tensor], fused_rows: tuple[int, ...] | None) -> torch.Tensor:
    """The weight `matrices` took apart, from its parts."""
    if fused_rows is None:
        return parts[0]
    blocks = [part.unflatten(-2, (-1, rows)) for part, rows in zip(parts, fused_rows, strict=True)]
    return torch.cat(blocks, dim=-2).flatten(-3, -2)


def orthogonal_update(
    whole: torch.Tensor, fused_rows: tuple[int, ...] | None, steps: int, dtype: torch.dtype
) -> torch.Tensor:
    """Each matrix's Newton-Schulz result times 0.2 sqrt(max(rows, cols)), in the weight's layout."""
    parts = [
        newton_schulz(matrix, steps, dtype).mul_(0.2 * math.sqrt(max(matrix.shape[-2:])))
        for matrix in matrices(whole, fused_rows)
    ]
    return fused(parts, fused_rows)


class Muon:
    """Muon's momentum and step for one rank's orthogonalised parameters, over the pieces it owns
    (FlatLayout.pieces); optim/zero.py steps the other pieces with AdamW."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        state: ModelState,
        tp: TensorParallel,
        factory,
    ) -> None:
        """`state`: the model state whose owned pieces it steps; `factory`: the optimizer_factory config
        section."""
        self.state = state
        self.layout = state.layout
        self.tp = tp
        self.beta = factory.muon_momentum
        self.nesterov = factory.muon_nesterov
        self.ns_steps = factory.muon_ns_steps
        self.dtype = newton_schulz_dtype(state.param_dtype)
        self.shards = [getattr(p, "shard", None) for p in params]
        # Which parameters Muon steps: marked once, where the buffers are laid out (layout.py)
        self.orthogonalised = self.layout.orthogonalised
        pieces = self.layout.pieces
        # Indices into the owned pieces (FlatLayout.pieces) of the orthogonalised parameters.
        self.piece_indices = [i for i, piece in enumerate(pieces) if self.orthogonalised[piece.param]]
        self.momentum = {
            i: torch.zeros(pieces[i].end - pieces[i].start, device=state.device) for i in self.piece_indices
        }
        bucket_of = self.layout.bucket_of
        # Every bucket holding a Muon matrix, with this rank's pieces of them (none: it still gathers)
        self.pieces_of_bucket = {
            b: [i for i in self.piece_indices if bucket_of[pieces[i].param] == b]
            for b, bucket in enumerate(self.layout.buckets)
            if any(self.orthogonalised[p] for p in bucket.params)
        }
        self.computes: set[int] = set()  # the Muon matrices this rank computes (its replica owns them)
        self.exchanged: set[int] = set()  # the buckets whose updates are summed over their replicas
        self.ahead = 1  # buckets gathered ahead, and applied behind: the replicas' count - 1, capped
        self._choose_owners()

    def _choose_owners(self) -> None:
        """A matrix within one replica's shard is computed there; else by the replica least loaded so far
        (rows x cols x min(rows, cols): Newton-Schulz's work), the same on every replica: their layouts are
        alike."""
        layout = self.layout
        load: Counter[int] = Counter()
        for b in self.pieces_of_bucket:
            bucket = layout.buckets[b]
            replicas = layout.replicas[b]
            share = (bucket.end - bucket.start) // replicas.size
            self.ahead = max(self.ahead, min(replicas.size - 1, AHEAD_AT_MOST))
            for param in bucket.params:
                if not self.orthogonalised[param]:
                    continue
                shape = layout.shapes[param]
                owner = (layout.offsets[param] - bucket.start) // share  # the shard of its first element
                if (
                    not layout.sharded
                    or owner != (layout.offsets[param] + shape.numel() - 1 - bucket.start) // share
                ):
                    owner = min(range(replicas.size), key=load.__getitem__)
                    self.exchanged.add(b)
                load[owner] += shape.numel() * min(shape[-2:])
                if owner == replicas.rank:
                    self.computes.add(param)

    def step(
        self, masters: list[torch.Tensor], grads: list[torch.Tensor], lr: float, decay: list[float]
    ) -> None:
        """Update the owned pieces' `masters` from their `grads` (per owned piece, as optim/zero.py keeps
        them); `decay`: per owned piece, its weight decay."""
        buckets = list(self.pieces_of_bucket)
        gathers = deque(self._start_gather(b, grads) for b in buckets[: self.ahead])
        exchanges = deque()
        for position, bucket in enumerate(buckets):
            if position + self.ahead < len(buckets):
                gathers.append(self._start_gather(buckets[position + self.ahead], grads))
            whole, work = gathers.popleft()
            self.state.wait_bucket_gather(bucket, work, whole)
            self._orthogonalise(bucket, whole)
            work = self.state.start_bucket_sum(bucket, whole) if bucket in self.exchanged else None
            exchanges.append((bucket, whole, work))
            if len(exchanges) > self.ahead:
                self._apply(*exchanges.popleft(), masters, lr, decay)
        for exchange in exchanges:
            self._apply(*exchange, masters, lr, decay)

    def _start_gather(self, bucket: int, grads: list[torch.Tensor]):
        """Bucket `bucket`'s N: this rank's pieces' momentum stepped and N written in place (a piece at a
        time: no second copy of the momentum), every replica's gathered (started)."""
        start = self.layout.buckets[bucket].start
        whole = torch.zeros(
            self.layout.buckets[bucket].end - start, dtype=self.dtype, device=self.state.device
        )
        for i in self.pieces_of_bucket[bucket]:
            piece = self.layout.pieces[i]
            momentum = self.momentum[i].mul_(self.beta).add_(grads[i])
            to_orthogonalise = grads[i].add(momentum, alpha=self.beta) if self.nesterov else momentum
            whole[piece.start - start : piece.end - start] = to_orthogonalise
        return whole, self.state.start_bucket_gather(bucket, whole)

    def _orthogonalise(self, bucket: int, whole: torch.Tensor) -> None:
        """Overwrite each matrix's N in `whole` (the bucket's, gathered) by its update where this replica
        computes it, by zeros elsewhere (an exchange then sums the owner's alone)."""
        layout = self.layout
        start = layout.buckets[bucket].start
        for param in layout.buckets[bucket].params:
            if not self.orthogonalised[param]:
                continue
            offset = layout.offsets[param] - start
            local = whole[offset : offset + layout.shapes[param].numel()]
            if param in self.computes:
                local.copy_(self._local_update(param, local.view(layout.shapes[param])))
            else:
                local.zero_()

    def _apply(
        self,
        bucket: int,
        whole: torch.Tensor,
        work,
        masters: list[torch.Tensor],
        lr: float,
        decay: list[float],
    ) -> None:
        """Step this rank's pieces of the bucket's matrices from their updates in `whole` (once `work` is
        done)."""
        self.state.wait_bucket_gather(bucket, work, whole)
        start = self.layout.buckets[bucket].start
        for i in self.pieces_of_bucket[bucket]:
            piece = self.layout.pieces[i]
            masters[i].mul_(1 - lr * decay[i])
            masters[i].sub_(whole[piece.start - start : piece.end - start], alpha=lr)

    def _local_update(self, param: int, local: torch.Tensor) -> torch.Tensor:
        """This rank's part of the parameter's update (flat, in Newton-Schulz's dtype), from its part of N."""
        shard = self.shards[param]
        dim = split_dim(shard)
        whole = gather_full(local, dim, self.tp)
        update = orthogonal_update(whole, shard.fused_rows, self.ns_steps, self.dtype)
        if dim is not None and self.tp.size > 1:
            size = local.shape[dim]
            update = update.narrow(dim, self.tp.rank * size, size)
        return update.reshape(-1)

    def bytes_per_step(self) -> dict[str, int]:
        """Bytes this rank receives per step for Newton-Schulz's whole matrices: over its replicas (the
        buckets holding Muon's matrices gathered, the exchanged ones summed back) and over tp."""
        layout = self.layout
        itemsize = self.dtype.itemsize
        replicas = 0
        for bucket in self.pieces_of_bucket:
            size = layout.replicas[bucket].size
            others = (layout.buckets[bucket].end - layout.buckets[bucket].start) * (size - 1) // size
            # a gather, and the reduce-scatter of an exchanged bucket; without ZeRO the all-reduce only, of
            # every bucket (exchanged), counting twice
            replicas += others * (1 + (bucket in self.exchanged)) * itemsize
        tp = sum(
            layout.shapes[p].numel() * (self.tp.size - 1) * itemsize
            for p in self.computes
            if split_dim(self.shards[p]) is not None
        )
        return {"replicas": replicas, "tp": tp}
