"""Stage partition: contiguous, every stage a layer, embedding first, head last, the slowest stage minimal."""

from __future__ import annotations

import itertools
import re

import pytest

from femtotron.config import LlamaConfig, load_config_dict
from femtotron.config.rules import rule_problems
from femtotron.diagnostics.advice import imbalance_warning
from femtotron.parallel.pipeline.partition import partition, stage_map


def model(layers: int, vocab: int = 256, hidden: int = 64) -> LlamaConfig:
    return LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=4 * hidden,
        vocab_size=vocab,
    )


def config(layers: int, vocab: int, pp: int, *overrides: str):
    return load_config_dict(
        {
            "model": {"model_config": model(layers, vocab).model_dump()},
            "tokens": {"train_steps": 10, "sequence_length": 128, "batch_accumulation_per_replica": 8},
            "parallelism": {"pp": pp},
            "data": {"dataset_folder": "unused"},
        },
        overrides=overrides,
    )


def brute_force_best(cfg, seq: int, stages: int) -> float:
    """The smallest possible slowest-stage cost, by trying every split."""
    n = cfg.num_hidden_layers
    layer = cfg.layer_flops(seq)
    head = cfg.head_flops
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        costs = [(b - a) * layer + (head if b == n else 0) for a, b in itertools.pairwise(bounds)]
        best = min(best, max(costs))
    return best


@pytest.mark.parametrize(
    "layers, stages, vocab",
    [
        (4, 2, 256),
        (5, 2, 256),
        (5, 4, 256),
        (9, 8, 256),
        (7, 3, 32000),
        (12, 4, 128000),
        (32, 4, 32000),
        (6, 6, 2048),
    ],
)
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
    small = partition(model(8, 256), 128, 2)
    large = partition(model(8, 128000), 128, 2)
    assert len(small[0].layers) == len(small[1].layers) == 4
    assert len(large[0].layers) > len(large[1].layers)


def test_M3_stage_map_names_every_stage_and_warns_on_imbalance():
    text = stage_map(partition(model(4), 128, 4), 2)
    assert "stage 0 (pp rank 0, chunk 0): embedding + layer 0" in text
    assert "stage 3 (pp rank 1, chunk 1): layer 3 + final norm + LM head" in text
    warning = imbalance_warning(config(4, 8192, 2), partition(model(4, 8192), 128, 2))
    assert (
        warning is not None
        and "pipeline stage 1 (layer 3 + final norm + LM head) makes its pp rank compute" in warning
    )
    assert "num_hidden_layers=7 (room for the LM head on the last stage)" in warning
    hopeless = imbalance_warning(config(8, 128000, 2), partition(model(8, 128000), 128, 2))
    assert "The final norm + LM head alone cost 117.6 layers' worth: fewer pipeline stages" in hopeless
    assert imbalance_warning(config(8, 64, 2), partition(model(8, 64), 128, 2)) is None


@pytest.mark.parametrize("layers, vocab, pp", [(2, 8192, 2), (3, 2048, 3), (4, 8192, 2), (12, 32000, 3)])
def test_M3_every_fix_the_imbalance_warning_suggests_is_accepted_by_the_rules_and_balances_better(
    layers, vocab, pp
):
    """No advice in a circle: a 2-layer model at pp=2 cannot interleave (it needs pp * 2 layers), so the
    warning suggests the layer count that balances instead; whatever it suggests passes the config rules."""
    base = config(layers, vocab, pp)
    stages = partition(base.model.model_config_, 128, pp)
    warning = imbalance_warning(base, stages)
    assert warning is not None
    fixes = re.findall(
        r"(parallelism\.pp_engine=\S+ with pp_virtual_stages=\d+|model\.model_config\.num_hidden_layers=\d+)",
        warning,
    )
    assert fixes, warning
    worst = max(s.cost for s in stages) * len(stages) / sum(s.cost for s in stages)
    for fix in fixes:
        overrides = fix.replace(" with pp_virtual_stages=", " parallelism.pp_virtual_stages=").split()
        fixed = config(layers, vocab, pp, *overrides)  # raises on any broken rule
        assert not rule_problems(fixed)
        par = fixed.parallelism
        after = partition(fixed.model.model_config_, 128, par.pp * par.pp_virtual_stages)
        assert max(s.cost for s in after) * len(after) / sum(s.cost for s in after) < worst, fix
    if layers < 2 * pp:
        assert "interleaved" not in warning


def test_stage_parameters_add_up_to_the_model():
    cfg = model(7, 32000)
    assert sum(s.parameters for s in partition(cfg, 128, 3)) == cfg.parameter_count


def dynamic_programme(cfg, seq: int, stages: int) -> list[range]:
    """The exact dynamic programme over (stages, layers) partition() used before bisection, as reference."""
    n = cfg.num_hidden_layers
    layer = cfg.layer_flops(seq)
    head = cfg.head_flops
    best = [[float("inf")] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                candidate = max(best[k - 1][j], (i - j) * layer + (head if i == n else 0.0))
                if candidate < best[k][i]:
                    best[k][i] = candidate
                    cut[k][i] = j
    bounds = []
    i = n
    for k in range(stages, 0, -1):
        bounds.append(range(cut[k][i], i))
        i = cut[k][i]
    return bounds[::-1]


@pytest.mark.parametrize("vocab", [8, 256, 32000, 128000, 10**9])
def test_E5_bisection_gives_the_dynamic_programmes_stages(vocab):
    """The same layout as before, so checkpoints and runs keep their stages; with a head of 1e9 tokens'
    vocabulary the head's cost absorbs a layer's in floating point (ties broken alike)."""
    for layers in range(1, 25):
        cfg = model(layers, vocab)
        for stages in range(1, min(layers, 9) + 1):
            found = [s.layers for s in partition(cfg, 128, stages)]
            assert found == dynamic_programme(cfg, 128, stages), (layers, stages)


def test_E5_1024_layers_over_8_stages_as_the_dynamic_programme():
    cfg = model(1024, 32000)
    assert [s.layers for s in partition(cfg, 128, 8)] == dynamic_programme(cfg, 128, 8)


def test_E5_a_billion_layers_need_no_table_per_layer():
    cfg = model(10**9, 32000)
    stages = partition(cfg, 128, 8)
    starts = [s.layers.start for s in stages]
    assert starts[0] == 0 and [s.layers.stop for s in stages] == [*starts[1:], 10**9]
    total = sum(s.cost for s in stages)
    assert max(s.cost for s in stages) < total / 8 + cfg.layer_flops(128)  # within a layer of perfect
