"""What only a CUDA GPU shows (skipped without one: tests/conftest.py; run by `make gpu-check`): bf16 computes
in bf16, AdamW is the fused kernel, a step's time covers its GPU work, a started run allocates expandable
segments, doctor's memory estimate holds against the real peak, a real out-of-memory gives the M1
report, and the op a rank waits for on the GPU is what the hang report sees."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from helpers import (
    BF16_ROUNDOFF,
    build_llama,
    llama_config,
    random_batch,
    tiny_config_maker,
    write_patterned_tokens,
    write_yaml,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from femtotron.batch import MicroBatch
from femtotron.config import LlamaConfig
from femtotron.diagnostics.doctor import worst_stage
from femtotron.errors import OutOfMemory
from femtotron.models.llama import Llama
from femtotron.models.moe import MoE
from femtotron.parallel.comm import Comm
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.context_parallel import place_tokens
from femtotron.precision import emulated_low_precision, grouped_linear, grouped_mm_on_gpu
from femtotron.serialize.background import Staging
from femtotron.serialize.files import Slice
from femtotron.trainer import Trainer

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64, "z_loss_coef": 1e-3}


class Ops(TorchDispatchMode):
    """While active: every op run (forward and backward), by name, with the dtypes of its floating-point
    tensor arguments in order."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: dict[str, list[tuple[torch.dtype, ...]]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        tensors = tree_flatten(args)[0]
        dtypes = tuple(t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point())
        self.inputs.setdefault(func.overloadpacket.__name__, []).append(dtypes)
        return func(*args, **(kwargs or {}))


def release_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def on_cuda(reference: Llama, cfg: LlamaConfig, dtype: torch.dtype) -> Llama:
    """A CUDA model holding the CPU `reference`'s values (rounded to `dtype`): one built on a GPU from the
    same seed draws other values (parallel/sharding.full_init draws on the parameter's device)."""
    model = Llama(cfg, std=0.02, seed=5, dtype=dtype, device=CUDA)
    model.load_state_dict(reference.state_dict())
    return model


def assert_within_bf16_rounding(bf16: float, model: Llama, exact: torch.Tensor, reference: Llama) -> None:
    """A bf16 CUDA model's loss (its gradients taken already) against the fp32 CPU reference's mean loss
    `exact` (backward run here): the loss within 2 roundings, the gradients within 8 by norm."""
    exact.backward()
    assert abs(bf16 - exact.item()) <= 2 * BF16_ROUNDOFF * exact.item(), (bf16, exact.item())
    grads = torch.cat([p.grad.flatten().float().cpu() for p in model.parameters()])
    exact_grads = torch.cat([p.grad.flatten() for p in reference.parameters()])
    assert (grads - exact_grads).norm() <= 8 * BF16_ROUNDOFF * exact_grads.norm()


