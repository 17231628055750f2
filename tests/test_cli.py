"""The command line end to end, as a user runs it: separate processes, exit codes, printed text."""

import argparse
import gzip
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from distributed import free_port, run_ranks
from helpers import femtotron, torchrun
from helpers import write_cli_config as write_config

from femtotron import cli, trainer
from femtotron.config.sections import RUN_DATE
from femtotron.parallel import context

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus_and_tokenizer(tmp_path_factory):
    """The first 60k characters of two bundled plays, a tokenizer fitted to them, and their .bin/.idx."""
    root = tmp_path_factory.mktemp("cli")
    with gzip.open(REPO / "examples/data/shakespeare.jsonl.gz", "rt") as f:
        docs = [json.loads(next(f)) for _ in range(2)]
    corpus = root / "plays.jsonl"
    corpus.write_text("".join(json.dumps({"text": d["text"][:30000]}) + "\n" for d in docs))
    tokenizer = root / "tokenizer.json"
    result = femtotron(
        "train-tokenizer", "--input", str(corpus), "--vocab-size", "320", "--output", str(tokenizer)
    )
    assert result.returncode == 0, result.stderr
    prefix = root / "plays"
    result = femtotron(
        "preprocess", "--input", str(corpus), "--tokenizer", str(tokenizer), "--output-prefix", str(prefix)
    )
    assert result.returncode == 0, result.stderr
    assert "2 documents" in result.stdout
    return root, str(prefix), str(tokenizer)


@pytest.mark.distributed
def test_D2_train_on_one_cpu_process_then_generate(corpus_and_tokenizer, tmp_path):
    root, prefix, tokenizer = corpus_and_tokenizer
    config = write_config(tmp_path / "cfg.yaml", prefix, tokenizer, tmp_path / "runs")
    result = femtotron("train", str(config), "tokens.train_steps=4", "--debug")
    assert result.returncode == 0, result.stderr
    assert "--debug: NCCL_DEBUG=INFO TORCH_DISTRIBUTED_DEBUG=DETAIL" in result.stderr
    out = result.stdout
    assert "[rank 0 dp0 tp0 pp0] model: Llama 2 layers" in out
    assert "tokens per step" in out and "documents" in out and "epochs" in out
    assert "step 4/4 | loss" in out and "tok/s" in out and "MFU" in out
    run_dir = tmp_path / "runs" / "cli"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # the first 5 steps are logged whatever the interval (2)
    assert (run_dir / "tokenizer.json").is_file()  # the run directory is self-contained
    moved = tmp_path / "elsewhere"
    run_dir.rename(moved)
    sample = femtotron("generate", str(moved), "--prompt", "KING:", "--max-new-tokens", "20", "--top-k", "0")
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("KING:") and len(sample.stdout.strip()) > len("KING:")


