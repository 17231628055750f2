"""Context parallelism (every sequence split over cp ranks, attention as a ring) and document masking.

Zigzag split: a sequence is cut into 2 * cp chunks, and cp rank i holds chunks i and 2cp-1-i. Under the
causal mask an early chunk sees few keys and a late one many, so pairing them gives every rank the same
work. RoPE uses the global positions, so that the model computes exactly what one device would.

Ring attention: each rank's keys and values go round the ring, one step per cp rank. Only the KV heads
travel, so grouped-query attention sends its fewer heads. At each step a rank attends its queries to the
block it holds while the next block is already on its way, which hides the transfer behind the compute.
Against the zigzag the blocks are simple: its own block is causal; a block from a lower cp rank is seen
whole by both local chunks, through its first chunk only; one from a higher rank is seen whole by the
second local chunk only. Block results merge by their log-sum-exp, in fp32, so that the merged output is
the softmax over all keys at once. The backward pass sends the keys and values round again, each with its
gradient accumulated so far (fp32); after the last step every rank holds the whole gradient of its own
keys and values.

Document masking (`model.document_masking`): a token attends only to the tokens of its own document in the
packed sample (documents end at the end-of-document token), and RoPE positions restart at each document.
The same ring computes it, each block masked by document. A block where no query sees any key is skipped,
which on long packed sequences of short documents skips most of them.

A sliding window (`model_config.sliding_window`): a query sees only the keys fewer than the window's size
before it. A block wholly outside every query's window is skipped, one wholly inside is computed without a
mask.

The kernel for each block is attention.py's `attention_with_lse`: the CPU's flash kernel; on GPUs flash for
the mask-free blocks and memory-efficient attention for the masked ones; written out in fp32 where neither
applies. Each returns the log-sum-exp the merge needs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from femtotron.attention import Documents, Window, attention_with_lse, attention_with_lse_backward
from femtotron.batch import MicroBatch, TokenPlacement
from femtotron.parallel.comm import Group, GroupMember, Work
from femtotron.precision import attention_dtype


@dataclass(frozen=True)
class ContextParallel(GroupMember):
    """This rank's cp ring: its group, its place, one-way groups to the next and from the previous rank."""

    KIND = "cp"
    links: tuple[Group, Group] | None = None

    def start_shift(self, tensor: torch.Tensor, tag: int) -> tuple[torch.Tensor, Work | None, Work | None]:
        """Start sending `tensor` to the following rank, receiving the preceding rank's into a new buffer."""
        if self.links is None:
            return tensor, None, None
        outgoing, incoming = self.links
        received = torch.empty_like(tensor)
        recv = self.comm.start_p2p("recv", received, incoming.ranks[0], incoming, tag)
        send = self.comm.start_p2p("send", tensor.contiguous(), outgoing.ranks[1], outgoing, tag)
        return received, recv, send

    def finish_shift(self, shift: tuple[torch.Tensor, Work | None, Work | None]) -> torch.Tensor:
        received, recv, _ = shift
        if recv is not None:
            incoming = self.links[1]
            self.comm.wait(recv, incoming, received, incoming.ranks[0], kind="recv")
        return received

    def finish_sends(self, shifts: list[tuple[torch.Tensor, Work | None, Work | None]]) -> None:
        # The record names the received buffer: what was sent had its shape and dtype.
        for received, _, send in shifts:
            if send is not None:
                self.comm.wait(send, self.links[0], received, self.links[0].ranks[1], kind="send")