@pytest.fixture
def fp32_without_tf32():
    """fp32 matmuls in full fp32, for comparisons at fp32's precision: a CUDA Trainer run earlier in the
    session turns TF32 on (precision.tf32_for_fp32), which moves them by ~1e-3. Saved and restored by hand:
    monkeypatch cannot undo an attribute of torch.backends.cuda.matmul (AttributeError at teardown)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_bf16_runs_in_bf16_without_upcasts_and_its_loss_is_fp32s_within_rounding():
    assert not emulated_low_precision(torch.ones(1, dtype=torch.bfloat16, device=CUDA))
    cfg = llama_config()
    ids, targets = random_batch(cfg.vocab_size)
    reference = build_llama(cfg, torch.float32, seed=5)
    model = on_cuda(reference, cfg, torch.bfloat16)
    with Ops() as ops:
        loss_sum, count = model(ids.to(CUDA), targets.to(CUDA))
        (loss_sum / count).backward()
    matmuls = [dtypes for name in MATMULS for dtypes in ops.inputs.get(name, [])]
    # an attention kernel's first input: the query forward, the output's gradient backward
    attention = [dtypes[0] for name, calls in ops.inputs.items() if "attention" in name for dtypes in calls]
    assert matmuls and all(set(dtypes) == {torch.bfloat16} for dtypes in matmuls), matmuls
    assert attention and set(attention) == {torch.bfloat16}, ops.inputs.keys()
    assert all(p.grad.dtype == torch.bfloat16 and p.grad.isfinite().all() for p in model.parameters())
    # The same model in fp32 on the CPU (no TF32 there), whose values the bf16 one holds rounded. The loss at
    # initialisation is near ln(vocab) whatever the model computes; the gradients are not: measured on a CPU
    # with bf16 units, bf16 moves them by 0.5% (1.4 roundings), a wrong kernel by their whole size.
    exact_sum, exact_count = reference(ids, targets)
    assert_within_bf16_rounding((loss_sum / count).item(), model, exact_sum / exact_count, reference)


def test_document_masking_on_cuda_equals_the_cpu_kernel(fp32_without_tf32):
    """On GPUs each block of ring attention is written out in fp32 (attention.math_attention_with_lse): with
    document masking (one block at cp = 1, masked) its loss and gradients are the CPU flash kernel's."""
    cfg = llama_config(max_position_embeddings=64)
    tokens = torch.randint(1, cfg.vocab_size, (3, 33), generator=torch.Generator().manual_seed(0))
    tokens[:, ::7] = 0  # documents of 7 tokens, each ended by token 0
    batch = place_tokens(MicroBatch.from_tokens(tokens), 1, 0, eos_id=0)
    reference = build_llama(cfg, torch.float32)
    results = []
    for device, model in ((torch.device("cpu"), reference), (CUDA, on_cuda(reference, cfg, torch.float32))):
        on_device = batch.to(device)
        loss = model(on_device.inputs, on_device.targets, on_device.placement)[0]
        loss.backward()
        results.append((loss.item(), torch.cat([p.grad.flatten().cpu() for p in model.parameters()])))
    (cpu_loss, cpu_grads), (gpu_loss, gpu_grads) = results
    assert abs(gpu_loss - cpu_loss) <= 1e-5 * abs(cpu_loss)
    assert (gpu_grads - cpu_grads).norm() <= 1e-4 * cpu_grads.norm()


@pytest.mark.parametrize("queries", [16, 1], ids=["whole sequence", "one position against a cache"])
def test_a_sliding_window_on_cuda_is_flash_attentions_own_and_equals_the_cpu_kernel(queries):
    """At cp = 1 in bf16 the window is FlashAttention-2's (window_size_left), forward and backward, on 2 K/V
    heads for 8 query heads as they are: no mask, no memory-efficient kernel. Against the CPU's masked kernel
    in fp32 on the same bf16 values: the kernel rounds its probabilities and output to bf16 (2 roundings of
    the output), its backward each product's operands (within 8 roundings of each gradient, by norm)."""
    from femtotron.attention import causal_attention

    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, queries, 64, generator=generator).bfloat16()
    k, v = (torch.randn(2, 2, 16, 64, generator=generator).bfloat16() for _ in range(2))
    grad = torch.randn(2, 8, queries, 64, generator=generator).bfloat16()
    results = []
    for device, dtype in ((torch.device("cpu"), torch.float32), (CUDA, torch.bfloat16)):
        inputs = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        with Ops() as ops:
            out = causal_attention(*inputs, causal=queries > 1, window=5)
            out.backward(grad.to(device, dtype))
        results.append([t.float().cpu() for t in (out, *(t.grad for t in inputs))])
    assert {"_flash_attention_forward", "_flash_attention_backward"} <= ops.inputs.keys(), ops.inputs.keys()
    assert not any("efficient" in name or "repeat" in name for name in ops.inputs), ops.inputs.keys()
    (exact_out, *exact_grads), (out, *grads) = results
    assert (out - exact_out).norm() <= 2 * BF16_ROUNDOFF * exact_out.norm()
    for got, exact in zip(grads, exact_grads, strict=True):
        assert (got - exact).norm() <= 8 * BF16_ROUNDOFF * exact.norm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixture_of_experts_on_cuda_equals_fp32_on_the_cpu(dtype, fp32_without_tf32):
    """bf16 runs the experts as torch's grouped GEMM on sm90 GPUs (precision.grouped_mm_on_gpu), fp32 and
    other GPUs as a loop over them: loss and gradients are the CPU's fp32 ones, within bf16's rounding for
    bf16."""
    cfg = llama_config(moe=MOE)
    ids, targets = random_batch(cfg.vocab_size)
    reference = build_llama(cfg, torch.float32)
    results = []
    for device, model in ((torch.device("cpu"), reference), (CUDA, on_cuda(reference, cfg, dtype))):
        model.router_stats.reset(gradient_scale=1.0)
        with Ops() as ops:
            loss_sum, count = model(ids.to(device), targets.to(device))
            (loss_sum / count).backward()
        results.append(
            (
                (loss_sum / count).item(),
                torch.cat([p.grad.flatten().float().cpu() for p in model.parameters()]),
            )
        )
    (cpu_loss, cpu_grads), (gpu_loss, gpu_grads) = results
    grouped = grouped_mm_on_gpu(dtype, torch.cuda.get_device_capability(CUDA))
    assert ("_grouped_mm" in ops.inputs) == grouped, ops.inputs.keys()
    bound = 1e-4 if dtype == torch.float32 else 8 * BF16_ROUNDOFF  # the routing may flip a near tie in bf16
    assert abs(gpu_loss - cpu_loss) <= bound * abs(cpu_loss)
    assert (gpu_grads - cpu_grads).norm() <= bound * cpu_grads.norm() * (1 if dtype == torch.float32 else 4)