@pytest.mark.distributed
def test_config_errors_exit_2_without_traceback(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(
        "model:\n  model_config:\n    hiden_size: 256\nparallelism:\n  tp: two\n"
        "tokens:\n  train_steps: 5\ndata:\n  dataset_folder: x\n"
    )
    result = femtotron("train", str(config), "tokens.micro_batch_size=0")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    for expected in ("hidden_size", "line 3", "parallelism.tp", "line 5", "'two'", "tokens.micro_batch_size"):
        assert expected in result.stderr


@pytest.mark.distributed
def test_L1_world_size_mismatch_is_caught_before_any_process_group(tmp_path):
    config = write_config(tmp_path / "cfg.yaml", "x", None, tmp_path / "runs")
    result = femtotron("train", str(config), env={"WORLD_SIZE": "4", "RANK": "0", "MASTER_PORT": "1"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        "WORLD_SIZE=4" in result.stderr
        and "dp=4 tp=1 pp=1" in result.stderr
        and "dp=2 tp=2 pp=1" in result.stderr
    )


@pytest.mark.distributed
def test_L3_missing_dataset_names_the_path_and_the_command(tmp_path):
    config = write_config(tmp_path / "cfg.yaml", str(tmp_path / "missing"), None, tmp_path / "runs")
    result = femtotron("train", str(config))
    assert result.returncode == 3 and "Traceback" not in result.stderr
    assert str(tmp_path / "missing") in result.stderr and "femtotron preprocess" in result.stderr


@pytest.mark.distributed
def test_generate_without_a_finished_run_explains(tmp_path):
    result = femtotron("generate", str(tmp_path / "runs" / "nothing"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "model.safetensors" in result.stderr or "config.yaml" in result.stderr


@pytest.mark.distributed
def test_torchrun_data_parallel(corpus_and_tokenizer, tmp_path):
    _, prefix, tokenizer = corpus_and_tokenizer
    config = write_config(tmp_path / "cfg.yaml", prefix, tokenizer, tmp_path / "runs", micro_batch_size=2)
    result = femtotron(
        "train", str(config), "parallelism.dp=2", "tokens.train_steps=2", launcher=torchrun(2, free_port())
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "starting them on this machine" not in result.stderr  # each rank trains; none launches more
    assert "[rank 0 dp0 tp0 pp0] layout: dp=2 tp=1 pp=1 on 2 process(es) on 1 host(s)" in result.stdout
    assert "step 2/2 | loss" in result.stdout
    assert (tmp_path / "runs" / "cli" / "model.safetensors").is_file()


@pytest.mark.distributed
def test_tokenizer_larger_than_the_model_vocabulary_is_refused(corpus_and_tokenizer, tmp_path):
    _, prefix, tokenizer = corpus_and_tokenizer
    config = write_config(tmp_path / "cfg.yaml", prefix, tokenizer, tmp_path / "runs")
    result = femtotron("train", str(config), "model.model_config.vocab_size=256")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "has 320 tokens but model.model_config.vocab_size=256" in result.stderr


@pytest.mark.distributed
def test_unwritable_paths_and_unreadable_yaml_are_errors_not_tracebacks(corpus_and_tokenizer, tmp_path):
    root, _, _ = corpus_and_tokenizer
    result = femtotron(
        "train-tokenizer",
        "--input",
        str(root / "plays.jsonl"),
        "--vocab-size",
        "300",
        "--output",
        str(tmp_path),
    )  # a directory, not a file
    assert result.returncode == 1 and "Traceback" not in result.stderr and str(tmp_path) in result.stderr
    config = tmp_path / "bell.yaml"
    config.write_text("tokens:\n  train_steps: 5\x07\n")
    result = femtotron("train", str(config))
    assert result.returncode == 2 and "Traceback" not in result.stderr and "bell.yaml" in result.stderr


def test_overrides_may_follow_options():
    from femtotron.cli import parse_args

    args = parse_args(["check-tp", "cfg.yaml", "a.b=1", "--tp", "2", "c.d=2"])
    assert (args.config, args.overrides, args.tp) == ("cfg.yaml", ["a.b=1", "c.d=2"], 2)
    args = parse_args(["train", "cfg.yaml", "--debug", "tokens.train_steps=3"])
    assert args.debug and args.overrides == ["tokens.train_steps=3"]
    with pytest.raises(SystemExit):
        parse_args(["train", "cfg.yaml", "--no-such-flag"])


def test_help_describes_the_tool_in_a_whole_sentence(capsys):
    from femtotron.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    description = " ".join(capsys.readouterr().out.split("positional arguments")[0].split())
    assert description.endswith(
        "femtotron: pretrain LLaMA-style models with data, tensor and pipeline parallelism and ZeRO-1."
    )


@pytest.mark.distributed
def test_train_tokenizer_with_too_small_a_vocabulary_is_a_usage_error(tmp_path):
    result = femtotron(
        "train-tokenizer",
        "--input",
        str(tmp_path / "none.jsonl"),
        "--vocab-size",
        "100",
        "--output",
        str(tmp_path / "t.json"),
    )
    assert result.returncode == 2 and "--vocab-size 100 is too small" in result.stderr


@pytest.mark.parametrize(
    "verb",
    [["plot"], ["import-hf", "--out", "OUT"], ["generate"]],
)
def test_a_run_or_model_directory_that_does_not_exist_exits_1(verb, tmp_path, capsys):
    """One rule (errors.PathError): a path given on the command line that is missing, or is not what the
    command reads, exits 1, as the README says; `plot` and `import-hf` exited 2."""
    from femtotron.cli import main

    nope = tmp_path / "runs" / "nope"
    argv = [verb[0], str(nope), *[str(tmp_path / arg) if arg == "OUT" else arg for arg in verb[1:]]]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert str(nope) in err and "Traceback" not in err


def _flight_recorder_of(rank, config, dates):
    """`femtotron train` under a launcher, up to the Trainer, on a machine with CUDA (its flight recorder
    is NCCL's) whose ranks run on gloo; %date is this rank's own clock: `dates[rank]`."""
    os.environ[RUN_DATE] = dates[rank]
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"):
        os.environ.pop(name, None)
    torch.cuda.is_available = lambda: True
    context.ParallelContext._pick_device = lambda self: (torch.device("cpu"), ("", ""))
    trainer.Trainer = lambda config, ctx: SimpleNamespace(train=lambda: None)  # cmd_train imports it there
    overrides = ["parallelism.dp=2", "general.run=cli_%date"]
    cli.cmd_train(argparse.Namespace(config=config, overrides=overrides, debug=False))
    return os.environ["TORCH_FR_DUMP_TEMP_FILE"]


@pytest.mark.distributed
def test_every_rank_dumps_its_flight_recorder_into_the_agreed_run(tiny_dataset, tmp_path):
    """Under torchrun or srun each rank reads its own clock for general.run's %date; rank 0's name is the
    run's, and the flight recorder's folder is set only once it is agreed (torch reads it at its first dump):
    no rank dumps into, or creates, a run directory of its own date."""
    config = write_config(tmp_path / "cfg.yaml", tiny_dataset, None, tmp_path / "runs")
    dates = ["20270101_000000", "20270101_000001"]
    prefixes = run_ranks(_flight_recorder_of, 2, str(config), dates)
    agreed = tmp_path / "runs" / f"cli_{dates[0]}"
    assert prefixes == [str(agreed / "nccl_flight_recorder" / "rank_")] * 2
    assert [path.name for path in (tmp_path / "runs").iterdir()] == [agreed.name]
