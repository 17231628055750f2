import pytest
import torch
from distributed import run_ranks
from helpers import full_masters

from femtotron.config import load_config_dict
from femtotron.config.zero_stages import ZERO_STAGES
from femtotron.errors import FemtotronError
from femtotron.optim.zero import ZeroOptimizer
from femtotron.parallel.comm import Comm, Group
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.data_parallel import DataParallel
from femtotron.parallel.flat_layout import Replicas

LR = 1e-2
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
EPS = 1e-8
STEP_LRS = [1e-2, 5e-3, 2e-3]


def optimizer_section(**settings):
    config = load_config_dict(
        {
            "tokens": {"train_steps": 10},
            "optimizer": {
                "weight_decay": WEIGHT_DECAY,
                "learning_rate_scheduler": {"learning_rate": LR},
                "optimizer_factory": {"adam_beta1": BETAS[0], "adam_beta2": BETAS[1], "adam_eps": EPS},
                **settings,
            },
            "data": {"dataset_folder": "unused"},
        }
    )
    return config.optimizer


def make_params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """A linear layer's weight (2-D, decayed), its bias and a norm scale (1-D, not decayed)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(6, 5), (6,), (5,)]
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape in shapes]


def single_process_optimizer(params, section, micro_batches=1):
    """The optimizer of one rank without data parallelism, over `params` in one bucket."""
    grad_dtype = torch.float32 if section.accumulate_grad_in_fp32 else params[0].dtype
    data_parallel = DataParallel.build(
        [(f"p{i}", p) for i, p in enumerate(params)],
        [list(range(len(params)))],
        Comm(),
        Replicas(Group("dp", (0,)), 0),
        micro_batches=micro_batches,
        bucket_mb=25,
        grad_dtype=grad_dtype,
        zero=ZERO_STAGES[0],
    )
    return ZeroOptimizer(params, data_parallel, section)


def loss_of(params, seed: int) -> torch.Tensor:
    weight, bias, scale = params
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(100 + seed)).to(weight.dtype)
    return ((x * scale) @ weight.T + bias).float().pow(2).sum()


def bf16_grads(params, seed: int) -> list[torch.Tensor]:
    """The bf16 gradients one backward pass produces, computed on a detached copy of `params`."""
    copies = [p.detach().clone().requires_grad_() for p in params]
    return list(torch.autograd.grad(loss_of(copies, seed), copies))


@pytest.mark.parametrize("fused", [False, True])
def test_fp32_matches_torch_adamw_with_decay_on_matrices_only(fused):
    params = make_params(torch.float32)
    reference = [p.detach().clone().requires_grad_() for p in params]
    ours = single_process_optimizer(
        params,
        optimizer_section(
            optimizer_factory={
                "adam_beta1": BETAS[0],
                "adam_beta2": BETAS[1],
                "adam_eps": EPS,
                "torch_adam_is_fused": fused,
            }
        ),
    )
    # fp32: the master weights are the parameters' own storage, not a copy.
    assert all(m.untyped_storage().data_ptr() == params[0].untyped_storage().data_ptr() for m in ours.masters)
    torch_adamw = torch.optim.AdamW(
        [
            {"params": reference[:1], "weight_decay": WEIGHT_DECAY},
            {"params": reference[1:], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        fused=fused or None,
    )
    for step, lr in enumerate(STEP_LRS):
        loss_of(params, step).backward()
        loss_of(reference, step).backward()
        ours.data_parallel.finish_reduction()
        ours.step(lr)
        for group in torch_adamw.param_groups:
            group["lr"] = lr
        torch_adamw.step()
        ours.zero_grad()
        torch_adamw.zero_grad()
    initial = make_params(torch.float32)
    for param, expected, start in zip(params, reference, initial, strict=True):
        assert not torch.allclose(param, start, atol=1e-3)  # every parameter really moved
        torch.testing.assert_close(param, expected, rtol=0, atol=1e-6)


def test_fp32_decaying_every_tensor_would_be_caught():
    """The comparison above is sharp enough to see weight decay on the 1-D tensors."""
    params = make_params(torch.float32)
    decay_all = [p.detach().clone().requires_grad_() for p in params]
    ours = single_process_optimizer(params, optimizer_section())
    torch_adamw = torch.optim.AdamW(decay_all, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    loss_of(params, 0).backward()
    loss_of(decay_all, 0).backward()
    ours.step(LR)
    torch_adamw.step()
    torch.testing.assert_close(params[0], decay_all[0], rtol=0, atol=1e-6)
    for param, other in zip(params[1:], decay_all[1:], strict=True):
        assert (param - other).abs().max() > 1e-6


@pytest.mark.parametrize(
    ("exclude", "decayed"), [([], [0, 1, 2]), (["p2", "p9"], [0, 1]), ([r"p[01]$"], [2])]
)
def test_named_exclusions_decay_every_other_tensor_as_nanotron_does(exclude, decayed):
    """optimizer.weight_decay_exclude_named_params: every tensor decayed (1-D ones too) but the names a
    pattern matches; against torch's AdamW with those groups."""
    params = make_params(torch.float32)
    reference = [p.detach().clone().requires_grad_() for p in params]
    ours = single_process_optimizer(params, optimizer_section(weight_decay_exclude_named_params=exclude))
    groups = [
        {"params": [p for i, p in enumerate(reference) if (i in decayed) == want], "weight_decay": decay}
        for want, decay in ((True, WEIGHT_DECAY), (False, 0.0))
    ]
    torch_adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=LR, betas=BETAS, eps=EPS)
    loss_of(params, 0).backward()
    loss_of(reference, 0).backward()
    ours.data_parallel.finish_reduction()
    ours.step(LR)
    torch_adamw.step()
    for param, expected in zip(params, reference, strict=True):
        torch.testing.assert_close(param, expected, rtol=0, atol=1e-6)