@pytest.mark.parametrize("counts", [(0, 5, 0, 3), (7, 0, 9, 0, 0), (1, 1, 1, 1), (0, 0, 0, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_gemm_on_cuda_equals_the_cpu_with_odd_and_empty_experts(counts, dtype, fp32_without_tf32):
    """Experts with odd numbers of rows and with none, forward and backward, against fp32 on the CPU from
    the same (rounded) values; an expert without rows gets exactly zero gradient (which torch's kernel
    does not give on sm100, pytorch#172439: precision.grouped_mm_on_gpu)."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(sum(counts), 64, generator=generator).to(dtype)
    weight = torch.randn(len(counts), 48, 64, generator=generator).to(dtype)
    grad = torch.randn(sum(counts), 48, generator=generator).to(dtype)
    ends = torch.tensor(counts).cumsum(0)
    results = []
    for device, dtype_here in ((torch.device("cpu"), torch.float32), (CUDA, dtype)):
        x, w = (t.to(device, dtype_here, copy=True).requires_grad_() for t in (rows, weight))
        with Ops() as ops:
            out = grouped_linear(x, w, ends.to(device))
            out.backward(grad.to(device, dtype_here))
        results.append([t.float().cpu() for t in (out, x.grad, w.grad)])
    grouped = grouped_mm_on_gpu(dtype, torch.cuda.get_device_capability(CUDA))
    assert ("_grouped_mm" in ops.inputs) == grouped, ops.inputs.keys()
    # bf16: each output rounded once (fp32 accumulation), split-K partial sums perhaps too
    bound = 1e-5 if dtype == torch.float32 else 4 * BF16_ROUNDOFF
    for name, got, exact in zip(("output", "rows' gradient", "weight's gradient"), *results, strict=True):
        assert (got - exact).norm() <= bound * exact.norm(), name
    gpu_weight_grad = results[1][2]
    empty = [e for e, n in enumerate(counts) if n == 0]
    assert all(gpu_weight_grad[e].abs().max() == 0 for e in empty), "an expert without rows got a gradient"


def test_a_moe_layer_waits_for_the_gpu_only_in_the_loop_over_experts():
    """At ep = 1 a layer's routing, experts and router losses, forward and backward, never make the host
    wait for the GPU (as torch's sync debug mode sees waits); where the experts run as grouped_linear's
    loop instead of torch's grouped GEMM, it reads the groups' ends once per call: twice per forward."""
    cfg = llama_config(moe=MOE)
    model = Llama(cfg, std=0.02, seed=5, dtype=torch.bfloat16, device=CUDA)  # its values do not matter here
    model.router_stats.reset(gradient_scale=1.0)
    layer = next(module for module in model.modules() if isinstance(module, MoE))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, cfg.hidden_size, generator=generator).to(CUDA, torch.bfloat16).requires_grad_()
    grad = torch.randn(x.shape, generator=generator).to(CUDA, torch.bfloat16)
    layer(x).backward(grad)  # warm-up: CUDA's and cuBLAS's lazy set-up is not the layer's
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            layer(x).backward(grad)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    waits = [f"{w.filename}:{w.lineno}" for w in caught if "synchronizing CUDA operation" in str(w.message)]
    grouped = grouped_mm_on_gpu(torch.bfloat16, torch.cuda.get_device_capability(CUDA))
    assert len(waits) == (0 if grouped else 2), waits


def test_adamw_is_the_fused_kernel(tiny_config):
    trainer = Trainer(tiny_config("model.dtype=bfloat16"), ParallelContext(), log_to_console=False)
    assert trainer.ctx.device.type == "cuda" and not trainer.upcasts
    groups = trainer.optimizer.adam.param_groups
    assert all(group["fused"] and not group["foreach"] for group in groups)
    with Ops() as ops:
        trainer.train_step()
    assert "_fused_adamw_" in ops.inputs, sorted(ops.inputs)
    state = trainer.optimizer.adam.state[trainer.optimizer.masters[0]]
    assert state["step"].device.type == "cuda" and state["exp_avg"].dtype == torch.float32


def test_step_seconds_include_the_steps_gpu_work(tiny_config):
    """GPU work queued at the very end of a step, after its last host sync, is part of `seconds`: tokens/s,
    MFU and the communication shares are computed from it."""
    trainer = Trainer(tiny_config(), ParallelContext(), log_to_console=False)
    trainer.train_step()  # warm-up: kernels chosen, Adam's moments allocated
    cycles = 10**8  # ~50 ms of one GPU thread spinning
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    busy = time.perf_counter() - start
    optimizer_step = trainer.optimizer.step

    def step_then_stay_busy(lr: float) -> None:
        optimizer_step(lr)
        torch.cuda._sleep(cycles)

    trainer.optimizer.step = step_then_stay_busy
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = trainer.train_step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    assert result.seconds >= busy and result.seconds >= 0.9 * wall, (result.seconds, busy, wall)


STARTED_RUN = """
import json, os, sys
import torch
from femtotron.cli import main
code = main(["train", sys.argv[1], "tokens.train_steps=2"])
expandable = [segment["is_expandable"] for segment in torch.cuda.memory_snapshot()]
print(json.dumps({"exit": code, "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "expandable": expandable}))
"""


@pytest.mark.distributed
def test_M2_a_started_run_allocates_expandable_segments(tiny_config, tmp_path):
    """general.cuda_expandable_segments (on by default) sets PYTORCH_CUDA_ALLOC_CONF before CUDA starts, so
    the allocator really uses it."""
    path = write_yaml(tiny_config(), tmp_path / "c.yaml")
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    run = subprocess.run(
        [sys.executable, "-c", STARTED_RUN, path], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["exit"] == 0 and seen["conf"] == "expandable_segments:True"
    assert seen["expandable"] and all(seen["expandable"]), seen


def test_the_memory_estimate_is_the_real_peak_within_a_sane_factor(tiny_config):
    """`femtotron doctor`'s estimate against torch.cuda.max_memory_allocated over a step (the second: Adam's
    moments exist), for a 134M-parameter bf16 model: its 2.9 GiB dwarf the CUDA libraries' workspaces."""
    config = tiny_config(
        "model.dtype=bfloat16",
        "model.model_config.hidden_size=1024",
        "model.model_config.intermediate_size=4096",
        "model.model_config.num_hidden_layers=4",
        "model.model_config.num_attention_heads=8",
        "model.model_config.num_key_value_heads=8",
        "model.model_config.vocab_size=32768",
        "model.model_config.max_position_embeddings=128",
        "tokens.sequence_length=128",
        "tokens.micro_batch_size=8",
    )
    release_memory()
    before = torch.cuda.memory_allocated()
    trainer = Trainer(config, ParallelContext(), log_to_console=False)
    trainer.train_step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    trainer.train_step()
    measured = torch.cuda.max_memory_allocated() - before
    estimate = worst_stage(config, on_cpu=False).total
    assert 1 / 1.5 <= estimate / measured <= 1.5, (estimate, measured)


@contextlib.contextmanager
def squeezed(tmp_path):
    """A trainer whose step cannot fit: the process may use only 64 MiB more than it holds once the model is
    built, and the micro-batch of 2048 x 32 tokens needs 0.8 GiB of activations (doctor's estimate)."""
    data = write_patterned_tokens(tmp_path / "data" / "patterned", documents=120)  # 2,500 samples
    config = tiny_config_maker(tmp_path / "runs", data)("tokens.micro_batch_size=2048")
    trainer = Trainer(config, ParallelContext(), log_to_console=False)
    release_memory()
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 64 * 2**20) / total)
    try:
        yield trainer
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_M1_a_real_cuda_out_of_memory_gives_the_report_naming_the_fields(tmp_path):
    with squeezed(tmp_path) as trainer, pytest.raises(OutOfMemory) as info:
        trainer.train_step()
    message = str(info.value)
    assert message.startswith("step 1: out of memory on rank 0 in the "), message
    assert "(CUDA out of memory." in message
    assert "tokens.micro_batch_size=1024 (activations scale with it" in message
    assert "parallelism.recompute_layer=true" in message and "general.cuda_expandable_segments" in message
    assert info.value.exit_code == 8


def test_a_host_blocked_on_the_device_is_seen_by_the_hang_report():
    """On GPUs the host blocks where it reads a result (comm.read), not in the op it waits for; the watchdog's
    source, comm.unfinished(), names that wait while it lasts and forgets it once the device is done."""
    comm = Comm()
    ahead = torch.ones((), device=CUDA)
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued before the value is ready
    reader = threading.Thread(target=comm.read, args=(ahead + 1, "loss"))
    reader.start()
    time.sleep(0.3)
    seen = [(op.kind, op.group) for op in comm.unfinished()]
    reader.join()
    assert seen == [("wait for the device (loss)", None)] and comm.unfinished() == []


def test_profile_steps_on_cuda_write_the_trace_with_gpu_kernels_and_a_memory_snapshot(tmp_path):
    """profiling.profile_steps on CUDA: the Chrome trace has the GPU's kernels, and the allocator's history of
    those steps is dumped beside it."""
    import pickle

    data = write_patterned_tokens(tmp_path / "data" / "patterned", documents=60)
    config = tiny_config_maker(tmp_path / "runs", data)(
        "tokens.train_steps=3", "profiling.profile_steps=[2,3]"
    )
    Trainer(config, ParallelContext(), log_to_console=False).train()
    profile = config.run_dir / "profile"
    trace = json.loads((profile / "rank-0.json").read_text())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])
    snapshot = pickle.loads((profile / "rank-0-memory.pickle").read_bytes())
    assert snapshot["segments"] and any(trace_ for trace_ in snapshot["device_traces"])


def test_an_out_of_memory_step_leaves_the_allocators_state_and_says_where(tmp_path):
    """As in M1, the step cannot fit; inside the profiler's step context the report names the snapshot."""
    import pickle

    with squeezed(tmp_path) as trainer, pytest.raises(OutOfMemory) as info, trainer.profiler.step(1):
        trainer.train_step()
    path = trainer.config.run_dir / "profile" / "rank-0-oom.pickle"
    assert f"The allocator's state at the failure: {path}" in str(info.value)
    assert pickle.loads(path.read_bytes())["segments"]


def _ring_blocks_on(device, q, k, v, grad_out, blocks):
    """Ring attention's arithmetic on `device`, as `_RingAttention` does it: each block's output and lse
    merged in fp32 (context_parallel._merge), then each block's backward from the merged output (in q's
    dtype) and lse, the gradients summed in fp32. `blocks`: (rows, columns, causal, documents). Returns the
    output, the lse and the q, k, v gradients in fp32 on the CPU."""
    from femtotron.attention import attention_with_lse, attention_with_lse_backward
    from femtotron.parallel.context_parallel import _merge

    q, k, v, grad_out = (t.to(device) for t in (q, k, v, grad_out))
    blocks = [
        (rows, cols, causal, None if documents is None else tuple(t.to(device) for t in documents))
        for rows, cols, causal, documents in blocks
    ]
    out = torch.zeros(q.shape, dtype=torch.float32, device=device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=device)
    for rows, cols, causal, documents in blocks:
        keys = [t[:, :, cols] for t in (k, v)]
        block_out, block_lse = attention_with_lse(q[:, :, rows], *keys, causal, documents)
        _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
    out = out.to(q.dtype)
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=device) for t in (q, k, v)]
    for rows, cols, causal, documents in blocks:
        queries = [t[:, :, rows] for t in (grad_out, q)]
        keys = [t[:, :, cols] for t in (k, v)]
        merged = [out[:, :, rows], lse[:, :, rows]]
        dq, dk, dv = attention_with_lse_backward(*queries, *keys, *merged, causal, documents)
        grads[0][:, :, rows] += dq
        grads[1][:, :, cols] += dk
        grads[2][:, :, cols] += dv
    return [t.float().cpu() for t in (out, lse, *grads)]


