import pytest
import torch
from distributed import run_ranks

from femtotron.optim.clip import clip_grads_, global_grad_norm
from femtotron.parallel.context import ParallelContext


@pytest.fixture(scope="module")
def ctx() -> ParallelContext:
    return ParallelContext()


def random_grads(seed: int = 0, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(shape, generator=g) for shape in [(16, 8), (8,), (3, 5, 7), (1,)]]


def params_with(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.zeros_like(grad)) for grad in grads]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    return params


@pytest.mark.parametrize("max_norm", [0.5, 3.0])
def test_matches_torch_clip_grad_norm(ctx, max_norm):
    grads = random_grads()
    reference = params_with(grads)
    expected_norm = torch.nn.utils.clip_grad_norm_(reference, max_norm)
    assert expected_norm > max_norm  # both cases really clip (the norm of these grads is about 15)

    norm = clip_grads_(grads, max_norm, ctx)
    torch.testing.assert_close(norm, expected_norm, rtol=1e-6, atol=0)
    for grad, param in zip(grads, reference, strict=True):
        torch.testing.assert_close(grad, param.grad, rtol=1e-6, atol=1e-8)
    total = torch.cat([grad.flatten() for grad in grads]).norm()
    assert total.item() == pytest.approx(max_norm, rel=1e-5)


def test_no_max_norm_returns_the_norm_and_leaves_grads_alone(ctx):
    grads = random_grads(seed=1)
    before = [grad.clone() for grad in grads]
    norm = clip_grads_(grads, None, ctx)
    expected = torch.cat([grad.flatten() for grad in before]).double().norm()
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    for grad, original in zip(grads, before, strict=True):
        assert torch.equal(grad, original)


def test_small_grads_are_not_scaled_up(ctx):
    grads = random_grads(seed=2, scale=1e-3)
    before = [grad.clone() for grad in grads]
    norm = clip_grads_(grads, 1.0, ctx)
    assert 0 < norm.item() < 1.0
    for grad, original in zip(grads, before, strict=True):
        assert torch.equal(grad, original)


def test_bf16_grads_are_normed_in_fp32_and_clipped_in_place(ctx):
    grads = [grad.bfloat16() for grad in random_grads(seed=3)]
    expected = torch.cat([grad.float().flatten() for grad in grads]).norm()
    assert global_grad_norm(grads, ctx).dtype == torch.float32
    norm = clip_grads_(grads, 1.0, ctx)
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    assert all(grad.dtype == torch.bfloat16 for grad in grads)
    total = torch.cat([grad.float().flatten() for grad in grads]).norm()
    assert total.item() == pytest.approx(1.0, rel=1e-2)  # bf16 keeps about 3 significant digits


def test_no_grads_give_a_zero_norm(ctx):
    assert clip_grads_([], 1.0, ctx).item() == 0.0


def _norm_on_two_tp_ranks(rank: int):
    """A split matrix (each rank its half) and a norm weight every tp rank holds whole (counted on rank 0)."""
    ctx = ParallelContext(tp=2, collective_timeout_seconds=60)
    full_matrix = torch.arange(24.0).view(4, 6) / 10
    replicated = torch.tensor([3.0, -4.0])
    grads = [full_matrix[2 * rank : 2 * rank + 2].clone(), replicated.clone()]
    norm = global_grad_norm(grads, ctx, counted=[True, rank == 0]).item()
    ctx.close()
    return norm


@pytest.mark.distributed
def test_a_gradient_every_tp_rank_holds_whole_counts_once_in_the_global_norm():
    expected = torch.cat([(torch.arange(24.0) / 10), torch.tensor([3.0, -4.0])]).norm().item()
    assert run_ranks(_norm_on_two_tp_ranks, 2) == pytest.approx([expected, expected], rel=1e-6)
