"""A finished run's weights: full-shape safetensors in the run directory, with its config and tokenizer.

    RUN_DIR/
      config.yaml          the run's config
      model.safetensors    every weight at full shape (after pipeline-parallel training one file per
                           stage instead, model-pp00-of-02.safetensors ...)
      model-parts.json     which files hold the weights
      tokenizer.json       the tokenizer, so the directory is self-contained

Written by `femtotron train` at the end or `femtotron consolidate`; read by `femtotron generate`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from femtotron.atomic import atomic_path
from femtotron.config import Config, load_config
from femtotron.errors import FemtotronError
from femtotron.parallel.tensor_parallel import full_tensor

if TYPE_CHECKING:
    from femtotron.layout import RankModel
    from femtotron.parallel.context import ParallelContext
    from femtotron.run_log import RunLog

WEIGHTS_FILE = "model.safetensors"
PARTS_FILE = "model-parts.json"  # which safetensors files hold the weights (one per pp stage)
CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"


def write_config(run_dir: Path, config: dict) -> None:
    with atomic_path(run_dir / CONFIG_FILE) as tmp:
        Path(tmp).write_text(yaml.safe_dump(config, sort_keys=False))


def write_tokenizer(run_dir: Path, tokenizer: Tokenizer | None) -> None:
    if tokenizer is not None:
        with atomic_path(run_dir / TOKENIZER_FILE) as tmp:
            tokenizer.save(tmp)


def write_parts(run_dir: Path, parts: list[str]) -> None:
    """Replaces the list of an earlier run in the same directory (a pp run's parts, say)."""
    with atomic_path(run_dir / PARTS_FILE) as tmp:
        Path(tmp).write_text(json.dumps({"parts": parts}))


def save_weights(ctx: ParallelContext, model: RankModel, run_dir: Path, log: RunLog) -> Path:
    """Full-shape weights, gathered over tp (and experts over ep). With pp > 1 each stage writes its own part
    (no stage holds all the weights) and rank 0 lists them in model-parts.json."""
    # One rank per stage writes: the first of its data, context and tensor parallel ranks.
    writer = ctx.dp_rank == ctx.cp_rank == ctx.tp_rank == 0
    weights = {}
    # Every rank takes part in the gathers; only the writer keeps what they return.
    for name, param in model.named_parameters():
        full = full_tensor(param, param.shard, model.tp, model.ep.group)
        if writer:
            weights[name] = full.cpu().contiguous()
    parts = [WEIGHTS_FILE]
    if ctx.pp > 1:
        parts = [f"model-pp{p:02d}-of-{ctx.pp:02d}.safetensors" for p in range(ctx.pp)]
    if writer:
        own_part = parts[ctx.pp_rank] if ctx.pp > 1 else parts[0]
        with atomic_path(run_dir / own_part) as tmp:
            save_file(weights, tmp)
    ctx.comm.barrier(ctx.mp_group)  # rank 0's model-parallel group holds every writer
    if ctx.rank == 0:
        write_parts(run_dir, parts)
        more = f" and {len(parts) - 1} more parts" if len(parts) > 1 else ""
        log.info(f"saved weights to {run_dir / parts[0]}{more}")
    return run_dir / parts[0]


def weight_parts(run_dir: Path) -> list[str]:
    """The safetensors files holding a finished run's weights (model-parts.json, or model.safetensors), each
    checked to exist, as is config.yaml."""
    parts_path = run_dir / PARTS_FILE
    try:
        parts = json.loads(parts_path.read_text())["parts"] if parts_path.is_file() else [WEIGHTS_FILE]
    except (ValueError, KeyError, TypeError):
        raise FemtotronError(
            f"{parts_path} is not a list of weight files: re-run the training that wrote it."
        ) from None
    for path in (run_dir / CONFIG_FILE, *(run_dir / part for part in parts)):
        if not path.is_file():
            raise FemtotronError(
                f"{path} does not exist: {run_dir} is not a finished training run. Train first "
                "(`femtotron train CONFIG`); the run directory is logging.output_dir/general.run."
            )
    return parts


def load_weights(run_dir: Path, device: str = "cpu") -> tuple[Config, dict[str, torch.Tensor]]:
    """A run directory's config and full-shape weights by parameter name."""
    parts = weight_parts(run_dir)
    weights: dict[str, torch.Tensor] = {}
    try:
        for part in parts:  # a tied embedding appears in the first and the last stage's part: equal
            weights.update(load_file(str(run_dir / part), device=device))
    except SafetensorError as e:
        raise FemtotronError(
            f"the weights in {run_dir} ({', '.join(parts)}) cannot be read: {str(e).splitlines()[0]}. "
            "Re-run the training that wrote them."
        ) from None
    return load_config(run_dir / CONFIG_FILE), weights


def weights_present(run_dir: Path) -> bool:
    """Whether `run_dir` holds its config and every weight file its parts list names (a finished run's)."""
    try:
        return bool(weight_parts(run_dir))
    except (FemtotronError, OSError):
        return False
