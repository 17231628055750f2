import numpy as np
import pytest
import torch

from femtotron.batch import MicroBatch
from femtotron.data import nanoset as nanoset_module
from femtotron.data.indexed import IndexedDatasetWriter
from femtotron.data.nanoset import MicroBatchIterator, Nanoset
from femtotron.errors import DataError

L = 8  # sequence length in these tests


def _dataset(path, num_documents, seed, dtype=np.uint16, base=0):
    """Documents of random lengths whose tokens are consecutive numbers, so every window is recognisable."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 3 * L, size=num_documents)
    stream = np.arange(base, base + lengths.sum()) % np.iinfo(dtype).max
    with IndexedDatasetWriter(path, dtype) as writer:
        for document in np.split(stream, np.cumsum(lengths)[:-1]):
            writer.add_document(document)
    return str(path), stream


@pytest.fixture
def one(tmp_path):
    return _dataset(tmp_path / "one", 40, seed=0)


def test_samples_are_overlapping_windows_of_the_stream(one):
    prefix, stream = one
    ns = Nanoset([prefix], None, L, seed=1)
    n = (len(stream) - 1) // L
    assert ns.samples_per_epoch == n and ns.num_tokens == len(stream) and ns.num_documents == 40
    for g in range(2 * n):
        sample = ns[g]
        assert sample.dtype == np.int64 and sample.shape == (L + 1,)
        _, s = ns.locate(g)
        np.testing.assert_array_equal(sample, stream[s * L : s * L + L + 1])


def test_every_sample_once_per_epoch_in_a_new_order(one):
    prefix, _ = one
    ns = Nanoset([prefix], None, L, seed=1)
    n = ns.samples_per_epoch
    first = [ns.locate(g)[1] for g in range(n)]
    second = [ns.locate(g)[1] for g in range(n, 2 * n)]
    assert sorted(first) == sorted(second) == list(range(n))
    assert first != second and first != sorted(first)
    assert ns.epochs_for(n) == pytest.approx(1.0) and ns.epochs_for(3 * n // 2) == pytest.approx(1.5)


def test_order_depends_on_seed_only(one):
    prefix, _ = one
    a, b, c = (Nanoset([prefix], None, L, seed=s) for s in (7, 7, 8))
    samples = [[ns[g].tolist() for g in range(50)] for ns in (a, b, c)]
    assert samples[0] == samples[1] != samples[2]


def _greedy_reference(weights, count):
    """The blending rule as the plain loop it is: the next sample goes to the dataset that lags its weight
    the most, i.e. whose next sample is due first at (served + 1/2) / weight; ties to the lower index."""
    served = np.zeros(len(weights))
    order = []
    for _ in range(count):
        d = int(np.argmin((served + 0.5) / np.asarray(weights)))
        order.append((d, int(served[d])))
        served[d] += 1
    return order


def test_blend_follows_the_greedy_rule_across_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(nanoset_module, "_BLOCK", 64)  # many small blocks exercise the block bookkeeping
    prefixes = [_dataset(tmp_path / f"d{i}", 30, seed=i, base=10_000 * i)[0] for i in range(3)]
    weights = [0.2, 0.3, 0.5]
    ns = Nanoset(prefixes, [2, 3, 5], L, seed=0)  # unnormalised weights are fine
    np.testing.assert_allclose(ns.weights, weights)
    reference = _greedy_reference(ns.weights, 1000)
    blended = [ns._blender.locate(g) for g in range(1000)]
    assert blended == reference
    fresh = Nanoset(prefixes, [2, 3, 5], L, seed=0)  # random access deep into the blend, blocks out of order
    for g in (999, 130, 640, 5):
        assert fresh._blender.locate(g) == reference[g]
    counts = np.zeros(3)
    for g, (d, _) in enumerate(blended, start=1):
        counts[d] += 1
        assert np.all(np.abs(counts - np.asarray(weights) * g) <= 1)


def test_blend_proportions_and_per_dataset_epochs(tmp_path):
    a, stream_a = _dataset(tmp_path / "a", 20, seed=0)
    b, stream_b = _dataset(tmp_path / "b", 60, seed=1, base=30_000)
    ns = Nanoset([a, b], [0.25, 0.75], L, seed=3)
    draws = 4000
    origins = [ns.locate(g) for g in range(draws)]
    share_b = sum(d for d, _ in origins) / draws
    assert share_b == pytest.approx(0.75, abs=0.002)
    n_a, n_b = ns.samples_per_dataset
    from_a = [s for d, s in origins if d == 0]
    assert sorted(from_a[:n_a]) == list(range(n_a))  # dataset a's first epoch is complete and unrepeated
    assert ns.epochs_for(draws) == pytest.approx(max(0.25 * draws / n_a, 0.75 * draws / n_b))
    sizes = Nanoset([a, b], None, L, seed=3)
    np.testing.assert_allclose(sizes.weights, [n_a / (n_a + n_b), n_b / (n_a + n_b)])
    d, s = ns.locate(1)
    stream = (stream_a, stream_b)[d]
    np.testing.assert_array_equal(ns[1], stream[s * L : s * L + L + 1])


def _samples(micro_batch):
    """A micro-batch's (batch, sequence + 1) samples: the inputs and the last target."""
    return torch.cat([micro_batch.inputs, micro_batch.targets[:, -1:]], dim=1)