RING_KERNELS = {
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
}


@pytest.mark.parametrize(
    "dtype, masked, head_dim",
    [
        (torch.bfloat16, False, 64),
        (torch.bfloat16, True, 64),
        (torch.float32, False, 64),
        (torch.float32, True, 64),
        (torch.bfloat16, True, 60),  # a head_dim no fused kernel takes: written out
    ],
)
def test_ring_attention_blocks_on_cuda_equal_attention_over_all_keys_on_the_cpu(
    dtype, masked, head_dim, monkeypatch
):
    """A cp rank's blocks at cp = 3 (rank 1: its own causal block, a lower rank's first chunk seen by every
    local query, a higher rank's whole block seen by the second local chunk), each through the kernel
    attention.block_kernel picks on this GPU (bf16: flash mask-free, memory-efficient under document
    masking; fp32 and odd head_dims: written out), merged by log-sum-exp, each block's backward from the
    merged output and lse: the output, lse and q, k, v gradients equal softmax attention over all the keys
    in fp32 on the CPU (autograd) from the same values, within bf16's rounding (fp32: 1e-4). 150 local
    queries (not a multiple of 32, the efficient kernel's lse rows), chunks of 32 of them per kernel call
    (8 written out), GQA 4 to 2 heads, and under masking a query that sees no key in either other block."""
    from femtotron import attention

    monkeypatch.setattr(attention, "SCORES_PER_CHUNK", 2 * 150 * 32)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 150, head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(2, 2, 375, head_dim, generator=generator).to(dtype) for _ in range(2))
    grad_out = torch.randn(q.shape, generator=generator).to(dtype)
    query_documents = torch.randint(0, 4, (2, 150), generator=generator)
    key_documents = torch.randint(0, 4, (2, 375), generator=generator)
    key_documents[:, :150] = query_documents  # the own block's keys are the queries' own tokens
    query_documents[:, 100] = key_documents[:, 100] = 9  # a document no other block has
    own, lower, higher = slice(0, 150), slice(150, 225), slice(225, 375)
    shapes = [(slice(None), own, True), (slice(None), lower, False), (slice(75, None), higher, False)]
    blocks = [
        (rows, cols, causal, (query_documents[:, rows], key_documents[:, cols]) if masked else None)
        for rows, cols, causal in shapes
    ]
    allowed = torch.zeros(2, 1, 150, 375, dtype=torch.bool)
    allowed[..., own] = torch.ones(150, 150, dtype=torch.bool).tril()
    allowed[..., lower] = True
    allowed[..., 75:, higher] = True
    if masked:
        allowed &= (query_documents[:, :, None] == key_documents[:, None, :]).unsqueeze(1)

    inputs = [t.clone().float().requires_grad_() for t in (q, k, v)]
    scores = inputs[0] @ inputs[1].repeat_interleave(2, 1).transpose(-1, -2) / head_dim**0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    exact_out = scores.softmax(-1) @ inputs[2].repeat_interleave(2, 1)
    exact_grads = torch.autograd.grad((grad_out.float() * exact_out).sum(), inputs)
    exact = [exact_out.detach(), scores.logsumexp(-1).detach(), *exact_grads]

    tf32 = torch.backends.cuda.matmul.allow_tf32  # fp32 in full precision: a Trainer may have turned TF32 on
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with Ops() as ops:
            results = _ring_blocks_on(CUDA, q, k, v, grad_out, blocks)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    kernel = attention.block_kernel("cuda", dtype, torch.cuda.get_device_capability(CUDA), head_dim, masked)
    expected = {
        "flash": {"_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"},
        "efficient": {
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_efficient_attention_backward",
        },
        "written out": set(),
    }[kernel]
    assert RING_KERNELS & set(ops.inputs) == expected, (kernel, sorted(ops.inputs))
    # bf16: the inputs are exact in both; the kernels round their probabilities and products to bf16 (a few
    # roundings), the merged output is rounded once more; a wrong block or mask is off by the whole value.
    bounds = [4, 1, 8, 8, 8] if dtype == torch.bfloat16 else [1e-4 / BF16_ROUNDOFF] * 5
    names = ["output", "log-sum-exp", "q's gradient", "k's gradient", "v's gradient"]
    for name, got, want, bound in zip(names, results, exact, bounds, strict=True):
        assert got.isfinite().all(), name
        assert (got - want).norm() <= bound * BF16_ROUNDOFF * want.norm(), (name, kernel)


