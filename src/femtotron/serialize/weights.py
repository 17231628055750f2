"""A finished run's weights: full-shape safetensors in the run directory, with its config and tokenizer.

    RUN_DIR/
      config.yaml          the run's config
      model.safetensors    every weight at full shape (after pipeline-parallel training one file per
                           stage instead, model-pp00-of-02.safetensors ...)
      model-parts.json     which files hold the weights, at any pp (a pp = 1 run replaces the list an
                           earlier pp run in the directory left)
      tokenizer.json       the tokenizer, so the directory is self-contained

Written by `femtotron train` at the end or `femtotron consolidate`; read by `femtotron generate`.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from femtotron.atomic import atomic_path, remove, remove_stale, temporary_name
from femtotron.config import Config, LlamaConfig, load_config
from femtotron.crash_points import crash_point
from femtotron.errors import FemtotronError, PathError, UsageError
from femtotron.models.llama import Llama
from femtotron.parallel.tensor_parallel import full_tensor

if TYPE_CHECKING:
    from femtotron.layout import RankModel
    from femtotron.parallel.context import ParallelContext
    from femtotron.run_log import RunLog

WEIGHTS_FILE = "model.safetensors"
PARTS_FILE = "model-parts.json"  # which safetensors files hold the weights (one per pp stage)
CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"
# The files femtotron writes into an output directory (run or HF): one of an earlier write that a new one
# does not write again is stale (another shard layout, no tokenizer this time) and is removed.
OUTPUTS = ("model*.safetensors", "model*.json", "optimizer.safetensors", "tokenizer*.json")
LAYER = re.compile(r"layers\.(\d+)\.")
TRAINED = {"written_by": "femtotron train"}  # the metadata of the weights a training run saves


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
    for index, (name, param) in enumerate(model.named_parameters()):
        with model.whole_parameters([index]):  # ZeRO-3: gathered one bucket at a time
            full = full_tensor(param, param.shard, model.tp, model.ep.group)
            if writer:  # a copy: ZeRO-3 frees the gathered parameter as the block ends
                weights[name] = full.to("cpu", copy=True).contiguous()
    parts = [WEIGHTS_FILE]
    if ctx.pp > 1:
        parts = [f"model-pp{p:02d}-of-{ctx.pp:02d}.safetensors" for p in range(ctx.pp)]
    if writer:
        own_part = parts[ctx.pp_rank] if ctx.pp > 1 else parts[0]
        with atomic_path(run_dir / own_part) as tmp:
            save_file(weights, tmp, metadata=TRAINED)
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
            raise PathError(
                f"{path} does not exist: {run_dir} is not a finished training run. Train first "
                "(`femtotron train CONFIG`); the run directory is logging.output_dir/general.run."
            )
    return parts


def load_weights(run_dir: Path, device: str = "cpu") -> tuple[Config, dict[str, torch.Tensor]]:
    """A run directory's config and full-shape weights by parameter name, their shapes checked against the
    config from the files' headers before any tensor is read or any model built."""
    parts = weight_parts(run_dir)
    config = load_config(run_dir / CONFIG_FILE)
    handles = {}
    try:
        for part in parts:  # a tied embedding appears in the first and the last stage's part: equal
            opened = safe_open(str(run_dir / part), framework="pt", device=device)
            handles.update(dict.fromkeys(opened.keys(), opened))
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name, f in handles.items()}
        problem = shape_problem(
            config.model.model_config_, shapes, f"the weights in {run_dir}", "config.yaml"
        )
        if problem:
            raise FemtotronError(
                f"{problem}: {run_dir / CONFIG_FILE} and the weights are from different models."
            )
        return config, {name: f.get_tensor(name) for name, f in handles.items()}
    except SafetensorError as e:
        raise FemtotronError(
            f"the weights in {run_dir} ({', '.join(parts)}) cannot be read: {str(e).splitlines()[0]}. "
            "Re-run the training that wrote them."
        ) from None


def shape_problem(
    cfg: LlamaConfig,
    shapes: dict[str, tuple[int, ...]],
    where: str,
    config_name: str,
    to_names: Callable[[dict[str, torch.Tensor], LlamaConfig], dict[str, torch.Tensor]] | None = None,
) -> str | None:
    """What differs between the tensors `cfg` makes (named by `to_names`, default femtotron's own) and
    `shapes`, read from the files' headers; None if nothing. The layers are counted first and one layer is
    built on the meta device, so a config far larger than its weights (a million layers) costs nothing."""
    layers = {int(found.group(1)) for name in shapes if (found := LAYER.search(name))}
    if layers != set(range(cfg.num_hidden_layers)):
        count = cfg.num_hidden_layers
        return f"{config_name} has num_hidden_layers={count}, but {where} hold {len(layers)} layers"
    # A config's sizes are bounded (config/rules.py, MAX_TENSOR_ELEMENTS): the meta tensors cannot overflow.
    expected = expected_shapes(cfg, to_names)
    missing = sorted(set(expected) - set(shapes))
    if missing:
        return f"{where} lack {len(missing)} tensor(s) {config_name} needs: {', '.join(missing[:5])}"
    for name, shape in shapes.items():
        if name not in expected:
            return f"{where} hold {name}, which the model {config_name} describes does not have"
        if shape != expected[name]:
            return f"{name} in {where} has shape {shape}, but {config_name} makes it {expected[name]}"
    return None


