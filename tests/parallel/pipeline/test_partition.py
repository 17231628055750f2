"""Stage partition: contiguous, every stage a layer, embedding first, head last, the slowest stage minimal."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from femtotron.parallel.pipeline.partition import head_flops, layer_flops, partition, stage_map


def model(layers: int, vocab: int = 256, hidden: int = 64) -> SimpleNamespace:
    return SimpleNamespace(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=4 * hidden, vocab_size=vocab)


def brute_force_best(cfg, seq: int, stages: int) -> float:
    """The smallest possible slowest-stage cost, by trying every split."""
    n, layer, head = cfg.num_hidden_layers, layer_flops(cfg, seq), head_flops(cfg)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        costs = [(b - a) * layer + (head if b == n else 0) for a, b in itertools.pairwise(bounds)]
        best = min(best, max(costs))
    return best


@pytest.mark.parametrize("layers, stages, vocab", [(4, 2, 256), (5, 2, 256), (5, 4, 256), (9, 8, 256), (7, 3, 32000),
                                                   (12, 4, 128000), (32, 4, 32000), (6, 6, 2048)])
def test_partition_is_contiguous_complete_and_optimal(layers, stages, vocab):
    cfg = model(layers, vocab)
    result = partition(cfg, 128, stages)
    assert [s.index for s in result] == list(range(stages))
    assert [i for s in result for i in s.layers] == list(range(layers))  # contiguous, each layer once
    assert all(len(s.layers) >= 1 for s in result)  # every stage owns parameters
    assert [s.embedding for s in result] == [True] + [False] * (stages - 1)
    assert [s.head for s in result] == [False] * (stages - 1) + [True]
    assert max(s.cost for s in result) == pytest.approx(brute_force_best(cfg, 128, stages))


def test_M3_a_large_vocabulary_moves_layers_off_the_last_stage():
    small, large = partition(model(8, 256), 128, 2), partition(model(8, 128000), 128, 2)
    assert len(small[0].layers) == len(small[1].layers) == 4
    assert len(large[0].layers) > len(large[1].layers)


def test_M3_stage_map_names_every_stage_and_warns_on_imbalance():
    text, warning = stage_map(partition(model(4), 128, 4), 2)
    assert "stage 0 (pp rank 0, chunk 0): embedding + layer 0" in text
    assert "stage 3 (pp rank 1, chunk 1): layer 3 + final norm + LM head" in text
    assert warning is None or "pipeline stage 3" in warning
    _, warning = stage_map(partition(model(3, 128000), 128, 3), 3)
    assert warning is not None and "costs" in warning and "interleaved-1f1b" in warning
    _, balanced = stage_map(partition(model(8, 64), 128, 2), 2)
    assert balanced is None


def test_stage_parameters_add_up_to_the_model():
    from femtotron.config import parameter_count

    cfg = model(7, 32000)
    cfg.tie_word_embeddings = False
    assert sum(s.parameters for s in partition(cfg, 128, 3)) == parameter_count(cfg)
