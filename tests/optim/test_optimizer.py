import pytest
import torch

from femtotron.config import load_config_dict
from femtotron.optim.optimizer import MixedPrecisionAdamW

LR, WEIGHT_DECAY, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8
STEP_LRS = [1e-2, 5e-3, 2e-3]


def optimizer_section(**settings):
    config = load_config_dict({
        "tokens": {"train_steps": 10},
        "optimizer": {
            "weight_decay": WEIGHT_DECAY,
            "learning_rate_scheduler": {"learning_rate": LR},
            "optimizer_factory": {"adam_beta1": BETAS[0], "adam_beta2": BETAS[1], "adam_eps": EPS},
            **settings,
        },
        "data": {"dataset_folder": "unused"},
    })
    return config.optimizer


def make_params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """A linear layer's weight (2-D, decayed), its bias and a norm scale (1-D, not decayed)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(6, 5), (6,), (5,)]
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape in shapes]


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
    ours = MixedPrecisionAdamW(params, optimizer_section(optimizer_factory={
        "adam_beta1": BETAS[0], "adam_beta2": BETAS[1], "adam_eps": EPS, "torch_adam_is_fused": fused}))
    assert all(master is param for master, param in zip(ours.masters, params, strict=True))
    torch_adamw = torch.optim.AdamW(
        [{"params": reference[:1], "weight_decay": WEIGHT_DECAY}, {"params": reference[1:], "weight_decay": 0.0}],
        lr=LR, betas=BETAS, eps=EPS, fused=fused or None,
    )
    for step, lr in enumerate(STEP_LRS):
        loss_of(params, step).backward()
        loss_of(reference, step).backward()
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
    ours = MixedPrecisionAdamW(params, optimizer_section())
    torch_adamw = torch.optim.AdamW(decay_all, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    loss_of(params, 0).backward()
    loss_of(decay_all, 0).backward()
    ours.step(LR)
    torch_adamw.step()
    torch.testing.assert_close(params[0], decay_all[0], rtol=0, atol=1e-6)
    for param, other in zip(params[1:], decay_all[1:], strict=True):
        assert (param - other).abs().max() > 1e-6


def test_bf16_grads_accumulate_in_fp32_masters_and_params_follow_the_masters():
    params = make_params(torch.bfloat16)
    optimizer = MixedPrecisionAdamW(params, optimizer_section())
    for param, master in zip(params, optimizer.masters, strict=True):
        assert master is not param and master.dtype == torch.float32
        assert torch.equal(master, param.float())

    expected = [torch.zeros_like(m) for m in optimizer.masters]
    for micro_batch in range(4):
        step_grads = bf16_grads(params, micro_batch)
        assert all(grad.dtype == torch.bfloat16 for grad in step_grads)
        for total, grad in zip(expected, step_grads, strict=True):
            total.add_(grad.float())
        loss_of(params, micro_batch).backward()
        assert all(param.grad is None for param in params)  # the hook freed every bf16 grad

    # The fp32 sums are not bf16 numbers, so a bf16 accumulation could not have produced them.
    assert any(not torch.equal(total, total.bfloat16().float()) for total in expected)
    grads = optimizer.grads()
    assert len(grads) == len(params)
    for grad, master, total in zip(grads, optimizer.masters, expected, strict=True):
        assert grad is master.grad and grad.dtype == torch.float32
        torch.testing.assert_close(grad, total, rtol=1e-6, atol=1e-6)

    reference = [m.detach().clone().requires_grad_() for m in optimizer.masters]
    for ref, total in zip(reference, expected, strict=True):
        ref.grad = total.clone()
    torch_adamw = torch.optim.AdamW(
        [{"params": reference[:1], "weight_decay": WEIGHT_DECAY}, {"params": reference[1:], "weight_decay": 0.0}],
        lr=LR, betas=BETAS, eps=EPS,
    )
    before = [m.detach().clone() for m in optimizer.masters]
    optimizer.step(LR)
    torch_adamw.step()
    for param, master, ref, start in zip(params, optimizer.masters, reference, before, strict=True):
        assert not torch.equal(master, start)
        torch.testing.assert_close(master, ref, rtol=0, atol=1e-6)
        assert param.dtype == torch.bfloat16
        assert torch.equal(param, master.detach().bfloat16())


def test_bf16_without_fp32_accumulation_still_hands_out_fp32_grads():
    params = make_params(torch.bfloat16)
    optimizer = MixedPrecisionAdamW(params, optimizer_section(accumulate_grad_in_fp32=False))
    for micro_batch in range(2):
        loss_of(params, micro_batch).backward()
    accumulated = [param.grad.clone() for param in params]
    assert all(grad.dtype == torch.bfloat16 for grad in accumulated)  # accumulated by autograd, in bf16

    grads = optimizer.grads()
    assert len(grads) == len(params)
    for grad, master, param, bf16_sum in zip(grads, optimizer.masters, params, accumulated, strict=True):
        assert grad is master.grad and grad.dtype == torch.float32
        assert torch.equal(grad, bf16_sum.float())
        assert param.grad is None
    optimizer.step(LR)
    for param, master in zip(params, optimizer.masters, strict=True):
        assert torch.equal(param, master.detach().bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_grad_clears_every_gradient(dtype):
    params = make_params(dtype)
    optimizer = MixedPrecisionAdamW(params, optimizer_section())
    loss_of(params, 0).backward()
    assert len(optimizer.grads()) == len(params)
    optimizer.zero_grad()
    assert all(p.grad is None for p in params) and all(m.grad is None for m in optimizer.masters)
    # A parameter without a gradient still gets one (zeros), so every rank's list has the same shapes.
    assert [g.abs().sum().item() for g in optimizer.grads()] == [0.0] * len(params)
    optimizer.zero_grad()
    loss_of(params, 1).backward()  # the next step starts from zero, not from the old sums
    for grad, fresh in zip(optimizer.grads(), bf16_grads(params, 1), strict=True):
        torch.testing.assert_close(grad, fresh.float(), rtol=1e-6, atol=1e-6)