def test_document_masking_on_cuda_in_bf16_runs_the_efficient_kernel_without_host_syncs():
    """A bf16 model under document masking (cp = 1: one masked causal block per layer) on the GPU: its loss
    and gradients are the CPU's fp32 ones from the same values within bf16's rounding, its blocks run the
    memory-efficient kernel (on sm80+), and ring attention never makes the host wait for the GPU (as torch's
    sync debug mode sees waits), forward or backward."""
    import warnings

    from femtotron import attention

    cfg = llama_config(max_position_embeddings=64)
    tokens = torch.randint(1, cfg.vocab_size, (3, 65), generator=torch.Generator().manual_seed(0))
    tokens[:, ::9] = 0  # documents of 9 tokens, each ended by token 0
    batch = place_tokens(MicroBatch.from_tokens(tokens), 1, 0, eos_id=0)
    reference = build_llama(cfg, torch.float32, seed=5)
    model = Llama(cfg, std=0.02, seed=5, dtype=torch.bfloat16, device=CUDA)
    model.load_state_dict(reference.state_dict())
    on_gpu = batch.to(CUDA)
    model(on_gpu.inputs, on_gpu.targets, on_gpu.placement)[0].backward()  # warm-up: CUDA's lazy set-up
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    with Ops() as ops, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss_sum, count = model(on_gpu.inputs, on_gpu.targets, on_gpu.placement)
            (loss_sum / count).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    waits = [
        f"{w.filename}:{w.lineno}"
        for w in caught
        if "synchronizing CUDA operation" in str(w.message)
        and w.filename.endswith(("attention.py", "context_parallel.py"))
    ]
    assert waits == []
    capability = torch.cuda.get_device_capability(CUDA)
    kernel = attention.block_kernel("cuda", torch.bfloat16, capability, cfg.head_dim, True)
    assert ("_scaled_dot_product_efficient_attention" in ops.inputs) == (kernel == "efficient"), kernel
    exact_sum, exact_count = reference(batch.inputs, batch.targets, batch.placement)
    assert_within_bf16_rounding((loss_sum / count).item(), model, exact_sum / exact_count, reference)


