"""`femtotron doctor`: a config checked without launching (L1, M1, M3, P2, T3)."""

from __future__ import annotations

import pytest
import torch
import yaml
from helpers import TINY_MODEL, build_llama

from femtotron.cli import main
from femtotron.config import LlamaConfig
from femtotron.diagnostics import memory
from femtotron.diagnostics.memory import human
from femtotron.optim.muon import orthogonalised
from femtotron.serialize.background import available_host_bytes


def write(tiny_config, tmp_path, *overrides):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config(*overrides).to_dict()))
    return str(path)


def test_M1_doctor_says_what_does_not_fit_and_what_each_fix_gives(tiny_config, tmp_path, capsys):
    config = write(tiny_config, tmp_path, "parallelism.dp=2", "tokens.micro_batch_size=8")
    assert main(["doctor", config, "--device-memory", "0.002"]) == 1
    out = capsys.readouterr().out
    assert "config: every rule holds; layout dp=2 tp=1 pp=1 = 2 process(es)" in out
    assert "dp: all-reduce" in out and "memory per rank (estimate; device: 0.002 GiB per device):" in out
    assert "does NOT fit (M1): pp rank 0 needs" in out
    for fix in (
        "tokens.micro_batch_size=4 (and batch_accumulation_per_replica=2 to keep the batch)",
        "tokens.sequence_length=16",
        "with optimizer.zero_stage=1",
        "with parallelism.recompute_layer=true",
    ):
        assert f"  {fix}: " in out
    assert main(["doctor", config, "--device", "H100"]) == 0
    assert "fits: the largest rank needs" in capsys.readouterr().out


def test_L1_doctor_checks_the_world_size_without_launching(tiny_config, tmp_path, capsys):
    config = write(tiny_config, tmp_path, "parallelism.dp=2")
    assert main(["doctor", config, "--world-size", "3"]) == 2
    assert "WORLD_SIZE=3" in capsys.readouterr().err


