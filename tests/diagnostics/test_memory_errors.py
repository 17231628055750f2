"""M1/M2: out-of-memory errors are explained; the CUDA allocator is set up against fragmentation."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import yaml
from distributed import run_ranks

from femtotron.cli import main
from femtotron.errors import OutOfMemory
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer


def raise_oom(module, inputs, output):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_M1_an_out_of_memory_error_says_where_what_the_state_takes_and_the_fixes(tiny_config):
    trainer = Trainer(tiny_config("tokens.micro_batch_size=4"), ParallelContext(), log_to_console=False)
    dict(trainer.model.chunks[0].named_modules())["layers.1.mlp"].register_forward_hook(raise_oom)
    with pytest.raises(OutOfMemory) as info:
        trainer.train_step()
    message = str(info.value)
    assert message.startswith(
        "step 1: out of memory on rank 0 in the forward of micro-batch 0, pipeline stage 0 "
        "(CUDA out of memory. Tried to allocate 2.00 GiB)"
    )
    assert (
        "This rank's model state: params 0.4 MiB, grads 0.4 MiB, master weights 0.0 MiB, adam moments 0.8 MiB"
        in message
    )
    assert "tokens.micro_batch_size=2" in message and "parallelism.recompute_layer=true" in message
    assert info.value.exit_code == 8


def test_M1_on_a_gpu_the_report_shows_the_peak_and_the_free_memory(tiny_config, monkeypatch):
    import femtotron.diagnostics.failures as failures

    memory = {
        "mem_peak_allocated_gib": 71.8,
        "mem_peak_reserved_gib": 78.1,
        "mem_free_gib": 0.4,
        "mem_total_gib": 79.2,
    }
    monkeypatch.setattr(failures, "memory_gib", lambda device: memory)  # what metrics.memory_gib reads
    gpu_rank = SimpleNamespace(rank=3, dp=2, device=torch.device("cuda", 1))
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    message = str(
        failures.out_of_memory(error, tiny_config(), gpu_rank, 4, "the backward", {"params": 2**20})
    )
    assert (
        "This rank's model state: params 1.0 MiB; memory: peak allocated 71.80 GiB, peak reserved 78.10 GiB, "
        "free 0.40 GiB, total 79.20 GiB. The peaks are since the last logged step; a large gap between peak "
        "reserved and peak allocated is fragmentation"
    ) in message


def test_M1_running_out_of_memory_on_the_cpu_is_the_same_report(tiny_config):
    """On the CPU an allocation failure is a plain RuntimeError, not torch.OutOfMemoryError."""
    trainer = Trainer(tiny_config(), ParallelContext(), log_to_console=False)

    def cpu_allocation_fails(module, inputs, output):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
            "tried to allocate 2147483648 bytes. Error code 12 (Cannot allocate memory)"
        )

    dict(trainer.model.chunks[0].named_modules())["layers.0.mlp"].register_full_backward_hook(
        lambda module, grad_in, grad_out: cpu_allocation_fails(module, grad_in, grad_out)
    )
    with pytest.raises(OutOfMemory) as info:
        trainer.train_step()
    assert str(info.value).startswith(
        "step 1: out of memory on rank 0 in the backward of micro-batch 0, pipeline stage 0 ([enforce "
        "fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory"
    )


# `femtotron train` with 1 GiB of address space left after torch is loaded, and a micro-batch that needs more.
SHORT_OF_MEMORY = """
import resource, sys
import torch
from femtotron.cli import main
with open("/proc/self/status") as f:
    size = next(int(line.split()[1]) for line in f if line.startswith("VmSize")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + 2**30, resource.RLIM_INFINITY))
sys.exit(main(["train", sys.argv[1], "tokens.micro_batch_size=16384", "tokens.train_steps=2"]))
"""


@pytest.mark.distributed
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the address space size from /proc")
def test_M1_a_real_cpu_allocation_failure_exits_8_with_the_report_not_a_traceback(tiny_config, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config().to_dict()))
    run = subprocess.run(
        [sys.executable, "-c", SHORT_OF_MEMORY, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 8, run.stderr[-3000:]
    assert "femtotron: error: step 1: out of memory on rank 0" in run.stderr and "Traceback" not in run.stderr
    assert "Fixes, in the usual order: tokens.micro_batch_size=8192" in run.stderr


def _oom_with_dp(rank, config):
    ctx = ParallelContext(dp=2, collective_timeout_seconds=30)
    trainer = Trainer(config, ctx, log_to_console=False)
    dict(trainer.model.chunks[0].named_modules())["layers.0"].register_forward_hook(raise_oom)
    try:
        trainer.train_step()
    except OutOfMemory as e:
        return str(e)
    finally:
        ctx.close()


@pytest.mark.distributed
def test_M1_with_data_parallelism_the_advice_includes_zero_stage_1(tiny_config):
    messages = run_ranks(_oom_with_dp, 2, tiny_config("parallelism.dp=2", "tokens.micro_batch_size=1"))
    fix = "optimizer.zero_stage=2 (gradients, master weights and Adam moments / dp=2)"
    assert all(fix in m for m in messages)
    assert "tokens.sequence_length=16" in messages[0]  # micro_batch_size is 1 already


@pytest.mark.parametrize(
    "user_value, switch, expected",
    [
        (None, "true", "expandable_segments:True"),
        ("max_split_size_mb:128", "true", "max_split_size_mb:128"),
        (None, "false", None),
    ],
)
def test_M2_expandable_segments_are_set_unless_the_user_chose(
    tiny_config, tmp_path, monkeypatch, user_value, switch, expected
):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    if user_value:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", user_value)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config().to_dict()))
    assert (
        main(
            [
                "train",
                str(path),
                "tokens.train_steps=2",
                f"general.cuda_expandable_segments={switch}",
                "optimizer.learning_rate_scheduler.lr_warmup_steps=0",
            ]
        )
        == 0
    )
    assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == expected


def test_with_long_sequences_the_advice_includes_context_parallelism(tiny_config):
    """From 4096 tokens on, activations are what to split: cp doubles; ZeRO-1's share counts dp x cp."""
    from femtotron.diagnostics import failures

    config = tiny_config(
        "tokens.sequence_length=4096",
        "model.model_config.max_position_embeddings=4096",
        "parallelism.dp=2",
        "parallelism.cp=2",
    )
    rank = SimpleNamespace(rank=0, dp=2, device=torch.device("cpu"))
    error = RuntimeError("DefaultCPUAllocator: can't allocate memory")
    message = str(failures.out_of_memory(error, config, rank, 1, "the forward", {"params": 2**20}))
    assert "parallelism.cp=4 (each rank holds 1/cp of every sequence's activations)" in message
    assert "optimizer.zero_stage=2 (gradients, master weights and Adam moments / dp x cp = 4)" in message


def test_a_mixture_of_experts_out_of_memory_offers_more_expert_parallelism(tiny_config):
    from femtotron.diagnostics import failures

    config = tiny_config("model.model_config.moe.num_experts=4", "parallelism.dp=2")
    rank = SimpleNamespace(rank=0, dp=2, device=torch.device("cpu"))
    error = RuntimeError("DefaultCPUAllocator: can't allocate memory")
    message = str(failures.out_of_memory(error, config, rank, 1, "the forward", {"params": 2**20}))
    assert "parallelism.ep=2 (each rank holds half as many experts; no more processes)" in message