def test_an_async_save_stages_in_pinned_memory_and_writes_the_synchronous_files(tiny_config):
    """checkpoints.async_save on a GPU: the staging buffers are pinned host memory, and the files the
    background writer commits are the synchronous save's, byte for byte."""
    written = {}
    for mode in ("false", "true"):
        config = tiny_config(
            f"general.run=save-{mode}", "checkpoints.checkpoint_interval=2", f"checkpoints.async_save={mode}"
        )
        for seeded in (torch.manual_seed, torch.cuda.manual_seed_all, random.seed, np.random.seed):
            seeded(0)  # the RNG states saved: femtotron draws nothing from them, the process did
        trainer = Trainer(config, ParallelContext(), log_to_console=False)
        trainer.train()
        if trainer.checkpointer.background is not None:
            assert all(b.is_pinned() for b in trainer.checkpointer.background.staging.buffers.values())
        step = config.run_dir / "checkpoints" / f"step-{config.tokens.train_steps:07d}"
        written[mode] = {f.name: f.read_bytes() for f in step.iterdir() if f.suffix == ".safetensors"}
    assert written["true"] == written["false"] and written["true"]


def test_async_save_staging_page_locks_exactly_its_slices_bytes_outside_torchs_pinned_allocator():
    """The staging registers pageable memory of exactly its slices' bytes (cudaHostRegister): torch's pinned
    allocator, which rounds every request up to a power of two, takes none of it; the copies land."""
    slices = [
        Slice("model/w", (3, 5), ((0, 0), (3, 5)), torch.randn(3, 5, device=CUDA)),
        Slice("model/b", (5,), ((0,), (5,)), torch.randn(5, device=CUDA, dtype=torch.bfloat16)),
    ]
    pinned_before = torch.cuda.host_memory_stats()["allocated_bytes.allocated"]
    staging = Staging(pinned=True)
    staged = staging.stage(slices)
    assert torch.cuda.host_memory_stats()["allocated_bytes.allocated"] == pinned_before
    assert staging.bytes() == 3 * 5 * 4 + 5 * 2
    assert all(buffer.is_pinned() for buffer in staging.buffers.values())
    assert all(
        torch.equal(copy.values, piece.values.cpu()) for copy, piece in zip(staged, slices, strict=True)
    )