def _steps(iterator, count, global_batch, consumed=0):
    """`count` steps' samples, from the step after `consumed` samples on."""
    return [[_samples(mb) for mb in iterator.step_at(consumed + k * global_batch)] for k in range(count)]


def test_micro_batches_shape_and_resume(tmp_path):
    prefixes = [_dataset(tmp_path / f"d{i}", 25, seed=i)[0] for i in range(2)]
    ns = Nanoset(prefixes, [1, 1], L, seed=5)
    straight = MicroBatchIterator(ns, micro_batch_size=2, batch_accumulation=3, dp_rank=0, dp_size=1)
    steps = _steps(straight, 6, global_batch=6)  # 36 samples: past one epoch of the smaller dataset
    assert all(mb.dtype == torch.int64 and mb.shape == (2, L + 1) for step in steps for mb in step)

    resumed_ns = Nanoset(prefixes, [1, 1], L, seed=5)  # a new process after a restart
    resumed = MicroBatchIterator(resumed_ns, micro_batch_size=2, batch_accumulation=3, dp_rank=0, dp_size=1)
    for expected, got in zip(steps[2:], _steps(resumed, 4, global_batch=6, consumed=2 * 6), strict=True):
        for a, b in zip(expected, got, strict=True):
            assert torch.equal(a, b)


def test_union_of_a_step_does_not_depend_on_dp(tmp_path):
    prefix, _ = _dataset(tmp_path / "d", 40, seed=0)
    ns = Nanoset([prefix], None, L, seed=2)
    single = MicroBatchIterator(ns, micro_batch_size=2, batch_accumulation=4, dp_rank=0, dp_size=1)
    ranks = [
        MicroBatchIterator(ns, micro_batch_size=2, batch_accumulation=2, dp_rank=r, dp_size=2)
        for r in range(2)
    ]
    for consumed in (0, 8, 16):
        expected = torch.cat([_samples(mb) for mb in single.step_at(consumed)])
        got = torch.cat([_samples(mb) for rank in ranks for mb in rank.step_at(consumed)])
        assert torch.equal(expected, got)


def test_too_little_data_is_explained(tmp_path):
    prefix, _ = _dataset(tmp_path / "tiny", 1, seed=0)
    with pytest.raises(DataError, match=r"tiny: \d+ tokens is too few .* sequence_length \+ 1 = 1001"):
        Nanoset([prefix], None, 1000, seed=0)


def test_bad_weights_and_float_data(tmp_path, one):
    prefix, _ = one
    with pytest.raises(DataError, match="one positive number per dataset"):
        Nanoset([prefix], [0.5, 0.5], L, seed=0)
    with pytest.raises(DataError, match="one positive number per dataset"):
        Nanoset([prefix, prefix], [1, 0], L, seed=0)
    with IndexedDatasetWriter(tmp_path / "f", np.float32) as writer:
        writer.add_document(np.ones(100))
    with pytest.raises(DataError, match=r"f\.bin holds float32 values"):
        Nanoset([str(tmp_path / "f")], None, L, seed=0)


def test_a_micro_batch_predicts_the_next_token_and_step_at_needs_no_state(tmp_path):
    prefix, _ = _dataset(tmp_path / "d", 40, seed=0)
    batches = MicroBatchIterator(
        Nanoset([prefix], None, L, seed=2), micro_batch_size=2, batch_accumulation=2, dp_rank=0, dp_size=1
    )
    later = batches.step_at(8)
    batches.step_at(0)  # asking for another step changes nothing
    for a, b in zip(later, batches.step_at(8), strict=True):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert torch.equal(later[0].inputs[:, 1:], later[0].targets[:, :-1])
    assert later[0].counted_targets == 2 * L


def test_a_micro_batch_moves_to_the_cpu_as_it_is():
    batch = MicroBatch.from_tokens(torch.arange(18).reshape(2, 9))
    moved = batch.to(torch.device("cpu"))
    assert moved.inputs is batch.inputs and moved.targets is batch.targets  # no copy, no pinning


@pytest.mark.cuda
def test_a_micro_batch_moves_to_cuda_through_pinned_memory_and_arrives_whole():
    batch = MicroBatch.from_tokens(torch.arange(2 * 4097).reshape(2, 4097))
    moved = batch.to(torch.device("cuda"))
    assert moved.inputs.is_cuda and not batch.inputs.is_pinned()  # the caller's tensor is left as it was
    assert torch.equal(moved.inputs.cpu(), batch.inputs) and torch.equal(moved.targets.cpu(), batch.targets)
    assert moved.counted_targets == 2 * 4096
