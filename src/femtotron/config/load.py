"""YAML (+ command-line overrides) -> Config, reporting every problem at once.

Each problem names its dotted path, where it was set (YAML line or override), the rule or expected type,
the value given, and a fix. Cross-field rules only check fields that parsed: a typo causes no cascade.
"""

from __future__ import annotations

import copy
import difflib
import functools
import sys
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, get_args

import yaml
from pydantic import BaseModel, ValidationError

from femtotron.config.config import SKIP_RULES, Config
from femtotron.config.rules import Problem, raise_problems, rule_problems

# Stand-ins for required fields that are missing or invalid, so the other rules can still be checked.
# Rules that read them are suppressed anyway, because those paths are already reported.
_PLACEHOLDERS = {"tokens.train_steps": 1, "data.seed": 1234}
# The most values (keys, items, scalars) a config may hold once its YAML aliases are expanded. A real one
# holds a few hundred; nested aliases (`&a [*b, *b, ...]`) can reach billions from a few hundred bytes.
MAX_VALUES = 100_000
# The largest config file read, checked before parsing: a real one is a few KiB; PyYAML parses about
# 200 KiB a second, and a device (`/dev/zero`) never ends.
MAX_CONFIG_BYTES = 2**20
INT_TAG = "tag:yaml.org,2002:int"
# Sections only a nanotron config has: it is translated (config/nanotron.py).
NANOTRON_SECTIONS = {"data_stages", "lighteval", "s3_upload", "metrics_logging", "profiler"}
_TOO_DEEP = "nested too deeply to be a config (a few levels of sections are enough)"


def load_config(
    path: str | Path, overrides: Sequence[str] = (), sources: Mapping[str, str] | None = None
) -> Config:
    """Read a YAML config, apply `dotted.path=value` overrides and validate; ConfigError lists every problem.
    `sources`: where overrides not typed as such came from (e.g. {"parallelism.tp=3": "--tp 3"})."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            _fail(
                path,
                f"larger than {MAX_CONFIG_BYTES // 2**20} MiB (rule: a config file is at most "
                f"{MAX_CONFIG_BYTES:,} bytes; a real one is a few KiB): not a config. Check the path",
            )
        text = raw.decode("utf-8")
    except FileNotFoundError:
        example = "e.g. `femtotron train examples/debug.yaml`"
        _fail(path, f"file not found (relative paths start from {Path.cwd()}); check the path, {example}")
    except (OSError, UnicodeDecodeError) as e:
        _fail(path, f"cannot read the file: {e}")
    # safe_load, done in two steps so the node tree (with line numbers) is kept.
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # its reader rejects control characters at once
        node = loader.get_single_node()
        if node is not None:
            _count_values(node, {}, path)  # before anything walks every alias path
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        _fail(path, _yaml_error(e))
    except RecursionError:
        _fail(path, _TOO_DEEP)
    except ValueError as e:  # a date that does not exist (2001-13-45); numbers too long are refused above
        _fail(path, f"a value cannot be read ({e}); quote it to keep it a string")
    finally:
        if loader is not None:
            loader.dispose()
    lines: dict[str, int] = {}
    duplicates = _map_lines(node, "", lines) if node is not None else []
    if is_nanotron(data):  # translated into femtotron's keys, or refused with every reason at once
        from femtotron.config.nanotron import translate_or_fail

        # nanotron's yaml.load keeps a duplicated key's last value: a warning there, not a problem
        translation = translate_or_fail(data, lines, str(path), duplicates)
        data = translation.config
        lines = translation.lines
        duplicates = []
    return _build(
        data,
        source=str(path),
        overrides=overrides,
        lines=lines,
        found=duplicates,
        sources=sources or {},
    )


def is_nanotron(data: Any) -> bool:
    """A section only nanotron's schema has, or its model class flag (config/nanotron.py translates it)."""
    if not isinstance(data, Mapping):
        return False
    model = data.get("model")
    model_config = model.get("model_config") if isinstance(model, Mapping) else None
    flags = {"is_llama_config", "is_qwen2_config", "is_starcoder2_config"}
    return bool(NANOTRON_SECTIONS & data.keys()) or (
        isinstance(model_config, Mapping) and bool(flags & model_config.keys())
    )


