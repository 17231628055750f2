"""femtotron: pretrain LLaMA-style models with data, tensor and pipeline parallelism and ZeRO-1.

Verbs: train, doctor, check-tp, generate, inspect-data, convert-config, reshard, consolidate, import-hf,
export-hf, preprocess, train-tokenizer, plot.
Every problem a user can fix arrives as a FemtotronError and is printed as plain text with its
exit code (2 for config errors); a traceback means a bug in femtotron.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from femtotron.errors import ConfigError, FemtotronError

if TYPE_CHECKING:
    from femtotron.config import Config


def cmd_train(args: argparse.Namespace) -> int | None:
    from femtotron.config import check_world_size, load_config
    from femtotron.config.sections import RUN_DATE, run_date
    from femtotron.data.text_cache import tokenize_text_data, tokenized_by_rank_0
    from femtotron.launch import launched_by_torchrun
    from femtotron.serialize.resume_source import already_done, decided_by_rank_0
    from femtotron.serialize.weights import check_own_weights

    os.environ.setdefault(RUN_DATE, run_date())  # general.run's %date: the processes started here inherit it
    # --debug: every rank logs everything, rank-prefixed (D3).
    config = load_config(args.config, [*args.overrides, *(["logging.log_level=debug"] if args.debug else [])])
    par = config.parallelism
    if config.general.cuda_expandable_segments and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        # M2: fewer fragmentation OOMs; must be set before CUDA starts (children inherit it).
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    done = already_done(config)
    if done is not None:  # a requeued or repeated finished job: nothing to do, and nothing to overwrite
        if os.environ.get("RANK", "0") == "0":
            print(f"femtotron: {done}")
        return 0
    check_own_weights(config.run_dir)
    if not launched_by_torchrun():  # before any rank starts: its progress bar is the user's
        for line in tokenize_text_data(config):
            print(f"femtotron: {line}", file=sys.stderr)
    if par.world_size > 1 and not launched_by_torchrun():
        return launch_train(args, config)
    # L1: checked on every rank, from the environment alone, before any process group exists.
    check_world_size(config, int(os.environ.get("WORLD_SIZE", "1")))
    if args.debug:
        # Must be set before the process group is created to take effect.
        os.environ.setdefault("NCCL_DEBUG", "INFO")
        os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
        print(
            f"[rank {os.environ.get('RANK', '0')}] --debug: NCCL_DEBUG={os.environ['NCCL_DEBUG']} "
            f"TORCH_DISTRIBUTED_DEBUG={os.environ['TORCH_DISTRIBUTED_DEBUG']}",
            file=sys.stderr,
        )
    import torch

    from femtotron.diagnostics.watchdog import flight_recorder_folder, nccl_flight_recorder
    from femtotron.parallel.context import ParallelContext

    recording = torch.cuda.is_available() and nccl_flight_recorder()  # before NCCL's process groups
    from femtotron.run_lock import held_by_rank_0
    from femtotron.trainer import Trainer

    with ParallelContext.from_config(config) as ctx:
        # Under torchrun or srun each rank read its own clock for %date: rank 0's name is the run's.
        config.general.run = decided_by_rank_0(ctx, "the run's name", lambda: config.general.run)
        if recording:
            flight_recorder_folder(config.run_dir)
        tokenized_by_rank_0(config, ctx.store, ctx.rank)  # ready already when a local launcher started us
        with held_by_rank_0(config.run_dir, ctx.store, ctx.rank, ctx.collective_timeout_seconds):
            Trainer(config, ctx).train()
    return None


def launch_train(args: argparse.Namespace, config: Config) -> int:
    """Without a launcher, start the processes the layout needs here, each running this same command.

    The whole config is checked first so that a mistake is reported once, here, rather than by every
    rank after processes have started.
    """
    from femtotron.launch import check_local_devices, launch_local
    from femtotron.mesh import Mesh
    from femtotron.run_lock import run_lock

    par = config.parallelism
    check_local_devices(par.dp, par.tp, par.pp, par.cp)
    argv = ["train", args.config, *args.overrides, *(["--debug"] if args.debug else [])]
    with run_lock(config.run_dir):  # for the whole run: the ranks it starts find it held (LOCKED_ENV)
        return launch_local(par.world_size, argv, what=Mesh.of(par).describe())


def cmd_check_tp(args: argparse.Namespace) -> int:
    from femtotron.diagnostics.check_tp import run_check_tp

    # 0: tp=N matches tp=1; 1: a module diverges (the report names the first); config/data errors: 2/3.
    return run_check_tp(args.config, args.overrides, tp=args.tp, tolerance=args.tolerance)


def cmd_generate(args: argparse.Namespace) -> None:
    from femtotron.errors import UsageError
    from femtotron.generate import generate_text

    if args.temperature < 0:  # it once behaved as 0
        raise UsageError(f"--temperature {args.temperature:g} is negative: give 0 (greedy) or more")

    print(
        generate_text(args.run_dir, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    )


def mesh_options() -> list[str]:
    """reshard's options for the mesh, in the order --help lists them: the dimensions whose sizes multiply
    to the processes, then those carved out of them (ep)."""
    from femtotron.mesh import NAMED, WORLD_DIMENSIONS

    return [*WORLD_DIMENSIONS, *(name for name in NAMED if name not in WORLD_DIMENSIONS)]


def cmd_reshard(args: argparse.Namespace) -> None:
    from pathlib import Path

    from femtotron.serialize.offline import reshard

    # Each option as an override, with the option itself for messages.
    layout = {
        f"parallelism.{key}={value}": f"--{key} {value}"
        for key in mesh_options()
        if (value := getattr(args, key)) is not None
    }
    path = reshard(Path(args.checkpoint), Path(args.out), [*layout, *args.overrides], layout)
    print(f"wrote {path}; resume with checkpoints.resume_checkpoint_path={path.parent}")


def cmd_consolidate(args: argparse.Namespace) -> None:
    from pathlib import Path

    from femtotron.serialize.offline import consolidate

    out = consolidate(Path(args.checkpoint), Path(args.out), with_optimizer=args.with_optimizer)
    print(
        f"wrote {out / 'model.safetensors'} and {out / 'config.yaml'}"
        + (f" and {out / 'optimizer.safetensors'}" if args.with_optimizer else "")
    )


def cmd_import_hf(args: argparse.Namespace) -> None:
    from pathlib import Path

    from femtotron.serialize.hf import import_hf

    out = import_hf(Path(args.hf_dir), Path(args.out))
    train = f"`femtotron train {out / 'config.yaml'} data.dataset_folder=DATA tokens.train_steps=N` trains it"
    if (out / "tokenizer.json").is_file():
        print(f"wrote {out}: `femtotron generate {out}` samples from it, {train}")
    else:  # generate needs one
        print(
            f"wrote {out}, without a tokenizer ({args.hf_dir} has no tokenizer.json): {train}; to sample "
            f"from it, copy the model's tokenizer.json into {out} first"
        )


def cmd_export_hf(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    from femtotron.serialize.hf import HF_CONFIG, export_hf

    out = export_hf(Path(args.source), Path(args.out), args.dtype, _bytes(args.shard_size))
    architecture = json.loads((out / HF_CONFIG).read_text())["architectures"][0]
    print(f"wrote {out}: {architecture}.from_pretrained({str(out)!r}) loads it")


def _bytes(size: str) -> int:
    """'5GB' -> 5 * 10**9, '500MB', '2GiB', or a number of bytes."""
    import re

    units = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B)?\s*", size.upper())
    if not match or float(match.group(1)) <= 0:
        from femtotron.errors import UsageError

        raise UsageError(f"--shard-size {size}: give a size such as 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * units[match.group(2) or ""])


def cmd_doctor(args: argparse.Namespace) -> int:
    from femtotron.config import load_config
    from femtotron.diagnostics.doctor import diagnose

    config = load_config(args.config, args.overrides)
    try:
        report, fits = diagnose(config, args.world_size, args.device, args.device_memory, args.gpus_per_node)
    except ValueError as e:  # an unknown --device
        raise ConfigError(str(e)) from None
    print(report)
    return 0 if fits else 1


def cmd_convert_config(args: argparse.Namespace) -> None:
    import yaml

    from femtotron.atomic import atomic_path
    from femtotron.config import load_config
    from femtotron.config.load import is_nanotron
    from femtotron.config.nanotron import translate

    config = load_config(args.config)  # every problem at once, and the translation report (stderr)
    with open(args.config, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    if not is_nanotron(data):
        raise ConfigError(f"{args.config} is a femtotron config already (no nanotron-only section or key)")
    text = yaml.safe_dump(translate(data, {}).config, sort_keys=False)
    if args.out is None:
        print(text, end="")
        return
    with atomic_path(args.out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    print(
        f"femtotron: wrote {args.out} (run {config.general.run}); train it with `femtotron train {args.out}`"
    )


def cmd_inspect_data(args: argparse.Namespace) -> None:
    from femtotron.config import load_config
    from femtotron.data.stages import DataStages
    from femtotron.data.text_cache import tokenize_text_data
    from femtotron.data.tokenizer import load_tokenizer
    from femtotron.diagnostics.data_check import inspect_samples

    if not args.source.endswith((".yaml", ".yml")):  # a data source itself, not a run's config
        from femtotron.diagnostics.data_check import describe_data

        print(describe_data(args.source, load_tokenizer(args.tokenizer) if args.tokenizer else None))
        return
    config = load_config(args.source, args.overrides)
    for line in tokenize_text_data(config):
        print(line)
    data = DataStages(config)
    path = config.tokenizer.tokenizer_name_or_path
    tokenizer = load_tokenizer(path) if path else None
    planned = data.planned(config.global_batch_size)
    for index in range(len(data.stages)):
        nanoset = data.continued(index, planned[: index + 1])  # what the stage reads in an uninterrupted run
        if len(data.stages) > 1:
            print(f"{data.describe(index, nanoset)}; its first samples:")
        print(inspect_samples(nanoset, tokenizer, config.tokens.sequence_length, args.n))


def cmd_plot(args: argparse.Namespace) -> None:
    from pathlib import Path

    from femtotron.diagnostics.plot import plot_runs

    run_dirs = [Path(run_dir) for run_dir in args.run_dirs]
    written = plot_runs(run_dirs, Path(args.out) if args.out else run_dirs[0] / "plots")
    print(f"wrote {len(written)} plots to {written[0].parent}: {', '.join(p.name for p in written)}")


def cmd_preprocess(args: argparse.Namespace) -> None:
    from femtotron.data.documents import DocumentReader
    from femtotron.data.preprocess import available_cpus, preprocess

    reader = DocumentReader(args.text_key, blocks=args.blocks, skip_bad_records=args.skip_bad_records)
    summary = preprocess(
        args.input,
        args.tokenizer,
        args.output_prefix,
        workers=args.workers or available_cpus(),
        reader=reader,
        output_format=args.format,
        shard_bytes=_bytes(args.shard_size) if args.shard_size else None,
    )
    files = ".ds/.ds.index" if args.format == "datatrove" else ".bin/.idx"
    if args.shard_size:
        files = f"/ ({summary.shards} shard(s) of {files}; train on the directory)"
    if summary.skipped:
        print(
            f"skipped {summary.skipped:,} bad record(s) (--skip-bad-records); the first: "
            f"{summary.first_skipped}"
        )
    print(
        f"wrote {args.output_prefix}{files}: {summary.documents:,} documents, {summary.tokens:,} tokens "
        f"({summary.dtype})"
    )


def cmd_train_tokenizer(args: argparse.Namespace) -> None:
    from femtotron.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(args.input, args.vocab_size, args.output, text_key=args.text_key)
    print(f"wrote {args.output} (byte-level BPE, vocab {tokenizer.get_vocab_size()})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="femtotron", description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)

    train = verbs.add_parser(
        "train",
        help="train a model from a YAML config; starts the dp*cp*tp*pp processes "
        "itself, or runs as one rank under torchrun",
    )
    train.add_argument("config", help="YAML config, e.g. examples/debug.yaml")
    train.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. tokens.train_steps=50 parallelism.dp=2"
    )
    train.add_argument(
        "--debug",
        action="store_true",
        help="set NCCL_DEBUG=INFO and TORCH_DISTRIBUTED_DEBUG=DETAIL before init",
    )
    train.set_defaults(run=cmd_train)

    check = verbs.add_parser(
        "check-tp",
        help="run one batch at tp=1 and at tp=N from the same weights and name the first module whose "
        "output or gradient differs; starts the tp processes itself, or runs as one rank under torchrun",
    )
    check.add_argument("config", help="YAML config, e.g. examples/debug.yaml")
    check.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. parallelism.tp_mode=REDUCE_SCATTER"
    )
    check.add_argument(
        "--tp", type=int, default=None, help="the tp to check (default: the config's parallelism.tp)"
    )
    check.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="largest allowed max|tp - ref| / max|ref| (default 1e-4 for float32, 3e-2 for bfloat16)",
    )
    check.set_defaults(run=cmd_check_tp)

    gen = verbs.add_parser("generate", help="sample text from a finished run")
    gen.add_argument("run_dir", help="the run directory (logging.output_dir/general.run), e.g. runs/debug")
    gen.add_argument("--prompt", default="", help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(run=cmd_generate)

    doc = verbs.add_parser(
        "doctor",
        help="check a config without launching: rules, world size, stage map, "
        "communication, and memory per rank against the device",
    )
    doc.add_argument("config", help="YAML config, e.g. examples/llama_8b_gpu.yaml")
    doc.add_argument("overrides", nargs="*", help="dotted overrides, e.g. tokens.micro_batch_size=2")
    doc.add_argument(
        "--world-size", type=int, default=None, help="the number of processes you will launch (L1)"
    )
    where = doc.add_mutually_exclusive_group()
    where.add_argument(
        "--device", default=None, help="H100, H200, A100-80GB, A100-40GB, L40S, V100-32GB or CPU"
    )
    where.add_argument("--device-memory", type=float, default=None, help="GiB per device")
    doc.add_argument("--gpus-per-node", type=int, default=8, help="for the tp-within-a-node check (T3)")
    doc.set_defaults(run=cmd_doctor)

    ins = verbs.add_parser(
        "inspect-data",
        help="a config: decode the first training samples, with the positions that count in the loss; a data "
        "source: its documents, tokens, length histogram and first document",
    )
    ins.add_argument(
        "source",
        help="YAML config (e.g. examples/debug.yaml), or data: a .bin/.idx prefix, a directory of pairs, a "
        "datatrove folder, or raw text as preprocess reads it",
    )
    ins.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.dataset_folder=other/prefix")
    ins.add_argument("--n", type=int, default=3, help="how many samples")
    ins.add_argument("--tokenizer", default=None, help="data source: decode with it (raw text: count tokens)")
    ins.set_defaults(run=cmd_inspect_data)

    conv = verbs.add_parser(
        "convert-config", help="translate a nanotron config into femtotron's keys (docs/nanotron.md)"
    )
    conv.add_argument("config", help="a nanotron YAML config")
    conv.add_argument("-o", "--out", default=None, help="the femtotron YAML to write (default: print it)")
    conv.set_defaults(run=cmd_convert_config)

    re = verbs.add_parser("reshard", help="rewrite a checkpoint for another mesh (one process, no cluster)")
    re.add_argument("checkpoint", help="a step-NNNNNNN checkpoint, or a checkpoints directory (its latest)")
    re.add_argument(
        "--out", required=True, help="the checkpoints directory to write step-NNNNNNN and latest into"
    )
    for key in mesh_options():
        re.add_argument(
            f"--{key}", type=int, default=None, help=f"the new parallelism.{key} (default: as saved)"
        )
    re.add_argument(
        "overrides",
        nargs="*",
        help="more dotted overrides, e.g. parallelism.pp_engine=afab optimizer.zero_stage=1",
    )
    re.set_defaults(run=cmd_reshard)

    con = verbs.add_parser("consolidate", help="write a checkpoint's weights at full shape, with its config")
    con.add_argument("checkpoint", help="a step-NNNNNNN checkpoint, or a checkpoints directory (its latest)")
    con.add_argument("--out", required=True, help="directory for model.safetensors and config.yaml")
    con.add_argument(
        "--with-optimizer",
        action="store_true",
        help="also optimizer.safetensors: fp32 master weights and Adam moments at full shape",
    )
    con.set_defaults(run=cmd_consolidate)

    imp = verbs.add_parser("import-hf", help="a run directory from a Hugging Face Llama directory")
    imp.add_argument(
        "hf_dir", help="config.json with model.safetensors or sharded safetensors and their index"
    )
    imp.add_argument("--out", required=True, help="the run directory to write (femtotron generate reads it)")
    imp.set_defaults(run=cmd_import_hf)

    exp = verbs.add_parser("export-hf", help="a Hugging Face Llama directory from a run or a checkpoint")
    exp.add_argument("source", help="a run directory, a step-NNNNNNN checkpoint, or a checkpoints directory")
    exp.add_argument("--out", required=True, help="the directory transformers' from_pretrained reads")
    exp.add_argument(
        "--dtype", choices=("bfloat16", "float32", "float16"), help="default: the run's model.dtype"
    )
    exp.add_argument("--shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    exp.set_defaults(run=cmd_export_hf)

    plot = verbs.add_parser(
        "plot", help="PNGs of loss, learning rate, grad norm, tokens/s, MFU and memory against step"
    )
    plot.add_argument("run_dirs", nargs="+", help="run directories (their metrics.jsonl), overlaid")
    plot.add_argument("--out", default=None, help="directory for the PNGs (default: FIRST_RUN_DIR/plots)")
    plot.set_defaults(run=cmd_plot)

    pre = verbs.add_parser(
        "preprocess",
        help="tokenize text (.jsonl[.gz|.zst], .parquet, .txt/.md, a datasets directory) into .bin/.idx or "
        "datatrove .ds files",
    )
    pre.add_argument(
        "--input",
        required=True,
        nargs="+",
        help=".jsonl, .jsonl.gz, .jsonl.zst (one document per line), .parquet (a column), .txt or .md (one "
        "document, or --blocks), a directory of them, a Hugging Face datasets directory (save_to_disk), or a "
        "glob ('shards/*.parquet'); several are read one after the other",
    )
    pre.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer.json")
    pre.add_argument(
        "--output-prefix",
        required=True,
        help="writes PREFIX.bin and PREFIX.idx (datatrove: PREFIX.ds, .ds.index)",
    )
    pre.add_argument(
        "--format",
        choices=("megatron", "datatrove"),
        default="megatron",
        help="megatron: .bin/.idx; datatrove: .ds + .ds.index, as datatrove writes and nanotron reads",
    )
    pre.add_argument(
        "--workers",
        type=int,
        default=None,
        help="tokenizing processes (default: the CPUs this process may use)",
    )
    pre.add_argument("--text-key", default="text", help="the JSON field or column holding the text")
    pre.add_argument(
        "--blocks",
        action="store_true",
        help=".txt/.md: a document per blank-line separated block, not per file",
    )
    pre.add_argument(
        "--shard-size",
        default=None,
        help="write a directory PREFIX/ of pairs of at most this much token data each (e.g. 1GB), read as "
        "one dataset; default: one pair",
    )
    pre.add_argument(
        "--skip-bad-records",
        action="store_true",
        help="count and pass over malformed records (bad JSON, no text, too long) instead of stopping",
    )
    pre.set_defaults(run=cmd_preprocess)

    tok = verbs.add_parser("train-tokenizer", help="fit a byte-level BPE tokenizer on a corpus")
    tok.add_argument("--input", required=True, nargs="+", help=".jsonl, .jsonl.gz or .txt files")
    tok.add_argument("--vocab-size", type=int, required=True)
    tok.add_argument("--output", required=True, help="where to write tokenizer.json")
    tok.add_argument("--text-key", default="text", help="JSON field holding the text")
    tok.set_defaults(run=cmd_train_tokenizer)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse stops filling `overrides` at the first option, so `train CONFIG --debug a=1` would leave
    # a=1 over; overrides are accepted anywhere after the verb.
    if extra and hasattr(args, "overrides") and not any(arg.startswith("-") for arg in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from femtotron.launch import adopt_slurm_environment

    if adopt_slurm_environment(os.environ) and os.environ["RANK"] == "0":
        print(
            f"femtotron: Slurm task 0 of {os.environ['WORLD_SIZE']}; rendezvous at "
            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            file=sys.stderr,
        )
    try:
        # A verb returns an exit code only when it has one to pass on (the local launcher's).
        return args.run(args) or 0
    except FemtotronError as e:
        # Every rank checks the config (or stops on a signal) alike; one copy of the message is enough.
        if not e.same_on_every_rank or os.environ.get("RANK", "0") == "0":
            print(f"femtotron: {e.heading}: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # a path the user gave that cannot be read or written
        where = f": {e.filename}" if e.filename else ""
        print(f"femtotron: error: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside training's loop, where it saves (stop_signals.py)
        if os.environ.get("RANK", "0") == "0":
            print("femtotron: stopped by Ctrl-C", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
