"""The configuration reference: every config key as Markdown, walked from the models.

`docs/configuration.md` is this module's output (`mlm-pipeline config-reference --out
docs/configuration.md`); `tests/unit/test_config_reference.py` fails when the committed
page differs from what the models give now. The walk starts at `PipelineConfig` and
descends into every field whose type is a config model (`train.distributed`) and into the
models a list holds (`eval.probes[]`), so a new field or section appears without a hand
list. Cheap: pydantic and the standard library only (STYLE rule 3).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from pathlib import Path

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from mlm_pipeline.config import PipelineConfig, StrictModel

#: How the page is refreshed: the stale-page test prints it.
REFRESH_COMMAND = "mlm-pipeline config-reference --out docs/configuration.md"

#: A default whose repr is longer than this is summarized (the field's text describes it).
_MAX_DEFAULT_CHARS = 100

_INTRO = f"""\
# Configuration reference

<!-- Generated from the config models in mlm_pipeline/config/ by
     `{REFRESH_COMMAND}`; do not edit by hand:
     tests/unit/test_config_reference.py fails when this page is stale. -->

A config is a YAML file (`configs/tiny.yaml`, or one of your own) with one section per
stage; every key below can also be overridden on the command line with
`--set key.path=value` (the value is parsed as YAML, e.g.
`--set 'ingest.sources=["data/*.jsonl"]'`). Unknown keys are errors, and every value is
checked when the config is loaded. `mlm-pipeline config CONFIG [--set ...]` prints the
resolved config of a run.

Defaults are shown as Python values: `None` is YAML `null`, `True`/`False` are
`true`/`false`. This page is generated from the config models
(`{REFRESH_COMMAND}`).
"""


def _cell(text: str) -> str:
    """`text` on one line, safe inside a Markdown table cell: pipes outside code spans
    escaped (Python-Markdown, which builds the site, splits cells on those only)."""
    parts = " ".join(text.split()).split("`")
    return "`".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts))


def _type_name(annotation: object) -> str:
    """A short, readable name of a field's type: `int`, `str or None`, `list of str`,
    `one of "dynamic", "precomputed"`."""
    if annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:  # e.g. a constrained float inside a union or a tuple
        bounds = _bounds_of(m for meta in annotation.__metadata__
                            for m in getattr(meta, "metadata", [meta]))
        return _type_name(args[0]) + "".join(f" {b}" for b in bounds)
    if origin is typing.Literal:
        return "one of " + ", ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_type_name(a) for a in args))
    if origin is tuple and args and Ellipsis not in args:  # a fixed-length pair, e.g.
        return f"[{', '.join(_type_name(a) for a in args)}]"
    if origin in (list, tuple, set, frozenset):
        inner = [a for a in args if a is not Ellipsis]
        return f"list of {' or '.join(_type_name(a) for a in inner)}" if inner else "list"
    if origin is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def _bounds_of(metadata: typing.Iterable[object]) -> list[str]:
    """Numeric and length constraints among type metadata, e.g. `["≥ 0", "≤ 1"]`."""
    parts = []
    for meta in metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if getattr(meta, attr, None) is not None:
                parts.append(f"{sign} {getattr(meta, attr)}")
        if isinstance(meta, annotated_types.MinLen) and meta.min_length:
            parts.append(f"at least {meta.min_length} item" + "s" * (meta.min_length > 1))
    return parts


def _bounds(field: FieldInfo) -> str:
    """The field's numeric and length constraints as a suffix, e.g. `, ≥ 0, ≤ 1`."""
    parts = _bounds_of(field.metadata)
    return (", " + ", ".join(parts)) if parts else ""


