"""Hugging Face model directories in and out: `femtotron import-hf` and `femtotron export-hf`.

    HF_DIR/                          what `save_pretrained` of a family in models/families.py
      config.json                    (Llama, Mistral, Qwen2/3, SmolLM3, Granite, Phi-3, Mixtral,
                                     Qwen2/3-MoE) writes: the model's hyper-parameters
      generation_config.json         the ids generation stops at
      model.safetensors              or model-00001-of-0000N.safetensors ... with
      model.safetensors.index.json   which file holds which tensor
      tokenizer.json, tokenizer_config.json

What a family's config.json keys mean is models/families.py's; the names, and the fused weights, are mapped
by models/hf_conversion.py. Only safetensors are read:
`.bin` and `.pt` files are pickles, and loading one can run any code.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from femtotron.atomic import atomic_path, copy_file, remove, temporary_name
from femtotron.config import Config, LlamaConfig, load_config_dict
from femtotron.config.rules import MAX_LAYERS, model_tensor_too_large
from femtotron.data.tokenizer import load_tokenizer
from femtotron.errors import ConfigError, FemtotronError, PathError
from femtotron.layout import DTYPES
from femtotron.models.families import (
    BY_ARCHITECTURE,
    BY_MODEL_TYPE,
    FIELDS,
    REFUSED,
    Family,
    family_of,
)
from femtotron.models.hf_conversion import from_hf, to_hf
from femtotron.serialize.weights import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    load_weights,
    shape_problem,
    staged_outputs,
    write_config,
    write_parts,
)

HF_CONFIG = "config.json"
INDEX = "model.safetensors.index.json"  # which file holds which tensor, when the weights are split
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class HFError(FemtotronError):
    """A Hugging Face directory femtotron cannot read (exit 2, like a bad config)."""

    exit_code = 2


def family_in(hf: dict[str, Any], where: Path) -> Family:
    """The family config.json names by its "architectures" (or, without them, its "model_type")."""
    architectures = hf.get("architectures") or []
    named = [BY_ARCHITECTURE.get(name) for name in architectures]
    if not architectures and hf.get("model_type") in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[hf["model_type"]]
    if len(named) == 1 and named[0] is not None:
        return named[0]
    reasons = [f"{name}: {REFUSED[name]}" for name in architectures if name in REFUSED]
    if not reasons:
        named_as = architectures or hf.get("model_type")
        reasons = [f"architectures={named_as}: {', '.join(BY_ARCHITECTURE)} are supported"]
    raise HFError(f"{where} describes a model femtotron cannot load:\n  - " + "\n  - ".join(reasons))


def llama_config(hf: dict[str, Any], where: Path) -> tuple[LlamaConfig, Family]:
    """LlamaConfig from an HF config.json's contents, and its family; what femtotron's Llama does not compute
    is refused, each thing named."""
    family = family_in(hf, where)
    layers = hf.get("num_hidden_layers")
    if layers is not None and not (isinstance(layers, int) and 1 <= layers <= MAX_LAYERS):
        # before anything counts the layers: the families' readers go through them one by one
        raise HFError(
            f"{where} has num_hidden_layers={layers!r}: a whole number from 1 to {MAX_LAYERS} (the largest "
            "models have about 130). Check the file's source, or re-save the model with save_pretrained"
        )
    problems = [
        f"{key}={hf[key]!r}: femtotron's model has none (needs {off!r})"
        for key, off in family.not_used.items()
        if hf.get(key, off) != off
    ]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        problems.append(f"rope type {kind!r} (rope_parameters / rope_scaling): plain RoPE and llama3 only")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append("partial_rotary_factor: femtotron's RoPE rotates the whole head")
    values = {key: hf[key] for key in FIELDS if hf.get(key) is not None}
    sliding = family.sliding(hf)
    if sliding:
        values["sliding_window"] = hf["sliding_window"]
        values["full_attention_layers"] = [i for i in range(hf["num_hidden_layers"]) if i not in sliding]
    try:
        values |= family.read(hf)
    except ConfigError as e:
        problems.append(str(e))
    values["rope_theta"] = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if kind == "llama3":
        values["rope_scaling"] = {key: rope[key] for key in SCALING if key in rope}
    if problems:
        raise HFError(f"{where} describes a model femtotron cannot load:\n  - " + "\n  - ".join(problems))
    try:
        cfg = LlamaConfig(**values)
    except ValidationError as e:
        wrong = [f"{'.'.join(map(str, err['loc']))}={err['input']!r}: {err['msg']}" for err in e.errors()]
        raise HFError(
            f"{where} holds values femtotron's Llama cannot take: {'; '.join(wrong)}. Check the file's "
            "source, or re-save the model with save_pretrained"
        ) from None
    too_large = model_tensor_too_large(cfg, prefix="")
    if too_large is not None:
        raise HFError(f"{where}: {too_large.message}")
    return cfg, family


@dataclass(frozen=True)
class OpenedHF:
    """An HF model directory, checked and open (`open_hf`)."""

    cfg: LlamaConfig  # femtotron's model config for it
    family: Family
    config_json: dict[str, Any]  # its config.json as read
    handles: dict[str, Any]  # by HF tensor name, the open safetensors file holding it


def open_hf(hf_dir: Path) -> OpenedHF:
    """An HF Llama directory's config, its config.json and its open safetensors files: names, shapes and
    dtypes checked against the config from the headers, no tensor read."""
    config_path = hf_dir / HF_CONFIG
    if not config_path.is_file():
        raise PathError(f"{config_path} does not exist: {hf_dir} is not a Hugging Face model directory.")
    inside(hf_dir, HF_CONFIG)
    try:
        hf = json.loads(config_path.read_text())
    except (ValueError, RecursionError) as e:
        raise HFError(f"{config_path} is not JSON ({type(e).__name__}: {e}): re-save the model") from None
    if not isinstance(hf, dict):
        raise HFError(
            f"{config_path} holds a JSON {type(hf).__name__}, not an object of the model's settings "
            '({"architectures": [...], "hidden_size": ...}): re-save the model with save_pretrained'
        )
    cfg, family = llama_config(hf, config_path)
    handles: dict[str, Any] = {}
    for file, names in _weight_files(hf_dir).items():
        try:
            f = safe_open(str(inside(hf_dir, file)), framework="pt")
        except (SafetensorError, OSError, TypeError) as e:
            raise HFError(
                f"{hf_dir / file} cannot be read as safetensors: {str(e).splitlines()[0]}"
            ) from None
        # Older exports saved RoPE's frequencies, which are computed.
        handles.update({name: f for name in names or f.keys() if "rotary_emb" not in name})  # noqa: SIM118
    if cfg.tie_word_embeddings:
        handles.pop("lm_head.weight", None)
    shapes = {name: tuple(f.get_slice(name).get_shape()) for name, f in handles.items()}
    problem = shape_problem(cfg, shapes, str(hf_dir), HF_CONFIG, functools.partial(to_hf, family=family))
    if problem:
        raise HFError(f"{problem}: the weights and the config are from different models.")
    for name, f in handles.items():
        dtype = f.get_slice(name).get_dtype()
        if dtype not in ("F32", "BF16", "F16"):
            raise HFError(f"{name} in {hf_dir} is {dtype}: only F32, BF16 and F16 are read")
    return OpenedHF(cfg=cfg, family=family, config_json=hf, handles=handles)


def inside(hf_dir: Path, name: str) -> Path:
    """`hf_dir / name`, refused when it, links resolved, is outside `hf_dir` (an absolute name, `..`, a
    link elsewhere): a directory from elsewhere may not have femtotron read, and copy out, other files. In
    the Hugging Face cache, links from snapshots/REVISION/ into the repository's blobs/ are inside."""
    root = hf_dir.resolve()
    if root.parent.name == "snapshots":  # huggingface_hub: REPO/snapshots/REVISION/FILE -> ../../blobs/SHA
        root = root.parent.parent
    path = hf_dir / name
    if not path.resolve().is_relative_to(root):
        raise HFError(
            f"{name} in {hf_dir} is {path.resolve()}, outside {hf_dir}: a model directory may only name its "
            "own files. Copy the file itself into the directory (not a link) if you trust it."
        )
    return path


