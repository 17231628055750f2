"""Expert parallelism: each layer's experts split over the ep ranks, tokens sent to their experts' ranks.

The ep ranks are `ep` consecutive ranks of those holding the same dense weights (dp x cp), each holding
num_experts / ep experts; the ranks at the same place in the other ep groups (`edp`) hold the same experts,
and an expert's gradient is summed (and ZeRO-1 sharded) over them. A layer exchanges the rows' counts per
expert (all-to-all), then the rows (all-to-all of variable sizes), and sends the experts' outputs back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from femtotron.parallel.comm import GroupMember


@dataclass(frozen=True)
class ExpertParallel(GroupMember):
    KIND = "ep"

    def run(
        self,
        rows: torch.Tensor,
        counts: torch.Tensor,
        experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """`experts(rows, counts)` on the rank holding each expert: `rows` sorted by expert, `counts` rows per
        expert of the whole layer; returns the outputs in the order of `rows`."""
        if self.size == 1:
            return experts(rows, counts)
        local = len(counts) // self.size
        # received[j, e]: the rows rank j sends for this rank's expert e (on the meta device, where routing is
        # taken as balanced: what this rank sends)
        sent = counts.view(self.size, local)
        if rows.is_meta:
            received = sent
        else:
            ones = [1] * self.size  # one row of counts to every rank
            received = self.comm.all_to_all(sent, self.group, sent_rows=ones, received_rows=ones)
        # The layer's one host read: NCCL takes the split sizes as lists, both read at once.
        sent_rows, received_rows = torch.stack([sent.sum(1), received.sum(1)]).tolist()
        arrived = _exchange(rows, self, sent=sent_rows, received=received_rows)
        # Arrived by (source rank, expert); the experts want them by (expert, source rank).
        place = torch.arange(self.size * local, device=rows.device).view(local, self.size).T.flatten()
        row_place = place.repeat_interleave(received.flatten(), output_size=sum(received_rows))
        order = torch.argsort(row_place, stable=True)
        outputs = experts(arrived[order], received.sum(0))
        # Back where each row came from: the sizes swap.
        by_source = outputs[order.argsort()]
        return _exchange(by_source, self, sent=received_rows, received=sent_rows)


class _AllToAll(torch.autograd.Function):
    """Rows to their ranks; the gradient goes back the same way with the split sizes swapped."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, ep: ExpertParallel, sent: list[int], received: list[int]):
        ctx.ep = ep
        ctx.sent = sent
        ctx.received = received
        return ep.comm.all_to_all(rows, ep.group, sent_rows=sent, received_rows=received)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm = ctx.ep.comm
        grad_rows = comm.all_to_all(grad, ctx.ep.group, sent_rows=ctx.received, received_rows=ctx.sent)
        return grad_rows, None, None, None


# model.compile: the exchange's sizes depend on the routing, so it runs between compiled graphs.
@torch.compiler.disable
def _exchange(rows: torch.Tensor, ep: ExpertParallel, sent: list[int], received: list[int]) -> torch.Tensor:
    return _AllToAll.apply(rows, ep, sent, received)