def load_config_dict(
    mapping: Mapping[str, Any],
    source: str = "<dict>",
    overrides: Sequence[str] = (),
    sources: Mapping[str, str] | None = None,
) -> Config:
    """Validate an in-memory config (tests, `Config.to_dict()` output, a checkpoint's) exactly like a YAML
    file; `source` names it in messages, `sources` as in `load_config`."""
    return _build(mapping, source=source, overrides=overrides, lines={}, found=[], sources=sources or {})


def _fail(path: Path, message: str) -> NoReturn:
    raise_problems(f"Cannot load config {path}", [Problem((), message)])


def _yaml_error(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    detail = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    if context and getattr(e, "context_mark", None):
        detail += f" ({context} at line {e.context_mark.line + 1})"
    hint = "; YAML indents with spaces, never tabs" if "\\t" in detail else ""
    return f"YAML syntax error{where}: {detail}{hint}"


def _count_values(node: yaml.Node, counted: dict[int, int], path: Path) -> int:
    """The values `node` holds with its aliases expanded (each shared node counted once per use, in time
    linear in the file); a config over MAX_VALUES, or an alias inside itself, fails."""
    key = id(node)
    if key in counted:
        if counted[key] < 0:
            _fail(path, f"a YAML alias refers to a node inside itself (line {node.start_mark.line + 1})")
        return counted[key]
    counted[key] = -1  # being counted: seen again below means a cycle
    children: list[yaml.Node] = []
    if node.tag == INT_TAG and len(node.value) > sys.get_int_max_str_digits():  # int() would raise in yaml
        _fail(path, f"line {node.start_mark.line + 1}: {_too_many_digits(node.value)}")
    if isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    total = 1 + sum(_count_values(child, counted, path) for child in children)
    if total > MAX_VALUES:
        _fail(
            path,
            f"holds more than {MAX_VALUES:,} values once its YAML aliases (*name) are expanded (rule: at "
            f"most {MAX_VALUES:,}; a config holds a few hundred). Write the values out instead of nesting "
            "aliases",
        )
    counted[key] = total
    return total


def _too_many_digits(number: str) -> str:
    limit = sys.get_int_max_str_digits()
    return (
        f"a number of {len(number):,} digits ({number[:12]}...): Python reads at most {limit:,}, and a "
        "config's numbers have a few. Fix: write the number meant"
    )


def _map_lines(node: yaml.Node, prefix: str, lines: dict[str, int]) -> list[Problem]:
    """Record the line of every key by dotted path; report duplicate keys, which safe_load silently drops."""
    duplicates: list[Problem] = []
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = f"{prefix}{key_node.value}"
            line = key_node.start_mark.line + 1
            if path in lines:
                message = f"duplicate key (also set at line {lines[path]}); YAML keeps only the last one."
                duplicates.append(Problem((path,), message + " Delete one of them.", (f"line {line}",)))
                for stale in [p for p in lines if p.startswith(path + ".")]:  # the first block is discarded
                    del lines[stale]
            lines[path] = line
            duplicates += _map_lines(value_node, path + ".", lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[f"{prefix}{i}"] = item.start_mark.line + 1
            duplicates += _map_lines(item, f"{prefix}{i}.", lines)
    return duplicates


class _Locator:
    """Says where a dotted path got its value: a command line override, a YAML line, or the default."""

    def __init__(self, lines: dict[str, int], overrides: dict[str, str], sources: Mapping[str, str]) -> None:
        self.lines = lines
        self.overrides = {
            t: sources.get(text, f"command line override '{text}'") for t, text in overrides.items()
        }

    def __call__(self, path: str) -> str:
        for target, where in self.overrides.items():
            if path == target or path.startswith(target + "."):
                return where
        if path in self.lines:
            return f"line {self.lines[path]}"
        for target, where in self.overrides.items():
            if target.startswith(path + "."):
                return where
        return "default" if self.lines else ""


def _build(
    data: Any,
    *,
    source: str,
    overrides: Sequence[str],
    lines: dict[str, int],
    found: list[Problem],
    sources: Mapping[str, str],
) -> Config:
    """Validate `data`, reporting every problem at once. `source` names it in messages; `lines` holds the YAML
    line of each dotted path (empty for a dict); `found`: problems already seen (duplicate keys); `sources`:
    see `load_config`."""
    if not isinstance(data, Mapping):
        got = "an empty file" if data is None else f"a {type(data).__name__}"
        message = (
            "the top level must be a mapping of sections (general, model, parallelism, tokens, optimizer, "
            f"data, ...); got {got}. A config needs at least tokens.train_steps and data.dataset_folder."
        )
        raise_problems(f"Invalid config {source}", [Problem((), message)])
    try:
        data = copy.deepcopy(dict(data))
    except RecursionError:  # a config from a manifest's JSON
        raise_problems(f"Invalid config {source}", [Problem((), _TOO_DEEP)])
    applied, override_problems = _apply_overrides(data, overrides)
    locate = _Locator(lines, applied, sources)
    problems: list[Problem] = list(found)
    bad: set[str] = set()  # paths already reported: cross-field rules that read them are skipped
    try:
        config: Config | None = Config.model_validate(data, context={SKIP_RULES: True})
    except ValidationError as e:
        for err in e.errors():
            problem, paths = _from_pydantic(err, locate)
            problems.append(problem)
            bad.update(paths)
        config = _lenient(data, bad)
    problems += override_problems
    if config is not None:
        for p in rule_problems(config):
            if not any(_related(f, b) for f in p.fields for b in bad):
                problems.append(Problem(p.fields, p.message, tuple(locate(f) for f in p.fields)))
    if problems or config is None:
        n = len(problems)
        raise_problems(f"Invalid config {source}: {n} problem{'s' if n != 1 else ''}", problems)
    return config


def _apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> tuple[dict[str, str], list[Problem]]:
    """Set `dotted.path=value` (value parsed as YAML) in place; return {path: text} applied, and problems."""
    applied: dict[str, str] = {}
    problems: list[Problem] = []
    for text in overrides:
        key, eq, raw = (part.strip() for part in text.partition("="))
        where = (f"command line override '{text}'",)
        if not eq or "" in key.split("."):
            usage = (
                "an override must look like section.key=value, e.g. parallelism.tp=2 or tokens.train_steps=50"
            )
            problems.append(Problem((key or text,), usage, where))
            continue
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            message = f"the value {raw!r} is not valid YAML ({getattr(e, 'problem', e)}); quote a string"
            problems.append(Problem((key,), message, where))
            continue
        except ValueError as e:  # int() of more digits than Python converts, or a date that does not exist
            message = f"the value {raw!r} cannot be read ({e}); quote a string"
            if len(raw) > sys.get_int_max_str_digits():
                message = _too_many_digits(raw)
            problems.append(Problem((key,), message, (f"command line override '{key}=...'",)))
            continue
        *parents, leaf = key.split(".")
        node = data
        for i, part in enumerate(parents):
            if node.get(part) is None:
                node[part] = {}  # create missing sections; unknown ones are reported by validation
            node = node[part]
            if not isinstance(node, dict):
                message = f"cannot set '{leaf}': {'.'.join(parents[: i + 1])} is {node!r}, not a section"
                problems.append(Problem((key,), message, where))
                break
        else:
            node[leaf] = value
            applied[key] = text
    return applied, problems


def _from_pydantic(err: Any, locate: _Locator) -> tuple[Problem, set[str]]:
    """One pydantic error -> a Problem, plus the paths it makes unreliable for cross-field rules."""
    loc = [str(part) for part in err["loc"]]
    path = ".".join(loc)
    parent = loc[:-1]
    key = loc[-1] if loc else ""
    kind = err["type"]
    if kind == "extra_forbidden":
        message, intended = _unknown_key(parent, key)
        return Problem((path,), message, (locate(path),)), {path, *intended}
    if kind == "missing":
        info = _field(loc)
        expected = f" ({info.description})" if info is not None and info.description else ""
        section = ".".join(parent)
        where = f"add it under '{section}:'" + (f" ({locate(section)})" if section in locate.lines else "")
        if not section:
            where = f"add a '{key}:' section"
        return Problem((path,), f"required field is missing{expected}; {where}", ("not set",)), {path}
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        message = "must be a section (a mapping of keys)"
    else:
        message = err["msg"].removeprefix("Value error, ").replace("Input should be", "must be", 1)
    value = err["input"]
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return Problem((path,), f"{message}; got {shown} ({type(value).__name__})", (locate(path),)), {path}


def _section(annotation: Any) -> type[BaseModel] | None:
    """The section class a field holds: `X` or an optional `X | None` section; None for a plain value."""
    if isinstance(annotation, types.UnionType):
        sections = [s for s in map(_section, get_args(annotation)) if s is not None]
        return sections[0] if len(sections) == 1 else None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _field(loc: list[str]) -> Any:
    """The pydantic FieldInfo at a YAML path (by YAML key names), or None if there is no such field."""
    model: type[BaseModel] | None = Config
    info = None
    for key in loc:
        if model is None:
            return None
        info = next((f for name, f in model.model_fields.items() if (f.alias or name) == key), None)
        if info is None:
            return None
        model = _section(info.annotation)
    return info


def _all_paths(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    paths = []
    for name, info in model.model_fields.items():
        key = info.alias or name
        sub = _section(info.annotation)
        if sub is not None:
            paths += _all_paths(sub, f"{prefix}{key}.")
        else:
            paths.append(prefix + key)
    return paths


@functools.cache  # asked once per unknown key: 40,000 of them took 5 s when each walked the schema
def _paths_by_key() -> dict[str, list[str]]:
    """Every field's dotted paths, by its key."""
    paths: dict[str, list[str]] = {}
    for path in _all_paths():
        paths.setdefault(path.rsplit(".", 1)[-1], []).append(path)
    return paths


def _unknown_key(parent: list[str], key: str) -> tuple[str, list[str]]:
    """Message for an unknown key: the likely intended key, the section it belongs in, or the valid keys."""
    section = ".".join(parent)
    info = _field(parent) if parent else None
    model = (_section(info.annotation) if info is not None else None) or Config
    valid = [f.alias or name for name, f in model.model_fields.items()]
    prefix = f"{section}." if section else ""
    what = f"unknown key '{key}' in {section}" if section else f"unknown section '{key}'"
    matchers = {v: difflib.SequenceMatcher(None, key, v) for v in valid}
    # ratio() is at most quick_ratio(), which is cheap: the keys that cannot reach 0.6 are not compared
    scores = {v: m.ratio() for v, m in matchers.items() if m.quick_ratio() >= 0.6}
    best = max(scores.values(), default=0.0)
    close = [v for v in scores if scores[v] >= max(0.6, best - 0.05)]  # the best match, and any as good
    if close:
        return f"{what}; did you mean {' or '.join(repr(c) for c in close)}?", [prefix + c for c in close]
    elsewhere = _paths_by_key().get(key, [])
    if elsewhere:
        return f"{what}; '{key}' belongs at {' or '.join(elsewhere)}. Move it there.", elsewhere
    return f"{what}; valid keys here: {', '.join(valid)}", []


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _lenient(data: dict[str, Any], bad: set[str]) -> Config | None:
    """The config with its bad values dropped (defaults apply), so rules on the good fields can still run."""
    repaired = copy.deepcopy(data)
    for path in bad:
        *parents, leaf = path.split(".")
        node: Any = repaired
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    for path, value in _PLACEHOLDERS.items():
        section, leaf = path.split(".")
        if not isinstance(repaired.get(section), dict):
            repaired[section] = {}
        repaired[section].setdefault(leaf, value)
    try:
        return Config.model_validate(repaired, context={SKIP_RULES: True})
    except ValidationError:
        return None