def _weight_files(hf_dir: Path) -> dict[str, list[str] | None]:
    """The safetensors files to read, with the tensors each holds (None: all of them)."""
    if (hf_dir / INDEX).is_file():
        try:
            weight_map = json.loads(inside(hf_dir, INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError, RecursionError):
            weight_map = None
        if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
            raise HFError(
                f"{hf_dir / INDEX} has no weight_map (tensor name -> file name): re-save the model with "
                "save_pretrained"
            )
        files: dict[str, list[str] | None] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        missing = [file for file in files if not inside(hf_dir, file).is_file()]
        if missing:
            raise HFError(f"{hf_dir / INDEX} lists {', '.join(missing)}, which {hf_dir} does not have.")
        return files
    if (hf_dir / WEIGHTS_FILE).is_file():
        return {WEIGHTS_FILE: None}
    pickles = sorted(p.name for p in hf_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if pickles:
        raise HFError(
            f"{hf_dir} holds its weights as pickles ({', '.join(pickles[:3])}), which femtotron does not "
            "load: loading one can run any code. Convert them once where you trust the file: "
            "`LlamaForCausalLM.from_pretrained(DIR).save_pretrained(OUT)` writes safetensors."
        )
    raise HFError(f"{hf_dir} has no {WEIGHTS_FILE} and no {INDEX}: no weights to read.")


def read_as_run(hf_dir: Path, out: Path | None = None) -> tuple[Config, dict[str, torch.Tensor]]:
    """An HF Llama directory as a run would hold it: the config a run directory at `out` (default: the HF
    directory itself) would have, and the weights by femtotron name. The config, trained, continues from
    those weights (`model.init_from`) in a run directory of its own, `OUT-train` beside `out`: a run
    saves its weights into its run directory, and would overwrite the imported ones."""
    opened = open_hf(hf_dir)
    cfg = opened.cfg
    state = from_hf({name: f.get_tensor(name) for name, f in opened.handles.items()}, cfg, opened.family)
    out = (out or hf_dir).resolve()  # every path in the config absolute: it works from any directory
    dtype = opened.config_json.get("dtype") or opened.config_json.get("torch_dtype") or "float32"
    tokenizer = str(out / TOKENIZER_FILE) if inside(hf_dir, TOKENIZER_FILE).is_file() else None
    config = load_config_dict(
        {
            "general": {"run": f"{out.name}-train"},
            "model": {
                "model_config": cfg.model_dump(),
                "dtype": dtype if dtype in DTYPES else "float32",
                "init_from": str(out),
                "hf_architecture": opened.family.architecture,
            },
            "tokenizer": {
                "tokenizer_name_or_path": tokenizer,
                "add_special_tokens": True,
                "eos_token_ids": _eos_token_ids(hf_dir, opened.config_json),
            },
            "tokens": {"sequence_length": min(cfg.max_position_embeddings, 4096), "train_steps": 1},
            "data": {"dataset_folder": "set data.dataset_folder to your tokenized data to train this model"},
            "logging": {"output_dir": str(out.parent)},
        },
        source=str(hf_dir / HF_CONFIG),
    )
    return config, state


def _eos_token_ids(hf_dir: Path, config_json: dict[str, Any]) -> list[int]:
    """The ids transformers' `generate` stops at: generation_config.json's eos_token_id, else config.json's
    (an id or a list of them; none: the tokenizer's EOS)."""
    path = hf_dir / GENERATION_CONFIG
    eos = None
    if path.is_file():
        try:
            eos = json.loads(inside(hf_dir, GENERATION_CONFIG).read_text()).get("eos_token_id")
        except (ValueError, AttributeError, RecursionError):
            raise HFError(f"{path} is not a JSON object: re-save the model with save_pretrained") from None
    if eos is None:
        eos = config_json.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    return [i for i in ids if isinstance(i, int) and i >= 0]


def import_hf(hf_dir: Path, out: Path) -> Path:
    """A femtotron run directory (config.yaml, model.safetensors, tokenizer.json) from an HF Llama directory;
    `femtotron generate` reads it."""
    config, state = read_as_run(hf_dir, out)
    with staged_outputs(out, CONFIG_FILE, hf_dir) as staging:
        with atomic_path(staging / WEIGHTS_FILE) as tmp:
            save_file(state, tmp, metadata={"source": str(hf_dir)})
        if (hf_dir / TOKENIZER_FILE).is_file():  # inside hf_dir: read_as_run checked
            copy_file(hf_dir / TOKENIZER_FILE, staging / TOKENIZER_FILE)
        if (hf_dir / TOKENIZER_CONFIG).is_file():  # kept for export-hf: the special tokens as they were
            copy_file(inside(hf_dir, TOKENIZER_CONFIG), staging / TOKENIZER_CONFIG)
        write_config(staging, config.to_dict())
        write_parts(staging, [WEIGHTS_FILE])
    return out


def export_hf(source: Path, out: Path, dtype: str | None = None, shard_bytes: int = 5 * 10**9) -> Path:
    """An HF Llama directory from a run directory or a checkpoint saved at any mesh (gathered here)."""
    with staged_outputs(out, HF_CONFIG, source) as staging, _run_directory(source, out) as run_dir:
        _export(run_dir, staging, dtype, shard_bytes)
    return out


@contextmanager
def _run_directory(source: Path, out: Path) -> Iterator[Path]:
    """`source` if it is a run directory; else the checkpoint consolidated into a scratch directory in
    `out` (there, one a killed export left is removed by the next export)."""
    if (source / CONFIG_FILE).is_file():
        yield source
        return
    from femtotron.serialize.offline import consolidate

    scratch = Path(temporary_name(out / ".consolidated"))
    try:
        yield consolidate(source, scratch)
    finally:
        remove(scratch)


def _export(run_dir: Path, out: Path, dtype: str | None, shard_bytes: int) -> None:
    special = _special_tokens(run_dir / TOKENIZER_FILE)  # a bad tokenizer is refused before any write
    tokens = {f"{key}_token_id": token_id for key, (_, token_id) in special.items()}
    config, weights = load_weights(run_dir)
    eos_ids = config.tokenizer.eos_token_ids  # an imported model's, as its generation_config.json had them
    if eos_ids:
        tokens["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    cfg = config.model.model_config_
    dtype = dtype or config.model.dtype
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    family = family_of(cfg, config.model.hf_architecture)
    state = {name: t.to(DTYPES[dtype]).contiguous() for name, t in to_hf(weights, cfg, family).items()}
    shards = _shards(state, shard_bytes)
    for file, names in shards.items():
        with atomic_path(out / file) as tmp:
            save_file({name: state[name] for name in names}, tmp, metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {name: file for file, names in shards.items() for name in names}
        total = sum(t.numel() * t.element_size() for t in state.values())
        _write_json(out / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(out / HF_CONFIG, _hf_config(config, family, dtype, tokens))
    _write_json(out / GENERATION_CONFIG, {"_from_model_config": True, **tokens})
    if not (run_dir / TOKENIZER_FILE).is_file():
        return
    copy_file(run_dir / TOKENIZER_FILE, out / TOKENIZER_FILE)
    if (run_dir / TOKENIZER_CONFIG).is_file():  # an imported model's own, as import-hf copied it
        copy_file(run_dir / TOKENIZER_CONFIG, out / TOKENIZER_CONFIG)
    else:
        # transformers reads the special tokens from here; a Llama has no padding token: eos pads.
        named = {f"{key}_token": token for key, (token, _) in special.items()}
        if "eos" in special:
            named["pad_token"] = special["eos"][0]
        tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **named}
        _write_json(
            out / TOKENIZER_CONFIG,
            {**tokenizer_config, "model_max_length": cfg.max_position_embeddings},
        )


def _shards(state: dict[str, torch.Tensor], shard_bytes: int) -> dict[str, list[str]]:
    """Tensors in HF's order, filled into files of at most `shard_bytes` (a larger tensor alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return {WEIGHTS_FILE: groups[0]}
    return {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": names for i, names in enumerate(groups)}


def _special_tokens(path: Path) -> dict[str, tuple[str, int]]:
    """The tokenizer's bos and eos tokens with their ids, by "bos" / "eos" (none without a tokenizer)."""
    if not path.is_file():
        return {}
    added = load_tokenizer(path).get_added_tokens_decoder()
    special = {t.content: i for i, t in added.items() if t.special}
    found = {}
    for key, pattern in (
        ("bos", r"<s>|<\|begin_of_text\|>|<bos>"),
        ("eos", r"</s>|<\|end_of_text\|>|<\|endoftext\|>|<eos>"),
    ):
        matches = [(token, i) for token, i in special.items() if re.fullmatch(pattern, token)]
        if matches:
            found[key] = matches[0]
    return found


def _hf_config(config: Config, family: Family, dtype: str, tokens: dict[str, int]) -> dict[str, Any]:
    """config.json for the run's model as `family` (models/families.py) spells it."""
    cfg = config.model.model_config_
    scaling = cfg.rope_scaling.model_dump(exclude={"rope_type"}) if cfg.rope_scaling else {}
    kind = "llama3" if scaling else "default"
    return {
        **{key: getattr(cfg, key) for key in FIELDS},
        "architectures": [family.architecture],
        "model_type": family.model_type,
        **family.not_used,  # what femtotron's model does not have, as "not used"
        **family.write(cfg),
        "rope_theta": cfg.rope_theta,  # transformers 4.x reads these two, 5.x rope_parameters
        "rope_scaling": {"rope_type": "llama3", **scaling} if scaling else None,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": kind, **scaling},
        "initializer_range": config.model.init_method.std,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
        # a family's defaults are its real tokenizer's ids (SmolLM3 pads with 128004): none unless known
        **dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id")),
        **tokens,
    }


def _write_json(path: Path, value: dict[str, Any]) -> None:
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(value, indent=2) + "\n")
