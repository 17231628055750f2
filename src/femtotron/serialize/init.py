"""`model.init_from`: a run's first weights from another model, at any mesh and ZeRO stage.

PATH is a Hugging Face Llama directory (config.json), a finished run directory (config.yaml and its
safetensors), or a checkpoint (a step directory, or a checkpoints directory: its newest). Each rank reads
only the weights' boxes it holds (serialize/restore.py `fill`, as resuming does); the run still starts
at step 0, with a fresh optimizer and schedule.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from femtotron.config import Config, LlamaConfig, load_config
from femtotron.errors import ConfigError
from femtotron.models.hf_conversion import disk_rows
from femtotron.models.llama import Llama
from femtotron.serialize.files import CheckpointReader
from femtotron.serialize.geometry import Box
from femtotron.serialize.hf import HF_CONFIG, open_hf
from femtotron.serialize.restore import MODEL_FIELDS, fill_parameters, model_differences
from femtotron.serialize.resume_source import resolve
from femtotron.serialize.weights import CONFIG_FILE, weight_parts

if TYPE_CHECKING:
    from femtotron.layout import RankModel

WHAT = "model.init_from"


class HFFiles:
    """An HF directory's safetensors, read box by box under femtotron's names: a fused weight's box is
    gathered from the rows of q/k/v (or gate/up) it covers (models/hf_conversion.py has the layouts)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        opened = open_hf(directory)
        self.cfg = opened.cfg
        self.family = opened.family
        self.handles = opened.handles
        meta = Llama(self.cfg, std=0.02, seed=0, dtype=torch.float32, device=torch.device("meta"))
        self.shapes = {name: tuple(t.shape) for name, t in meta.state_dict().items()}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def _rows(self, name: str, low: int, high: int, columns: slice | None) -> torch.Tensor:
        """Rows [low, high) of HF's tensor `name` (the `columns` of each; None: a vector)."""
        disk_name, first = disk_rows(name, self.cfg, self.family)
        rows = self.handles[disk_name].get_slice(disk_name)
        return (
            rows[first + low : first + high] if columns is None else rows[first + low : first + high, columns]
        )

    def read(self, name: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        return copied_into(out, self._assemble(name, box))

    def _assemble(self, name: str, box: Box) -> torch.Tensor:
        starts, stops = box
        # The HF name of the module holding `name`, e.g. model.layers.3.self_attn.
        prefix = "model." + name.rsplit(".", 2)[0] + "."
        kind = name.rsplit(".", 1)[1]  # weight, or bias
        columns = slice(starts[-1], stops[-1]) if len(starts) > 1 else None
        if ".mlp.experts." in name or ".mlp.router." in name:  # per expert in HF: w1/w3/w2 or gate/up/down
            block, gate, up, down = self.family.experts
            layer = f"model.{name.split('.mlp.')[0]}.{block}."
            if name.endswith("router.weight"):
                return self._rows(layer + "gate.weight", starts[0], stops[0], columns)
            each = layer + "experts.{}.{}.weight"  # formatted with the expert's index and its role
            experts = range(starts[0], stops[0])
            if name.endswith("down_proj"):
                return torch.stack(
                    [self._rows(each.format(e, down), starts[1], stops[1], columns) for e in experts]
                )
            roles = [gate, up][starts[1] : stops[1]]
            rows = [
                [self._rows(each.format(e, r), starts[2], stops[2], columns) for r in roles] for e in experts
            ]
            return torch.stack([torch.stack(pair) for pair in rows])
        if name.endswith("gate_up_proj.weight"):  # (2, inner, hidden): gate, then up
            parts = [prefix + "gate_proj.weight", prefix + "up_proj.weight"][starts[0] : stops[0]]
            return torch.stack([self._rows(part, starts[1], stops[1], columns) for part in parts])
        if ".self_attn.qkv_proj." not in name:
            hf_name = name if name == "lm_head.weight" else "model." + name
            return self._rows(hf_name, starts[0], stops[0], columns)
        # Per key/value head: its group of query rows, then its key rows, then its value rows.
        group = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        head = self.cfg.head_dim
        pieces = []
        for row in range(starts[0] - starts[0] % head, stops[0], head):  # one head's rows at a time
            kv, part = divmod(row // head, group + 2)
            # `first`: the row of HF's q, k or v weight where this head starts.
            if part < group:
                hf_name = f"{prefix}q_proj.{kind}"
                first = (kv * group + part) * head
            elif part == group:
                hf_name = f"{prefix}k_proj.{kind}"
                first = kv * head
            else:
                hf_name = f"{prefix}v_proj.{kind}"
                first = kv * head
            # The part of this head's rows that the box asks for.
            low = max(row, starts[0]) - row
            high = min(row + head, stops[0]) - row
            pieces.append(self._rows(hf_name, first + low, first + high, columns))
        return torch.cat(pieces)


class RunFiles:
    """A run directory's safetensors files, read box by box."""

    def __init__(self, directory: Path) -> None:
        parts = weight_parts(directory)
        self.directory = directory
        self.files = [safe_open(str(directory / p), framework="pt") for p in parts]
        self.where = {name: f for f in self.files for name in f.keys()}  # noqa: SIM118 - not a dict

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name].get_slice(name).get_shape())

    def read(self, name: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        return copied_into(out, self.where[name].get_slice(name)[tuple(map(slice, *box))])


class CheckpointWeights:
    """A checkpoint's weights: the fp32 master weights where it has them, else the model's."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self.directory = reader.directory

    def _key(self, name: str) -> str:
        return f"master/{name}" if self.reader.has(f"master/{name}") else f"model/{name}"

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader.shape(self._key(name))

    def read(self, name: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.reader.read(self._key(name), box, out)


def copied_into(out: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """`values`, copied into `out` when a reader was given one (as CheckpointReader.read does)."""
    if out is None:
        return values
    out.copy_(values)
    return out


def source_of(path: Path) -> tuple[LlamaConfig, Any]:
    """The model config at `path` and a reader of its weights by femtotron name."""
    if not path.exists():
        raise ConfigError(
            f"{WHAT}={path} does not exist: give an HF model directory, a run directory or a checkpoint."
        )
    if (path / HF_CONFIG).is_file() and not (path / CONFIG_FILE).is_file():
        source = HFFiles(path)
        return source.cfg, source
    if (path / CONFIG_FILE).is_file():
        return load_config(path / CONFIG_FILE).model.model_config_, RunFiles(path)
    directory, _ = resolve(path, WHAT)
    reader = CheckpointReader(directory)
    return LlamaConfig(**reader.manifest["config"]["model"]["model_config"]), CheckpointWeights(reader)


def init_weights(model: RankModel, config: Config) -> str:
    """Fill this rank's parameters from `model.init_from`; a line for the log."""
    path = Path(config.model.init_from)
    source_cfg, source = source_of(path)
    fields = (*MODEL_FIELDS, "max_position_embeddings", "rope_theta", "rope_scaling", "rms_norm_eps")
    wrong = model_differences(source_cfg.model_dump(mode="json"), config, "source", fields)
    if wrong:
        lines = "".join(f"\n  - {line}" for line in wrong)
        raise ConfigError(f"{WHAT}={path} is another model:{lines}\nSet these fields as the source has them.")
    with torch.no_grad():
        fill_parameters(model, source, lambda name: name)
    return f"initialised the weights from {path} ({WHAT}); the run starts at step 0 with a fresh optimizer"
