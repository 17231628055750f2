"""The mixture-of-experts layer on one process: the grouped GEMM against a loop over experts (and where GPUs
take it), the router's logits and what backward keeps of them, routing, capacity, that routing reads nothing
back to the host, the router losses' gradients against autograd of the written-out loss, recomputation, the
parameter and FLOP counts, router-collapse warnings, and the router losses' shares over cp ranks.
(Against transformers: tests/serialize/test_hf.py; layouts: tests/parallel/test_expert_parallel.py; on a
GPU: tests/test_cuda.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from helpers import BF16_PATHS, BF16_ROUNDOFF, build_llama, llama_config, precision_path, random_batch
from torch.utils._python_dispatch import TorchDispatchMode

from femtotron.diagnostics.expert_load import COLLAPSE_STEPS, RouterCollapse
from femtotron.models.moe import AUX, MoE, RouterLogits
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.context_parallel import ContextParallel
from femtotron.precision import grouped_linear, grouped_mm_on_gpu

MOE = dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32)


def moe_config(**moe):
    return llama_config(num_hidden_layers=2, moe={**MOE, **moe})


def _loop(rows, weight, counts):
    """The reference: each expert's rows times its matrix, one expert at a time."""
    parts = rows.split(counts.tolist())
    return torch.cat([part @ w.T for part, w in zip(parts, weight, strict=True)])


