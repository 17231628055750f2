import pytest
import torch

from femtotron.precision import grouped_linear


def grouped_by_rows(x, weight, ends):
    """The definition: row r times the weight of the group whose range [ends[g - 1], ends[g]) holds r."""
    groups = torch.searchsorted(ends, torch.arange(x.shape[0]), right=True)
    return torch.stack([weight[group] @ row for row, group in zip(x, groups.tolist(), strict=True)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_per_group", [(0, 5, 0, 3, 4), (7, 0, 0, 0, 2), (1, 1, 1, 1, 1)])
def test_the_loop_over_groups_takes_each_group_s_own_rows(rows_per_group, dtype):
    """Widths that are not a multiple of 16 bytes (62 fp32 columns, 31 bf16 ones) take grouped_linear's
    loop, not torch's grouped GEMM; every aligned test shape elsewhere runs the kernel. Empty experts
    included: their weights get exact-zero gradients."""
    torch.manual_seed(0)
    columns = 62 if dtype == torch.float32 else 31
    ends = torch.tensor(rows_per_group).cumsum(0)
    x = torch.randn(int(ends[-1]), columns, dtype=dtype, requires_grad=True)
    weight = torch.randn(len(rows_per_group), 48, columns, dtype=dtype, requires_grad=True)
    out = grouped_linear(x, weight, ends)
    x_reference = x.detach().float().requires_grad_()
    weight_reference = weight.detach().float().requires_grad_()
    reference = grouped_by_rows(x_reference, weight_reference, ends)
    upstream = torch.randn_like(reference)
    (out.float() * upstream).sum().backward()
    (reference * upstream).sum().backward()
    # fp32: sums of 62 products in another order; bf16: one rounding of each output to 8 bits of mantissa.
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 2**-7 * 8}
    torch.testing.assert_close(out.float(), reference, **tolerance)
    torch.testing.assert_close(x.grad.float(), x_reference.grad, **tolerance)
    torch.testing.assert_close(weight.grad.float(), weight_reference.grad, **tolerance)
    for group, rows in enumerate(rows_per_group):
        if rows == 0:
            assert torch.equal(weight.grad[group], torch.zeros_like(weight.grad[group]))