def test_bf16_grads_accumulate_in_fp32_masters_and_params_follow_the_masters():
    params = make_params(torch.bfloat16)
    optimizer = single_process_optimizer(params, optimizer_section(), micro_batches=4)
    for param, master in zip(params, full_masters(optimizer), strict=True):
        assert master.dtype == torch.float32 and torch.equal(master, param.float())

    expected = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    for micro_batch in range(4):
        step_grads = bf16_grads(params, micro_batch)
        assert all(grad.dtype == torch.bfloat16 for grad in step_grads)
        for total, grad in zip(expected, step_grads, strict=True):
            total.add_(grad.float())
        loss_of(params, micro_batch).backward()
        assert all(param.grad is None for param in params)  # the hook freed every bf16 grad

    # The fp32 sums are not bf16 numbers, so a bf16 accumulation could not have produced them.
    assert any(not torch.equal(total, total.bfloat16().float()) for total in expected)
    optimizer.data_parallel.finish_reduction()
    grads = optimizer.data_parallel.state.full(optimizer.grads())  # per parameter, whole
    for grad, total in zip(grads, expected, strict=True):
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad, total, rtol=1e-6, atol=1e-6)

    reference = [m.detach().clone().requires_grad_() for m in full_masters(optimizer)]
    for ref, total in zip(reference, expected, strict=True):
        ref.grad = total.clone()
    torch_adamw = torch.optim.AdamW(
        [
            {"params": reference[:1], "weight_decay": WEIGHT_DECAY},
            {"params": reference[1:], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=BETAS,
        eps=EPS,
    )
    before = full_masters(optimizer)
    optimizer.step(LR)
    torch_adamw.step()
    for param, master, ref, start in zip(params, full_masters(optimizer), reference, before, strict=True):
        assert not torch.equal(master, start)
        torch.testing.assert_close(master, ref, rtol=0, atol=1e-6)
        assert param.dtype == torch.bfloat16
        assert torch.equal(param, master.detach().bfloat16())


def test_bf16_without_fp32_accumulation_still_hands_out_fp32_grads():
    params = make_params(torch.bfloat16)
    optimizer = single_process_optimizer(
        params, optimizer_section(accumulate_grad_in_fp32=False), micro_batches=2
    )
    assert optimizer.data_parallel.state.flat_grads.dtype == torch.bfloat16
    expected = [torch.zeros_like(p) for p in params]
    for micro_batch in range(2):
        for total, grad in zip(expected, bf16_grads(params, micro_batch), strict=True):
            total.add_(grad)  # the same bf16 additions the buffer makes
        loss_of(params, micro_batch).backward()
    optimizer.data_parallel.finish_reduction()
    grads = optimizer.grads()
    assert all(grad.dtype == torch.float32 for grad in grads) and all(p.grad is None for p in params)
    assert torch.equal(torch.cat(grads), torch.cat([e.flatten() for e in expected]).float())
    optimizer.step(LR)
    for param, master in zip(params, full_masters(optimizer), strict=True):
        assert torch.equal(param, master.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_grad_clears_every_gradient(dtype):
    params = make_params(dtype)
    optimizer = single_process_optimizer(params, optimizer_section())
    loss_of(params, 0).backward()
    assert optimizer.data_parallel.state.flat_grads.any()
    optimizer.zero_grad()
    assert all(p.grad is None for p in params) and all(m.grad is None for m in optimizer.masters)
    assert not optimizer.data_parallel.state.flat_grads.any()
    loss_of(params, 1).backward()  # the next step starts from zero, not from the old sums
    whole = optimizer.data_parallel.state.full(optimizer.data_parallel.state.owned_grads())
    for grad, fresh in zip(whole, bf16_grads(params, 1), strict=True):
        torch.testing.assert_close(grad, fresh.float(), rtol=1e-6, atol=1e-6)


def test_a_gradient_after_the_last_micro_batch_is_an_error_not_a_silent_loss():
    params = make_params(torch.float32)
    single_process_optimizer(params, optimizer_section(), micro_batches=1)  # its hooks keep it alive
    loss_of(params, 0).backward()
    with pytest.raises(FemtotronError, match=r"p\d received 2 gradients in one step.*zero_grad"):
        loss_of(params, 1).backward()


def _decay_only_step(rank, dp):
    """A step with zero gradients moves a parameter only by weight decay: p <- p (1 - lr * weight_decay)."""
    ctx = ParallelContext(dp=dp, collective_timeout_seconds=60)
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(20, 12), (20,), (12,)]]
    initial = [p.detach().clone() for p in params]
    data_parallel = DataParallel.build(
        [(f"p{i}", p) for i, p in enumerate(params)],
        [[2, 1, 0]],
        ctx.comm,
        Replicas(ctx.dp_group, ctx.dp_rank),
        micro_batches=1,
        bucket_mb=25,
        grad_dtype=torch.float32,
        zero=ZERO_STAGES[1],
    )
    optimizer = ZeroOptimizer(params, data_parallel, optimizer_section(zero_stage=1))
    owned = {piece.param for piece in data_parallel.layout.pieces}
    data_parallel.finish_reduction()
    optimizer.step(LR)
    ctx.close()
    return owned, initial, [p.detach().clone() for p in params]


@pytest.mark.distributed
@pytest.mark.parametrize("dp", [1, 2])
def test_zero1_decays_matrices_and_not_one_dimensional_weights_on_every_shard(dp):
    """ZeRO-1 steps 1-D views of each rank's pieces: the decay mask must come from the parameters' shapes. At
    dp=2 the matrix is cut between the ranks, and rank 0 owns the 1-D tensors beside its part."""
    results = run_ranks(_decay_only_step, dp, dp) if dp > 1 else [_decay_only_step(0, 1)]
    if dp == 2:
        assert results[0][0] == {0, 1, 2} and results[1][0] == {0}  # the matrix is split between the ranks
    for _, (matrix, bias, scale), (new_matrix, new_bias, new_scale) in results:
        torch.testing.assert_close(new_matrix, matrix * (1 - LR * WEIGHT_DECAY), rtol=1e-6, atol=0)
        assert torch.equal(new_bias, bias) and torch.equal(new_scale, scale)