@pytest.mark.parametrize(
    "dtype, native", [(torch.float32, None), (torch.bfloat16, True), (torch.bfloat16, False)]
)
def test_the_grouped_gemm_equals_a_loop_over_experts_with_empty_experts(dtype, native):
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(23, 64, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(5, 48, 64, generator=generator).to(dtype).requires_grad_()
    counts = torch.tensor([7, 0, 9, 0, 7])  # two experts got no token
    with precision_path(native):
        out = grouped_linear(rows, weight, counts.cumsum(0))
        out.backward(torch.ones_like(out))  # an expanded (stride 0) gradient, as .sum() gives
    exact = _loop(rows.detach().float().requires_grad_(), weight.detach().float().requires_grad_(), counts)
    tolerance = 1e-5 if dtype == torch.float32 else 4 * BF16_ROUNDOFF
    assert (out.float() - exact).abs().max() <= tolerance * exact.abs().max()
    assert weight.grad[1].abs().max() == 0 and weight.grad[3].abs().max() == 0


def test_torchs_grouped_gemm_is_taken_on_gpus_only_where_it_is_right_and_sync_free():
    """bf16 on sm90; not on sm100 (experts without rows get gradients: pytorch#172439), nor where torch runs
    its own loop with three host syncs (sm80, sm120), nor in fp32."""
    assert grouped_mm_on_gpu(torch.bfloat16, (9, 0))
    assert not any(grouped_mm_on_gpu(torch.bfloat16, capability) for capability in [(8, 0), (10, 0), (12, 0)])
    assert not grouped_mm_on_gpu(torch.float32, (9, 0))


def _saved_for_backward(function, *args):
    """What `function(*args)` returns, and the tensors autograd saves for backward while it runs."""
    saved = []

    def keep(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        return function(*args), saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_router_logits_are_fp32s_but_backward_keeps_the_hidden_states_in_their_dtype(dtype):
    """The logits and gradients of autograd through F.linear on fp32 copies, within fp32 rounding; without
    the fp32 copy of the (tokens, hidden) states kept for backward."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(14, 64, generator=generator).to(dtype)
    weight = torch.randn(4, 64, generator=generator).to(dtype)
    grad = torch.randn(14, 4, generator=generator)
    results = []
    for logits_of in (RouterLogits.apply, lambda x, w: F.linear(x.float(), w.float())):
        inputs = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
        logits, saved = _saved_for_backward(logits_of, *inputs)
        logits.backward(grad)
        results.append((logits, *(t.grad for t in inputs), [(t.dtype, t.shape) for t in saved]))
    (*got, saved), (*exact, _) = results
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == dtype
    for mine, autograds in zip(got, exact, strict=True):
        torch.testing.assert_close(mine, autograds)
    assert [held for held in saved if held[1] == x.shape] == [(dtype, x.shape)]


def test_a_bf16_layer_saves_its_hidden_states_for_backward_in_bf16_only():
    cfg = moe_config()
    x = torch.randn(2, 7, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    layer = _moe_layers(build_llama(cfg, torch.bfloat16))[0]
    with precision_path(True):  # the upcast path's matmuls save fp32 copies, by design
        _, saved = _saved_for_backward(layer, x.requires_grad_())
    hidden_states = [t for t in saved if t.shape[-1] == cfg.hidden_size and t.numel() >= x.numel()]
    assert hidden_states and all(t.dtype == torch.bfloat16 for t in hidden_states)


def _moe_layers(model):
    return [m for m in model.modules() if isinstance(m, MoE)]


@pytest.mark.parametrize("router_norm", ["topk_then_softmax", "softmax_then_topk"])
def test_each_token_gets_its_top_k_experts_weighted_as_the_router_says(router_norm):
    """The layer's output is, per token, the router-weighted sum of its k experts' MLPs (each computed here
    on its own), plus the gated shared experts."""
    cfg = moe_config(router_norm=router_norm, num_shared_experts=1, shared_expert_gate=True)
    model = build_llama(cfg)
    layer = _moe_layers(model)[0]
    x = torch.randn(2, 7, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = layer(x)
        tokens = x.reshape(-1, cfg.hidden_size)
        probs = (tokens @ layer.router.weight.T).softmax(-1)
        top, chosen = probs.topk(2, dim=-1)
        weights = top / top.sum(-1, keepdim=True) if router_norm == "topk_then_softmax" else top
        expected = torch.zeros_like(tokens)
        for t in range(len(tokens)):
            for j in range(2):
                e = chosen[t, j]
                gate, up = (tokens[t] @ layer.experts.gate_up_proj[e].transpose(-2, -1)).unbind(0)
                expected[t] += weights[t, j] * (F.silu(gate) * up) @ layer.experts.down_proj[e].T
        shared = layer.shared_expert(x) * torch.sigmoid(x @ layer.shared_expert_gate.weight.T)
    torch.testing.assert_close(got, expected.view_as(x) + shared, rtol=1e-5, atol=1e-6)


class _HostReads(TorchDispatchMode):
    """The ops run that, on a GPU, make the host wait for the device: outputs sized by the data (a boolean
    mask's selection included), values read back, and repeat_interleave when not told its output's size."""

    SIZED_BY_DATA = {"bincount", "nonzero", "masked_select", "unique", "_unique2", "_local_scalar_dense"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.seen.append("index by a mask")
        elif name in self.SIZED_BY_DATA:
            self.seen.append(name)
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            self.seen.append(name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_routing_reads_nothing_back_to_the_host_unless_a_capacity_drops_assignments(capacity_factor):
    """What tests/test_cuda.py checks with CUDA's sync debug mode, seen on the CPU: the counts, the dropped
    count and the router losses stay on the device through forward and backward; a capacity makes the kept
    rows' number the data's, which the host must know (one boolean mask)."""
    layer = _moe_layers(build_llama(moe_config(capacity_factor=capacity_factor, z_loss_coef=0.01)))[0]
    x = torch.randn(2, 7, layer.router.weight.shape[1], generator=torch.Generator().manual_seed(3))
    with _HostReads() as reads:
        layer(x.requires_grad_()).square().sum().backward()
    assert reads.seen == ([] if capacity_factor is None else ["index by a mask"])


def test_a_capacity_drops_the_assignments_past_it_in_token_order_and_counts_them():
    cfg = moe_config(capacity_factor=0.5)
    layer = _moe_layers(build_llama(cfg))[0]
    tokens = torch.randn(8, cfg.hidden_size)
    chosen = torch.tensor([[0, 1]] * 6 + [[2, 3]] * 2)  # experts 0 and 1 over-subscribed
    weights = torch.full((8, 2), 0.5)
    capacity = 2  # ceil(0.5 * 8 tokens * 2 / 4 experts)
    out, counts, dropped = layer.routed(tokens, chosen, weights)
    assert counts.tolist() == [6, 6, 2, 2] and dropped.item() == 2 * (6 - capacity)
    assert out[capacity:6].abs().max() == 0  # tokens 2-5 lost both their experts
    assert out[:capacity].abs().min() > 0 and out[6:].abs().min() > 0


def test_the_router_losses_gradients_equal_autograd_of_the_written_out_loss():
    """The loss-balancing and z losses are added in backward; the same gradients come from adding, by hand,
    coef * E * sum_e f_e P_e and coef_z * mean(logsumexp^2), averaged over layers, to the LM loss."""
    coefs = dict(aux_loss_coef=0.1, z_loss_coef=0.01)
    ids, targets = random_batch(251, size=2, length=12)
    injected = build_llama(moe_config(**coefs))
    injected.router_stats.reset(gradient_scale=1.0)
    loss, _ = injected(ids, targets)
    loss.backward()

    written = build_llama(moe_config(aux_loss_coef=0.0))  # the same weights, no router loss of its own
    added = []

    def hook(module, inputs, output):
        logits = F.linear(inputs[0].reshape(-1, inputs[0].shape[-1]).float(), module.router.weight.float())
        share = torch.bincount(logits.topk(2, dim=-1).indices.flatten(), minlength=4) / (2 * len(logits))
        aux = 4 * (share * logits.softmax(-1).mean(0)).sum()
        added.append(
            coefs["aux_loss_coef"] * aux + coefs["z_loss_coef"] * logits.logsumexp(-1).square().mean()
        )

    for layer in _moe_layers(written):
        layer.register_forward_hook(hook)
    loss_written, _ = written(ids, targets)
    (loss_written + sum(added) / len(added)).backward()
    assert torch.equal(loss, loss_written)
    for (name, a), (_, b) in zip(injected.named_parameters(), written.named_parameters(), strict=True):
        assert (a.grad - b.grad).abs().max() <= 1e-5 * b.grad.abs().max(), name
    stats = injected.router_stats
    assert stats.values[:, :4].sum().item() == 2 * 2 * 12 * 2  # layers x tokens x k
    assert (stats.values[:, 4 + AUX] >= 1 - 1e-6).all()  # the balance loss is 1 at best


def test_recomputation_gives_the_same_gradients_and_records_each_layer_once():
    ids, targets = random_batch(251, size=2, length=12)
    runs = []
    for recompute in (False, True):
        model = build_llama(moe_config(z_loss_coef=0.01), recompute_layer=recompute)
        model.router_stats.reset(gradient_scale=1.0)
        loss, _ = model(ids, targets)
        loss.backward()
        runs.append(({n: p.grad for n, p in model.named_parameters()}, model.router_stats.values.clone()))
    (grads, values), (grads_again, values_again) = runs
    assert torch.equal(values, values_again)
    for name, grad in grads.items():
        assert torch.equal(grad, grads_again[name]), name


@BF16_PATHS
def test_a_bf16_moe_trains_on_both_cpu_paths(native):
    ids, targets = random_batch(251, size=2, length=12)
    with precision_path(native):
        model = build_llama(moe_config(), torch.bfloat16)
        model.router_stats.reset(gradient_scale=1.0)
        loss, _ = model(ids, targets)
        loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_parameter_and_flop_counts_count_every_expert_and_the_active_ones():
    cfg = moe_config(num_shared_experts=1, shared_expert_gate=True)
    model = build_llama(cfg)
    assert cfg.parameter_count == sum(p.numel() for p in model.parameters())
    h, f = cfg.hidden_size, 32
    inactive = 2 * 3 * h * f  # per layer, the experts a token does not take
    assert cfg.layer_parameters - cfg.active_layer_parameters == inactive
    dense = llama_config(num_hidden_layers=2, intermediate_size=2 * f)  # top-2 of 32 = one MLP of 64
    assert cfg.layer_flops(64) - dense.layer_flops(64) == 2 * (4 * h + 3 * h * f + h)  # router, shared, gate


def test_dense_layers_among_the_experts_are_counted_and_routed_by_none():
    """moe.dense_layers: those layers have a dense MLP of intermediate_size (Qwen-MoE's mlp_only_layers), the
    counts take each layer as it is, and only the layers with experts record routing or collapse."""
    cfg = moe_config(dense_layers=[0])
    model = build_llama(cfg)
    assert cfg.parameter_count == sum(p.numel() for p in model.parameters())
    h, f = cfg.hidden_size, 32
    assert cfg.parameter_count - cfg.active_parameter_count == 2 * 3 * h * f  # layer 1's untaken experts
    assert type(model.layers[0].mlp).__name__ == "MLP" and type(model.layers[1].mlp).__name__ == "MoE"
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model.router_stats.reset(gradient_scale=1.0)
    model(ids, ids)[0].backward()
    assert not model.router_stats.values[0].any() and model.router_stats.values[1, :4].sum() == 2 * 16 * 2
    watch = RouterCollapse(cfg)
    collapsed = torch.tensor([[20.0, 18.0, 1.0, 1.0]])  # the loads of the one layer with experts
    warnings = [watch.observe(collapsed) for _ in range(COLLAPSE_STEPS)]
    assert "router collapse in layer 1:" in warnings[-1][0]


def test_a_collapsed_router_is_warned_about_after_many_steps_naming_the_layer():
    watch = RouterCollapse(moe_config())
    balanced, collapsed = torch.tensor([10.0, 10.0, 10.0, 10.0]), torch.tensor([20.0, 18.0, 1.0, 1.0])
    warnings = [watch.observe(torch.stack([balanced, collapsed])) for _ in range(COLLAPSE_STEPS)]
    assert not any(warnings[:-1]) and len(warnings[-1]) == 1
    assert "layer 1: expert 0 took 100% of the tokens" in warnings[-1][0]
    assert "model.model_config.moe.aux_loss_coef" in warnings[-1][0]
    assert watch.observe(torch.stack([balanced, collapsed])) == []  # once, not every step after


def _router_losses_of_my_half(rank, cfg, logits, counts_of_half):
    ctx = ParallelContext(cp=2, collective_timeout_seconds=30)
    cp = ContextParallel(ctx.comm, ctx.cp_group, ctx.cp_rank, ctx.cp_links)
    layer = _moe_layers(build_llama(cfg, cp=cp))[0]
    half = len(logits) // 2
    aux, z = layer.router_losses(logits[rank * half : (rank + 1) * half], counts_of_half[rank])
    ctx.close()
    return [aux.item(), z.item()]


@pytest.mark.distributed
def test_the_cp_ranks_router_losses_add_up_to_the_whole_sequence_s():
    """Each cp rank holds half the sequence: the load-balancing loss needs the whole sequence's assignments
    (summed over cp), and the two ranks' shares of both losses add up to one process's loss. Only the
    cp2 x ep2 layout case sees a share counted from one cp rank's assignments otherwise."""
    cfg = moe_config(z_loss_coef=0.01)
    logits = torch.randn(16, cfg.moe.num_experts, generator=torch.Generator().manual_seed(3))
    chosen = logits.topk(cfg.moe.num_experts_per_tok, dim=-1).indices

    def counts(rows):
        return torch.bincount(chosen[rows].flatten(), minlength=cfg.moe.num_experts)

    whole = _moe_layers(build_llama(cfg))[0].router_losses(logits, counts(slice(0, 16)))
    halves = [counts(slice(0, 8)), counts(slice(8, 16))]
    shares = run_ranks(_router_losses_of_my_half, 2, cfg, logits, halves)
    for loss, one_process in zip(torch.tensor(shares).sum(0), whole, strict=True):
        assert loss.item() == pytest.approx(one_process.item(), rel=1e-6)
