"""What only a CUDA GPU shows (skipped without one: tests/conftest.py; run by `make gpu-check`): bf16 computes
in bf16, AdamW is the fused kernel, a step's time covers its GPU work, a started run allocates expandable
segments, doctor's memory estimate holds against the real peak, a real out-of-memory gives the M1
report, and the op a rank waits for on the GPU is what the hang report sees."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

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

from femtotron.data.nanoset import MicroBatch
from femtotron.diagnostics.doctor import worst_stage
from femtotron.errors import OutOfMemory
from femtotron.models.llama import Llama
from femtotron.parallel.comm import Comm
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.context_parallel import place_tokens
from femtotron.precision import emulated_low_precision
from femtotron.trainer import Trainer

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


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


def test_bf16_runs_in_bf16_without_upcasts_and_its_loss_is_fp32s_within_rounding():
    assert not emulated_low_precision(torch.ones(1, dtype=torch.bfloat16, device=CUDA))
    cfg = llama_config()
    ids, targets = random_batch(cfg.vocab_size)
    model = Llama(cfg, std=0.02, seed=5, dtype=torch.bfloat16, device=CUDA)
    with Ops() as ops:
        loss_sum, count = model(ids.to(CUDA), targets.to(CUDA))
        (loss_sum / count).backward()
    matmuls = [dtypes for name in MATMULS for dtypes in ops.inputs.get(name, [])]
    # an attention kernel's first input: the query forward, the output's gradient backward
    attention = [dtypes[0] for name, calls in ops.inputs.items() if "attention" in name for dtypes in calls]
    assert matmuls and all(set(dtypes) == {torch.bfloat16} for dtypes in matmuls), matmuls
    assert attention and set(attention) == {torch.bfloat16}, ops.inputs.keys()
    assert all(p.grad.dtype == torch.bfloat16 and p.grad.isfinite().all() for p in model.parameters())
    # The same model in fp32 on the CPU (no TF32 there) from the same initial values. The loss at
    # initialisation is near ln(vocab) whatever the model computes; the gradients are not: measured on a CPU
    # with bf16 units, bf16 moves them by 0.5% (1.4 roundings), a wrong kernel by their whole size.
    reference = build_llama(cfg, torch.float32, seed=5)
    exact_sum, exact_count = reference(ids, targets)
    (exact_sum / exact_count).backward()
    exact, bf16 = (exact_sum / exact_count).item(), (loss_sum / count).item()
    assert abs(bf16 - exact) <= 2 * BF16_ROUNDOFF * exact, (bf16, exact)
    grads = torch.cat([p.grad.flatten().float().cpu() for p in model.parameters()])
    exact_grads = torch.cat([p.grad.flatten() for p in reference.parameters()])
    assert (grads - exact_grads).norm() <= 8 * BF16_ROUNDOFF * exact_grads.norm()


def test_document_masking_on_cuda_equals_the_cpu_kernel():
    """On GPUs each block of ring attention is written out in fp32 (precision.math_attention_with_lse): with
    document masking (one block at cp = 1, masked) its loss and gradients are the CPU flash kernel's."""
    cfg = llama_config(max_position_embeddings=64)
    tokens = torch.randint(1, cfg.vocab_size, (3, 33), generator=torch.Generator().manual_seed(0))
    tokens[:, ::7] = 0  # documents of 7 tokens, each ended by token 0
    batch = place_tokens(MicroBatch.from_tokens(tokens), 1, 0, eos_id=0)
    results = []
    for device in (torch.device("cpu"), CUDA):
        model = Llama(cfg, std=0.02, seed=5, dtype=torch.float32, device=device)
        on_device = batch.to(device)
        loss = model(on_device.inputs, on_device.targets, on_device.placement)[0]
        loss.backward()
        results.append((loss.item(), torch.cat([p.grad.flatten().cpu() for p in model.parameters()])))
    (cpu_loss, cpu_grads), (gpu_loss, gpu_grads) = results
    assert abs(gpu_loss - cpu_loss) <= 1e-5 * abs(cpu_loss)
    assert (gpu_grads - cpu_grads).norm() <= 1e-4 * cpu_grads.norm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixture_of_experts_on_cuda_equals_fp32_on_the_cpu(dtype):
    """bf16 runs the experts as torch's grouped GEMM on the GPU, fp32 as a loop over them (the kernel takes
    bf16 only there): loss and gradients are the CPU's fp32 ones, within bf16's rounding for bf16."""
    cfg = llama_config(
        moe={"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64, "z_loss_coef": 1e-3}
    )
    ids, targets = random_batch(cfg.vocab_size)
    results = []
    for device, dtype_here in ((torch.device("cpu"), torch.float32), (CUDA, dtype)):
        model = Llama(cfg, std=0.02, seed=5, dtype=dtype_here, device=device)
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
    assert ("_grouped_mm" in ops.inputs) == (dtype == torch.bfloat16), ops.inputs.keys()
    bound = 1e-4 if dtype == torch.float32 else 8 * BF16_ROUNDOFF  # the routing may flip a near tie in bf16
    assert abs(gpu_loss - cpu_loss) <= bound * abs(cpu_loss)
    assert (gpu_grads - cpu_grads).norm() <= bound * cpu_grads.norm() * (1 if dtype == torch.float32 else 4)


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