def expected_shapes(
    cfg: LlamaConfig,
    to_names: Callable[[dict[str, torch.Tensor], LlamaConfig], dict[str, torch.Tensor]] | None,
) -> dict[str, tuple[int, ...]]:
    """Every weight's shape for `cfg`: layer 0's, of a one-layer model on the meta device, for every layer;
    with dense layers among experts, of a two-layer model whose layer 0 has experts and layer 1 not."""
    mixed = 0 < cfg.moe_layer_count < cfg.num_hidden_layers
    sample = cfg.model_copy(update={"num_hidden_layers": 1})
    if mixed:
        dense_second = cfg.moe.model_copy(update={"dense_layers": [1]})
        sample = cfg.model_copy(update={"num_hidden_layers": 2, "moe": dense_second})
    state = Llama(sample, std=0.02, seed=0, dtype=torch.float32, device=torch.device("meta")).state_dict()
    shapes = {}
    for name, tensor in (to_names(state, sample) if to_names else state).items():
        found = LAYER.search(name)
        if found is None:
            shapes[name] = tuple(tensor.shape)
            continue
        for layer in range(cfg.num_hidden_layers):
            sample_layer = 1 if mixed and not cfg.has_experts(layer) else 0
            if int(found.group(1)) == sample_layer:
                shapes[LAYER.sub(f"layers.{layer}.", name, count=1)] = tuple(tensor.shape)
    return shapes


@contextmanager
def staged_outputs(out: Path, marker: str, source: Path) -> Iterator[Path]:
    """A directory to write `out`'s new files in, read from `source`; on success they replace `out`'s. A
    reader never takes new weights beside an old config: `marker`, the file readers require (config.yaml,
    config.json), is removed first and moved in last, and outputs of an earlier write that this one does
    not write are removed. What a killed earlier write left in `out` (`*.tmp<PID>`) is removed first,
    saying so."""
    if out.resolve() == source.resolve():
        raise UsageError(f"--out {out} is the directory read from: choose another --out.")
    out.mkdir(parents=True, exist_ok=True)
    for path in remove_stale(out):
        print(f"femtotron: removed {path}, left by an earlier run that was killed", file=sys.stderr)
    staging = Path(temporary_name(out / ".staging"))
    remove(staging)  # a link planted under this process's name: not written through
    staging.mkdir()
    try:
        yield staging
        new = sorted(path.name for path in staging.iterdir())
        remove(out / marker)
        for old in (path for pattern in OUTPUTS for path in out.glob(pattern)):
            if old.name not in new:
                remove(old)
        for name in sorted(new, key=lambda name: name == marker):  # the marker last
            os.replace(staging / name, out / name)  # replaces a link at out / name, never follows it
            crash_point("outputs.moved_one")
    finally:
        remove(staging)


def check_own_weights(run_dir: Path) -> None:
    """A run saves its weights into its run directory at the end: refuse to start one where weights it did
    not produce lie (written by `import-hf` or `consolidate`, or an HF model's), before anything is
    written. Weights without metadata are an earlier femtotron training run's."""
    for path in sorted(run_dir.glob("model*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as opened:
                metadata = opened.metadata()
        except (SafetensorError, OSError):
            metadata = {"unreadable": "yes"}
        if metadata is None or metadata.get("written_by") == TRAINED["written_by"]:
            continue
        origin = "not written by a run here"
        if "source" in metadata:
            origin = f"imported from {metadata['source']}"
        raise UsageError(
            f"{path} holds weights this run did not produce ({origin}): training in {run_dir} would "
            "overwrite them when it ends. To start from them, train in a run directory of its own: "
            f"model.init_from={run_dir} general.run=NEW_NAME (or another logging.output_dir)."
        )


def weights_present(run_dir: Path) -> bool:
    """Whether `run_dir` holds its config and every weight file its parts list names (a finished run's)."""
    try:
        return bool(weight_parts(run_dir))
    except (FemtotronError, OSError):
        return False