def _models_in(annotation: object) -> list[type[StrictModel]]:
    """Config models a field of this type holds: itself, or the items of a list."""
    if isinstance(annotation, type) and issubclass(annotation, StrictModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _default(field: FieldInfo) -> str:
    """The default of a field as a table cell; `required` when there is none."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    shown = repr(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, BaseModel) for v in value):
        shown = f"[{len(value)} items]"
    elif len(shown) > _MAX_DEFAULT_CHARS:
        shown = (f"[{len(value)} items]" if isinstance(value, (list, tuple))
                 else shown[:_MAX_DEFAULT_CHARS - 3] + "...")
    return f"`{' '.join(shown.split())}`"  # a code span: its pipes need no escape


def _first_line(model: type[BaseModel]) -> str:
    """The first paragraph of a model's docstring, on one line."""
    return " ".join((model.__doc__ or "").strip().split("\n\n")[0].split())


def _tag(model: type[StrictModel]) -> str:
    """How a model among a union's alternatives is told apart: the `schedule` value of a
    masking-rate schedule (`linear`), else the model's name."""
    field = model.model_fields.get("schedule")
    if field is not None and typing.get_origin(field.annotation) is typing.Literal:
        return f"schedule: {typing.get_args(field.annotation)[0]}"
    return model.__name__


def _sections(model: type[StrictModel], prefix: str, title: str | None = None) -> Iterator[
        tuple[str, type[StrictModel], list[tuple[str, str, str, str]]]]:
    """(section title, its model, [(key, type, default, meaning)]) for `model` and, after
    it, for every config model among its fields, depth first. The title is the dotted
    section name, with the alternative's tag for a model in a union (`title`)."""
    rows, nested = [], []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        inner = _models_in(field.annotation)
        if isinstance(field.annotation, type) and inner:
            nested.append((key, inner[0]))
            kind, default = "section", "its keys' defaults"
            meaning = field.description or _first_line(inner[0])
            meaning += f" See [`{key}`](#{_anchor(key)})."
        else:
            kind = _type_name(field.annotation) + _bounds(field)
            default = _default(field)
            meaning = field.description or ""
            listed = typing.get_origin(field.annotation) in (list, tuple)
            for item in inner:
                if listed:  # e.g. eval.probes: a list of FillMaskProbe or str
                    nested.append((f"{key}[]", item))
                    meaning += f" Items: see [`{key}[]`](#{_anchor(key + '[]')})."
                else:  # e.g. masking.mlm_probability: a float or one of two schedules
                    alternative = f"{key} ({_tag(item)})"
                    nested.append((alternative, item))
                    meaning += f" As a mapping: see [`{alternative}`](#{_anchor(alternative)})."
        rows.append((f"`{key}`", _cell(kind), default, _cell(meaning)))
    yield title or prefix.rstrip("."), model, rows
    for key, inner in nested:
        yield from _sections(inner, f"{key.split(' ')[0]}.", title=key)


def _anchor(key: str) -> str:
    """The id Python-Markdown's `toc` extension gives the heading "`key`" (its `slugify`:
    word characters, spaces and hyphens kept, runs of spaces and hyphens made one `-`)."""
    kept = "".join(c for c in key.lower() if c.isalnum() or c in "-_ ")
    return "-".join(kept.replace("-", " ").split())


def config_reference() -> str:
    """The configuration reference page: every key of `PipelineConfig`, walked from the
    models, as Markdown tables (key, type, default, meaning from the field docstrings).

    Returns:
        The Markdown text of `docs/configuration.md`, ending in a newline.
    """
    lines = [_INTRO]
    for section, model, rows in _sections(PipelineConfig, ""):
        if section:
            lines += [f"## `{section}`", "", _first_line(model), ""]
        else:
            lines += ["## Top level", ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        lines += [f"| {' | '.join(row)} |" for row in rows]
        lines.append("")
    return "\n".join(lines)


def write_config_reference(path: str | Path) -> Path:
    """Write `config_reference()` to `path` (UTF-8), creating its parent directory.

    Args:
        path: the Markdown file to write, e.g. `docs/configuration.md`.

    Returns:
        The path written.

    Raises:
        OSError: the file cannot be written (message names the path).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_reference(), encoding="utf-8")
    return path


def reference_page(out: str | Path | None = None) -> str:
    """`mlm-pipeline config-reference`: the page (`config_reference()`), or, with `out`, the
    path it was written to (`write_config_reference`), as text to print.

    Raises:
        OSError: `out` cannot be written.
    """
    return config_reference() if out is None else f"{write_config_reference(out)}\n"