def zigzag_indices(length: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions in the whole sequence of the tokens cp rank `rank` holds: chunks rank and 2cp-1-rank."""
    if cp == 1:
        return torch.arange(length, device=device)
    chunk = length // (2 * cp)
    starts = (rank * chunk, (2 * cp - 1 - rank) * chunk)
    return torch.cat([torch.arange(start, start + chunk, device=device) for start in starts])


def documents_of(inputs: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(document index, position within the document) of every token of (batch, sequence) `inputs`: a
    document ends with its end-of-document token, the next one starts after it."""
    ends = inputs == eos_id
    documents = torch.cumsum(ends, dim=1) - ends.long()
    index = torch.arange(inputs.shape[1]).expand_as(inputs)
    starts = torch.ones_like(ends)
    starts[:, 1:] = ends[:, :-1]
    first = torch.where(starts, index, 0).cummax(dim=1).values
    return documents, index - first


def place_tokens(batch: MicroBatch, cp: int, cp_rank: int, eos_id: int | None) -> MicroBatch:
    """This cp rank's part of a micro-batch of whole sequences, with its `TokenPlacement` (`eos_id`: document
    masking). Unchanged when there is nothing to place (cp = 1, no masking)."""
    if cp == 1 and eos_id is None:
        return batch
    length = batch.inputs.shape[1]
    local = zigzag_indices(length, cp, cp_rank)
    if eos_id is None:
        positions = local.expand(batch.inputs.shape[0], -1)
        documents = None
        visible = (True,) * cp
    else:
        whole, within = documents_of(batch.inputs, eos_id)
        positions = within[:, local]
        documents = torch.stack([whole[:, zigzag_indices(length, cp, rank)] for rank in range(cp)])
        visible = tuple(_sees_any_key(cp_rank, source, documents) for source in range(cp))
    placement = TokenPlacement(positions=positions.contiguous(), documents=documents, visible=visible)
    return replace(batch, inputs=batch.inputs[:, local], targets=batch.targets[:, local], placement=placement)


def _sees_any_key(rank: int, source: int, documents: torch.Tensor) -> bool:
    """Whether a query of cp rank `rank` shares a document with a key of `source`'s block (`documents` as in
    `TokenPlacement`): its own block always (every token sees itself). In another's every key precedes every
    query, and document ids only grow along the sequence, so the only document a key and a query can share
    is the last key's, if it is the first query's: one comparison per sample."""
    if source == rank:
        return True
    block = _block_of(rank, source, documents.shape[-1], documents)
    queries, keys = block.documents
    return bool((queries[:, 0] == keys[:, -1]).any())


@dataclass(frozen=True, kw_only=True)
class Block:
    """Which local queries (rows) see which keys of another cp rank's block (columns), whether causally,
    under document masking the documents of those queries and keys (attention.Documents), and the sliding
    window where it hides some of the keys from some query. Both are in sequence order, as a rank's two
    chunks are. `in_window`: some query has some key in its window."""

    rows: slice
    cols: slice
    causal: bool
    documents: Documents | None
    window: Window | None = None
    in_window: bool = True


def _block_of(
    rank: int,
    source: int,
    local_length: int,
    documents: torch.Tensor | None,
    *,
    window: int | None = None,
    cp_size: int = 1,
    device: torch.device | None = None,
) -> Block:
    """The block of `source`'s keys for `rank`'s queries (`window`: the sliding window's size)."""
    chunk = local_length // 2
    if source == rank:
        rows = slice(None)
        cols = slice(None)
    elif source < rank:  # its first chunk precedes both of ours, its second follows both
        rows = slice(None)
        cols = slice(0, chunk)
    else:  # both its chunks precede our second and follow our first
        rows = slice(chunk, None)
        cols = slice(None)
    seen = None if documents is None else (documents[rank][:, rows], documents[source][:, cols])
    block = Block(rows=rows, cols=cols, causal=source == rank, documents=seen)
    if window is None:
        return block
    length = local_length * cp_size
    # On the host: the two checks read values, which a meta device (doctor's) has not, and a GPU would sync.
    query_index = zigzag_indices(length, cp_size, rank, None)[rows]
    key_index = zigzag_indices(length, cp_size, source, None)[cols]
    # Indices grow along a block, and every key of another rank's block precedes every query.
    in_window = bool(query_index[0] - key_index[-1] < window)
    needs_mask = bool(query_index[-1] - key_index[0] >= window)
    sliding = Window(query_index.to(device), key_index.to(device), window) if needs_mask else None
    return replace(block, window=sliding, in_window=in_window)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, placement: TokenPlacement, cp: ContextParallel, window: int | None
    ) -> torch.Tensor:
        ctx.dtype = q.dtype
        dtype = attention_dtype(q)
        q = q.to(dtype)
        k = k.to(dtype)
        v = v.to(dtype)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])  # one transfer per step for both
        shifts = []
        for step, source in enumerate(_sources(cp)):
            if step < cp.size - 1:
                shifts.append(cp.start_shift(kv, step))
            block = _ring_block(cp, source, q, placement, window)
            if placement.visible[source] and block.in_window:
                block_out, block_lse = attention_with_lse(
                    q[:, :, block.rows],
                    kv[0][:, :, block.cols],
                    kv[1][:, :, block.cols],
                    causal=block.causal,
                    documents=block.documents,
                    window=block.window,
                )
                _merge(out[:, :, block.rows], lse[:, :, block.rows], block_out, block_lse)
            if step < cp.size - 1:
                kv = cp.finish_shift(shifts[-1])
        cp.finish_sends(shifts)
        out = out.to(dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.placement = placement
        ctx.cp = cp
        ctx.window = window
        return out.to(ctx.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        cp = ctx.cp
        placement = ctx.placement
        grad_out = grad_out.to(q.dtype)
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        shifts = []
        grads_in = None
        for step, source in enumerate(_sources(cp)):
            if step < cp.size - 1:
                shifts.append(cp.start_shift(kv, 2 * step))
            grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            block = _ring_block(cp, source, q, placement, ctx.window)
            if placement.visible[source] and block.in_window:
                rows = block.rows
                cols = block.cols
                dq, dk, dv = attention_with_lse_backward(
                    grad_out=grad_out[:, :, rows],
                    q=q[:, :, rows],
                    k=kv[0][:, :, cols],
                    v=kv[1][:, :, cols],
                    out=out[:, :, rows],
                    lse=lse[:, :, rows],
                    causal=block.causal,
                    documents=block.documents,
                    window=block.window,
                )
                grad_q[:, :, rows] += dq
                grad_kv[0][:, :, cols] += dk
                grad_kv[1][:, :, cols] += dv
            if grads_in is not None:  # what the ranks before added to this block's gradient
                grad_kv += cp.finish_shift(grads_in)
            # After the last step this sends each block's gradient home, to the rank that holds the block.
            grads_in = cp.start_shift(grad_kv, 2 * step + 1)
            shifts.append(grads_in)
            if step < cp.size - 1:
                kv = cp.finish_shift(shifts[-2])
        grad_kv = cp.finish_shift(grads_in)
        cp.finish_sends(shifts)
        return grad_q.to(ctx.dtype), grad_kv[0].to(ctx.dtype), grad_kv[1].to(ctx.dtype), None, None, None


def _ring_block(
    cp: ContextParallel, source: int, q: torch.Tensor, placement: TokenPlacement, window: int | None
) -> Block:
    return _block_of(
        cp.rank, source, q.shape[2], placement.documents, window=window, cp_size=cp.size, device=q.device
    )


def _sources(cp: ContextParallel) -> list[int]:
    """Whose keys and values this rank holds at each ring step: its own, then the preceding rank's, ..."""
    return [(cp.rank - step) % cp.size for step in range(cp.size)]


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's softmax-normalised output into the running one (views, updated in place)."""
    total = torch.logaddexp(lse, block_lse)
    safe = total.masked_fill(total == float("-inf"), 0)  # no key seen yet in either: weights 0, not NaN
    out.mul_((lse - safe).exp()[..., None]).add_(block_out.float() * (block_lse - safe).exp()[..., None])
    lse.copy_(total)


@torch.compiler.disable  # model.compile: the ring's transfers end the layer's compiled graphs, as tp's do
def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    placement: TokenPlacement,
    cp: ContextParallel,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries to the keys and values of the whole sequence (document-masked
    when `placement.documents`, each query seeing the `window` latest keys when set); q: (batch, heads, local
    sequence, head_dim), k and v with the KV heads."""
    return _RingAttention.apply(q, k, v, placement, cp, window)
