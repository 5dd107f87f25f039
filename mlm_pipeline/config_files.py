"""Config files: find a config by name or path, load its YAML, apply dotted overrides, print
it back, and flatten it into MLflow params.

A bare name such as `tiny` is looked up as `configs/tiny.yaml` under the current directory,
then among the shipped configs (the repository's `configs/`, installed as the package data
`mlm_pipeline.configs`), so `load_config("tiny")` works from any directory and from a wheel.
What `dump_config` prints, `load_config` reads back into the same config. This module
imports neither torch nor prefect (STYLE rule 3).
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ValidationError

from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.config.hf_parent import apply_hf_parent
from mlm_pipeline.errors import ConfigError  # noqa: F401 - raised here, importable from here

if TYPE_CHECKING:  # importlib.resources.abc is Python >= 3.11
    from importlib.resources.abc import Traversable

#: Package whose data files are the shipped configs (the repository's `configs/` folder).
SHIPPED_CONFIGS = "mlm_pipeline.configs"


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    *sections, last = key.split(".")
    node = tree
    for part in sections:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
        node = child
    node[last] = value


def parse_override(item: str) -> tuple[str, Any]:
    """Split a `key.path=value` override; the value is parsed as YAML (`3e-4`, `true`, `[a]`).

    Raises:
        ConfigError: when `item` has no `=` or an empty key.
    """
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like key.path=value")
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: list[str] | None = None,
    quote: bool = True,
) -> PipelineConfig:
    """Load a YAML pipeline config and apply dotted overrides (`train.lr=3e-4`).

    Args:
        path: YAML file; None starts from the defaults. A bare name such as `tiny` is looked
            up as `configs/tiny.yaml` under the current directory, then among the shipped
            configs (`resolve_config_path`).
        overrides: `key.path=value` strings applied in order after the file.
        quote: False for a file nobody vouches for (one an event named): its errors name
            the file, the kind of problem and a line number, never its content (no YAML
            snippet, no key or value of the file).

    Returns:
        The validated, frozen `PipelineConfig`.

    Raises:
        ConfigError: the file is missing or not a YAML mapping, an override is malformed,
            or validation fails (every failing field is listed with its dotted path, after
            `--set KEY=VALUE: ` when an override set it).
    """
    tree: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        resolved = resolve_config_path(path)
        source = str(resolved)
        try:
            loaded = yaml.safe_load(resolved.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            if quote:
                raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
            mark = getattr(exc, "problem_mark", None)
            at = f" (line {mark.line + 1})" if mark is not None else ""
            raise ConfigError(f"{source}: not valid YAML{at}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{source}: not a UTF-8 text file") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{source}: top level must be a mapping, got {type(loaded).__name__}")
        tree = loaded
    origin: dict[tuple[str, ...], str] = {}  # dotted key -> the override that set it last
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(tree, key, value)
        origin[tuple(key.split("."))] = item
    # A Hugging Face parent defines the model (and its tokenizer): once, here.
    tree = apply_hf_parent(tree, origin)
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as exc:
        if not quote:
            raise ConfigError(f"{source}: not a valid config ({exc.error_count()} invalid "
                              "or unknown fields; not listed: the file is not trusted)"
                              ) from None
        lines, from_file = [], False
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "<root>"
            hint = _nearest_key(err["loc"]) if err["type"] == "extra_forbidden" else None
            item = _override_of(err["loc"], origin)
            from_file |= item is None
            lines.append("  " + (f"--set {item}: " if item else "") + f"{loc}: {err['msg']}"
                         + (f" (did you mean {hint}?)" if hint else ""))
        where = f"{source}: invalid config" if from_file else (
            f"invalid --set override (config {source})")
        raise ConfigError(where + "\n" + "\n".join(lines)) from None


def _override_of(loc: tuple, origin: dict[tuple[str, ...], str]) -> str | None:
    """The override that set the value at `loc` (or a section holding it), if any."""
    parts = tuple(str(p) for p in loc)
    for n in range(len(parts), 0, -1):
        if parts[:n] in origin:
            return origin[parts[:n]]
    return None


def _nearest_key(loc: tuple) -> str | None:
    """The valid dotted key closest to an unknown one (`train.max_step` -> `train.max_steps`),
    by `difflib` similarity within the same section; None when nothing is close."""
    import difflib

    model: Any = PipelineConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type):
            return None
        model = field.annotation
    if not hasattr(model, "model_fields"):
        return None
    match = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
    return ".".join([*map(str, loc[:-1]), match[0]]) if match else None


def shipped_configs() -> dict[str, Traversable]:
    """The configs installed with the package, by name (`{"tiny": .../tiny.yaml}`)."""
    root = resources.files(SHIPPED_CONFIGS)
    return {entry.name.rpartition(".")[0]: entry
            for entry in sorted(root.iterdir(), key=lambda e: e.name)
            if entry.is_file() and entry.name.endswith(".yaml")}


def resolve_config_path(path: str | os.PathLike[str]) -> Path | Traversable:
    """Find a config file: the path itself; for a bare name (no `.yaml`/`.yml` suffix)
    also `configs/NAME.yaml` under the current directory, then the shipped config `NAME`.

    Returns:
        The file: a `Path`, or for a shipped config an `importlib.resources` `Traversable`
        (a `Path` unless the package is installed in a zip file); either has `read_text`.

    Raises:
        ConfigError: when no candidate exists (the candidates tried and the shipped config
            names are listed).
    """
    p = Path(path)
    if p.is_file():
        return p.resolve()
    tried = [str(p)]
    if p.suffix not in (".yaml", ".yml"):
        local = Path("configs") / f"{p}.yaml"
        if local.is_file():
            return local.resolve()
        shipped = shipped_configs()
        if str(path) in shipped:
            found = shipped[str(path)]
            return found.resolve() if isinstance(found, Path) else found
        tried += [str(local), f"shipped config {str(path)!r} (shipped: {', '.join(shipped)})"]
    raise ConfigError(f"config not found: tried {', '.join(tried)}")


def dump_config(cfg: PipelineConfig) -> str:
    """`cfg` as YAML, every field spelled out: `load_config` of the text gives `cfg` back
    (what `mlm-pipeline config` prints)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def flatten(cfg: BaseModel, prefix: str = "") -> dict[str, Any]:
    """Flatten a config into `{"train.lr": 0.001, ...}` for MLflow params (lists joined
    with commas, None as "None")."""
    out: dict[str, Any] = {}
    for name, value in cfg.model_dump(mode="json").items():
        _flatten_into(out, f"{prefix}{name}", value)
    return out


def _flatten_into(out: dict[str, Any], key: str, value: Any) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten_into(out, f"{key}.{k}", v)
    elif isinstance(value, list):
        out[key] = ",".join(str(v) for v in value)
    else:
        out[key] = "None" if value is None else value


def resolved_yaml(config: str, overrides: list[str]) -> str:
    """`mlm-pipeline config`: the config `config` with `overrides` applied
    (`load_config`), as YAML (`dump_config`).

    Raises:
        The errors of `load_config`.
    """
    return dump_config(load_config(config, overrides))
