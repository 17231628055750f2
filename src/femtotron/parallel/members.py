"""What a layer needs of the mesh: this rank's member of each group the layers compute over.

Tensor parallelism splits the weights, context parallelism the sequence, expert parallelism the experts.
A layer takes the record whole, by name, so that no one has to remember an order.
"""

from __future__ import annotations

from dataclasses import dataclass

from femtotron.parallel.context_parallel import ContextParallel
from femtotron.parallel.expert_parallel import ExpertParallel
from femtotron.parallel.tensor_parallel import TensorParallel


@dataclass(frozen=True, kw_only=True)
class Parallel:
    tp: TensorParallel
    cp: ContextParallel
    ep: ExpertParallel

    @classmethod
    def single(cls) -> Parallel:
        """One process on every dimension: each group is this rank alone."""
        return cls(tp=TensorParallel.single(), cp=ContextParallel.single(), ep=ExpertParallel.single())