def test_P2_T3_M3_doctor_prints_the_bubble_the_stage_map_and_the_tp_placement(tiny_config, tmp_path, capsys):
    config = write(
        tiny_config,
        tmp_path,
        "parallelism.pp=2",
        "parallelism.tp=2",
        "tokens.batch_accumulation_per_replica=2",
    )
    assert main(["doctor", config, "--gpus-per-node", "1"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 1f1b, each stage idles 33% of a step in theory (P2)" in out
    assert "stage 0 (pp rank 0" in out and "pp rank 1: " in out
    assert "tp=2 > 1 GPUs per node" in out and "pp: " in out and "tp: " in out


def test_P2_doctor_prints_zb_h1_s_smaller_bubble_and_what_waits_for_w(tiny_config, tmp_path, capsys):
    """pp=2, 2 micro-batches: 1F1B idles 1/3 of a step; zb-h1 spans 7 thirds of a stage-step for 6 of work."""
    config = write(
        tiny_config,
        tmp_path,
        "parallelism.pp=2",
        "parallelism.pp_engine=zb-h1",
        "tokens.batch_accumulation_per_replica=2",
    )
    assert main(["doctor", config]) == 0
    out = capsys.readouterr().out
    assert "pipeline: zb-h1, each stage idles 14% of a step in theory (P2)" in out
    assert out.count("of it until its weight gradients, W)") == 2  # both pp ranks


def test_T3_the_tp_link_is_named_by_what_it_crosses(tiny_config, tmp_path, capsys):
    """NVLink only inside a GPU node: on a CPU the tp group talks between processes of one host, and a tp
    group larger than a node crosses the network (as the warning above it says)."""
    config = write(tiny_config, tmp_path, "parallelism.tp=2")
    lines = {}
    for name, options in {
        "cpu": ["--device", "CPU"],
        "gpu": ["--device", "H100"],
        "across": ["--device", "H100", "--gpus-per-node", "1"],
    }.items():
        assert main(["doctor", config, *options]) == 0
        lines[name] = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  tp: "))
    assert lines["cpu"].endswith("(ALL_REDUCE; between processes of one host)")
    assert lines["gpu"].endswith("(ALL_REDUCE; inside a node: NVLink)")
    assert lines["across"].endswith("(ALL_REDUCE; across nodes: the network, see the warning above)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="without --device, a GPU machine estimates its GPU")
def test_without_a_device_doctor_estimates_this_machine_s_cpu(capsys):
    """examples/cpu_3d.yaml, as a user of it runs doctor on a CPU machine: no NCCL communicators."""
    assert main(["doctor", "examples/cpu_3d.yaml"]) == 0
    out = capsys.readouterr().out
    assert "NCCL communicator" not in out and "device: CPU" in out


def test_doctor_fits_the_8b_zero3_example_on_one_node_where_zero1_barely_fits(capsys):
    """examples/llama_8b_zero3_gpu.yaml: dp=8 alone, ZeRO-3: (2 + 4 + 12)/8 bytes per parameter, the gathered
    units and whole gradients counted apart, and every other stage beside it (its comment quotes these)."""
    assert main(["doctor", "examples/llama_8b_zero3_gpu.yaml", "--device", "H100"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("  pp rank 0: "))
    assert line.startswith(
        "  pp rank 0: 40.53 GiB = params 1.87 GiB + grads 3.74 GiB + master weights 3.74 GiB"
    )
    assert "+ gathered parameters and whole gradients during the step 9.21 GiB" in line
    assert "with optimizer.zero_stage=0: 149.11 GiB per rank (does not fit)" in out
    assert "with optimizer.zero_stage=1: 70.58 GiB per rank (fits)" in out
    assert "dp: all-gather 418.81 GiB + reduce-scatter 418.81 GiB per step" in out
    assert "fits: the largest rank needs 40.53 GiB of 79.1 GiB (51%)" in out


def test_doctor_prints_the_bytes_and_memory_of_reducing_zero3_s_gradients_once_per_step(capsys):
    """The 8B ZeRO-3 example has 16 micro-batches per step: reduced after each (the default) the gradients
    cross dp 16 times, reduced once per step once (418.81 / 16 = 26.18 GiB), with every unit's whole fp32
    gradients held through the step (62.62 GiB per rank instead of 40.53). Either way doctor names the
    other."""
    assert main(["doctor", "examples/llama_8b_zero3_gpu.yaml", "--device", "H100"]) == 0
    out = capsys.readouterr().out
    assert "dp: all-gather 418.81 GiB + reduce-scatter 418.81 GiB per step" in out
    assert "with optimizer.reduce_every_micro_batch=false: reduce-scatter 26.18 GiB per step" in out
    assert "with optimizer.reduce_every_micro_batch=false: 62.62 GiB per rank (fits)" in out
    once = ["doctor", "examples/llama_8b_zero3_gpu.yaml", "--device", "H100"]
    assert main([*once, "optimizer.reduce_every_micro_batch=false"]) == 0
    out = capsys.readouterr().out
    assert "dp: all-gather 418.81 GiB + reduce-scatter 26.18 GiB per step" in out
    assert "fits: the largest rank needs 62.62 GiB" in out
    assert "with optimizer.reduce_every_micro_batch=true: 40.53 GiB per rank (fits)" in out


def test_doctor_counts_the_host_memory_of_async_checkpoints(capsys):
    """The staging buffers hold the rank's part of a checkpoint: its 1/8 of the 8B model's bf16 weights, fp32
    master weights and Adam moments, 1.87 + 3.74 + 7.48 GiB."""
    overrides = ["--device", "H100", "checkpoints.async_save=true"]
    assert main(["doctor", "examples/llama_8b_zero3_gpu.yaml", *overrides]) == 0
    assert "host memory per rank for checkpoints.async_save: 13.09 GiB of staging" in capsys.readouterr().out
    assert main(["doctor", "examples/llama_8b_zero3_gpu.yaml", "--device", "H100"]) == 0
    assert "async_save" not in capsys.readouterr().out


def test_M1_doctor_budgets_the_nccl_communicators_on_gpus_only(tiny_config, tmp_path, capsys):
    """dp=2 tp=2: each rank is in a tp group, a dp group and the default group (mp = tp: no fourth)."""
    config = write(tiny_config, tmp_path, "parallelism.dp=2", "parallelism.tp=2")
    totals = {}
    for device in ("H100", "CPU"):
        assert main(["doctor", config, "--device", device]) == 0
        line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  pp rank 0: "))
        totals[device] = float(line.split()[3]) * (1 if line.split()[4] == "MiB" else 1024)
        assert ("+ 3 NCCL communicator(s) x 0.50 GiB = 1.50 GiB" in line) == (device == "H100")
    assert totals["H100"] - totals["CPU"] == pytest.approx(1536, abs=6)  # shown to 0.01 GiB


def test_doctor_counts_the_process_groups_and_the_world_wide_calls_that_make_them(capsys):
    """examples/cpu_3d.yaml (dp=2 tp=2 pp=2): 14 subgroups of 4 kinds (tp, dp, pp = embedding, mp) and 8
    one-way links (both ways between the 2 stages of each of the 4 pipelines); on NCCL each split_group and
    new_group is one ncclCommSplit of the whole world, so the kinds are made one split each."""
    assert main(["doctor", "examples/cpu_3d.yaml", "--device", "H100"]) == 0
    out = capsys.readouterr().out
    assert (
        "  process groups: the default one + 14 for collectives (4 kinds) + 8 one-way links (the pipeline's, "
        "the cp ring's); each rank is in up to 5 communicators for collectives and 2 links\n"
        "  start-up on NCCL: 4 split_group + 8 new_group calls, each one world-wide ncclCommSplit (22 with "
        "new_group alone)\n"
    ) in out
    assert "+ 5 NCCL communicator(s) x 0.50 GiB + 2 one-way link(s) x 64.0 MiB = 2.62 GiB" in out


def test_doctor_with_context_parallelism_counts_the_ring_and_offers_more_cp(tiny_config, tmp_path, capsys):
    """cp=2 tp=2: the layout line, the ring's bytes (femtotron.diagnostics.doctor.ring_bytes, tested exactly
    against a run in tests/parallel/test_context_parallel.py), gradients over dp x cp, a warning when tp x cp
    spans more than a node, and cp=4 among the fixes when it does not fit."""
    config = write(tiny_config, tmp_path, "parallelism.cp=2", "parallelism.tp=2", "tokens.micro_batch_size=8")
    assert main(["doctor", config, "--device-memory", "0.002", "--gpus-per-node", "2"]) == 1
    out = capsys.readouterr().out
    assert "layout dp=1 cp=2 tp=2 pp=1 = 4 process(es)" in out
    assert "  cp: " in out and "per step (the ring: keys and values, their gradients)" in out
    assert "  dp x cp: all-reduce" in out
    assert "warning: tp=2 x cp=2 > 2 GPUs per node: every layer's cp ring crosses the network" in out
    assert "  parallelism.cp=4 (twice the processes, or dp halved): " in out


def test_doctor_counts_each_ranks_experts_and_the_all_to_all(capsys):
    """examples/mixtral_8x7b_gpu.yaml: the layout line, the dense weights' and the experts' gradient
    reductions apart, the all-to-all (doctor.all_to_all_bytes, tested exactly in
    tests/parallel/test_expert_parallel.py), and a per-rank estimate holding 1/(ep tp pp) of the experts."""
    assert main(["doctor", "examples/mixtral_8x7b_gpu.yaml", "--world-size", "32", "--device", "H100"]) == 0
    out = capsys.readouterr().out
    assert "layout dp=8 (ep=4) tp=2 pp=2 = 32 process(es)" in out
    assert "  dp: reduce-scatter" in out and "  experts over their replicas: reduce-scatter" in out
    assert "  ep: all-to-all 144.00 GiB per step" in out and "fits: the largest rank needs" in out
    # bf16 weights: 45.1B of the 46.7B parameters are experts, over ep 4 x tp 2 x pp 2; the rest over tp pp
    params = float(out.split("params ")[1].split(" GiB")[0])
    assert 5.6 < params < 6.4, params


def test_doctor_offers_more_expert_parallelism_when_experts_do_not_fit(capsys):
    args = ["doctor", "examples/mixtral_8x7b_gpu.yaml", "--world-size", "32", "--device-memory", "30"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "  parallelism.ep=8 (each rank holds half the experts, no more processes): " in out


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("parallelism.recompute_layer=true", "model.dtype=bfloat16"),
        ("parallelism.pp=2", "tokens.batch_accumulation_per_replica=4"),
        ("parallelism.pp=2", "parallelism.pp_engine=interleaved-1f1b", "parallelism.pp_virtual_stages=2"),
        ("parallelism.pp=2", "parallelism.pp_engine=zb-h1"),
        ("parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER", "parallelism.cp=2", "parallelism.dp=2"),
        (
            "model.model_config.moe.num_experts=4",
            "model.model_config.moe.num_experts_per_tok=2",
            "model.model_config.moe.intermediate_size=64",
        ),
    ],
)
def test_E5_a_deep_stage_is_estimated_from_two_layers_exactly(tiny_config, monkeypatch, overrides):
    """doctor took ~60 s at 1,024 layers over pp=8 simulating every layer's step; each layer adds the same
    bytes, so two layers' steps give the rest: the same estimate as simulating all twelve."""
    config = tiny_config(
        "model.model_config.num_hidden_layers=12", "tokens.batch_accumulation_per_replica=4", *overrides
    )
    ranks = range(config.parallelism.pp)
    estimated = [memory.estimate_rank(config, pp_rank) for pp_rank in ranks]
    monkeypatch.setattr(memory, "SIMULATED_LAYERS", 12)
    assert [memory.estimate_rank(config, pp_rank) for pp_rank in ranks] == estimated


def test_doctor_counts_muon_s_momentum_and_what_it_gathers(tiny_config, tmp_path, capsys):
    """At tp2: one fp32 momentum per element of the decoder's matrices (Adam's two for the rest), and each
    matrix's other tp half gathered per step in fp32 (the model's dtype)."""
    muon = ("optimizer.optimizer_factory.name=muon", "parallelism.tp=2")
    config = write(tiny_config, tmp_path, *muon)
    model = build_llama(LlamaConfig(**TINY_MODEL))
    matrices = sum(p.numel() for n, p in model.named_parameters() if orthogonalised(n, p))
    assert main(["doctor", config]) == 0
    out = capsys.readouterr().out
    # half of each matrix on each tp rank: 4 bytes of momentum per element held, 4 per element gathered
    assert f"muon momentum {human(4 * matrices / 2)}" in out
    assert f"muon: {human(0)} over the replicas + {human(4 * matrices / 2)} over tp per step" in out
    assert main(["doctor", write(tiny_config, tmp_path, "parallelism.tp=2")]) == 0
    out = capsys.readouterr().out
    assert "muon momentum" not in out and "muon:" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="without --device, a GPU machine estimates its GPU")
def test_without_a_device_a_gpu_config_gets_a_verdict_a_hint_and_its_missing_paths(capsys):
    """examples/llama_8b_gpu.yaml on a machine without a GPU: it was sized against "CPU" with no verdict,
    exit 0, its placeholder data and tokenizer paths unmentioned. Now: the verdict for this machine's memory,
    shared by the 32 processes `femtotron train` would start here (20.98 GiB each), and how to size for
    GPUs."""
    code = main(["doctor", "examples/llama_8b_gpu.yaml"])
    out = capsys.readouterr().out
    fits = 32 * 20.98 * memory.GIB <= available_host_bytes()
    assert code == (0 if fits else 1)
    assert (
        "fits: the largest rank needs 20.98 GiB"
        if fits
        else "does NOT fit (M1): pp rank 0 needs 20.98 GiB, each process has "
    ) in out
    assert "of this machine's memory available, for 32 process(es)" in out
    assert (
        "hint: no --device, and this machine has no GPU: sized for its CPU" in out and "--device H100" in out
    )
    for field, path in (
        ("tokenizer.tokenizer_name_or_path", "path/to/tokenizer.json"),
        ("data.dataset_folder", "path/to/data"),
    ):
        assert f"warning: {field}: {path} does not exist (relative paths start from " in out
    assert main(["doctor", "examples/llama_8b_gpu.yaml", "--device", "H100"]) == 0
    out = capsys.readouterr().out
    assert "fits: the largest rank needs" in out and "hint:" not in out


def test_the_cpu_is_sized_against_this_machine_s_memory(tiny_config, tmp_path, capsys):
    """--device CPU gave no verdict: the CPU had no budget."""
    config = write(tiny_config, tmp_path, "parallelism.dp=2")
    assert main(["doctor", config, "--device", "CPU"]) == 0
    out = capsys.readouterr().out
    assert "device: CPU, " in out and "GiB of this machine's memory available, for 2 process(es)" in out
    assert "fits: the largest rank needs" in out
    assert "does not exist" not in out  # the patterned data is there


@pytest.mark.parametrize(
    "override, named",
    [
        ("tokens.micro_batch_size=1000000000000", "tokens.micro_batch_size"),
        ("model.model_config.hidden_size=1099511627776", "model.model_config.hidden_size"),
        (
            f"model.model_config.max_position_embeddings={10**30}",
            "model.model_config.max_position_embeddings",
        ),
    ],
)
def test_sizes_beyond_any_machine_are_config_errors_not_tracebacks(
    tiny_config, tmp_path, capsys, override, named
):
    """A micro-batch of 1e12 was allocated for real (the allocator's traceback), a hidden size of 2^40 or 1e30
    positions overflowed the meta device's byte counts."""
    config = write(tiny_config, tmp_path)
    assert main(["doctor", config, override, "--device", "H100"]) == 2
    err = capsys.readouterr().err
    assert f"{named} (command line override '{override}')" in err and "rule: at most 2^40 elements" in err


def test_a_vocabulary_of_4e9_within_the_bound_does_not_fit(tiny_config, tmp_path, capsys):
    """Its embedding (4e9 x 64) and logits (4 x 32 x 4e9) are under 2^40 elements: estimated, too large."""
    config = write(tiny_config, tmp_path)
    assert main(["doctor", config, "model.model_config.vocab_size=4000000000", "--device", "H100"]) == 1
    assert "does NOT fit (M1): pp rank 0 needs" in capsys.readouterr().out


@pytest.mark.cuda
def test_without_a_device_a_gpu_machine_is_sized_against_its_own_gpu(tiny_config, tmp_path, capsys):
    """No --device on a GPU machine: the GPU `femtotron train` uses, its free memory (once no verdict)."""
    assert main(["doctor", write(tiny_config, tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"device: this machine's {torch.cuda.get_device_name()}, " in out and " GiB free)" in out
    assert "fits: the largest rank needs" in out and "hint:" not in out
