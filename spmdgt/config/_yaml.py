"""A thin YAML layer: text in, plain mappings out, typed dataclasses built with exact errors.

Everything spmdgt reads from YAML (signal placements, the trainer's config) goes through
``load_mapping`` and ``from_dict``: unknown keys are rejected and listed, values are type
checked against the dataclass's annotations, and every message names file, line, section and
key: ``load_mapping`` returns ``Lined`` mappings that remember the line of each of their keys.
"""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from spmdgt.config._errors import ConfigError

__all__ = ["Lined", "from_dict", "line_of", "load_mapping"]

T = TypeVar("T")


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (the
    safe loader keeps the last one silently: a signal defined twice would lose the first)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first on line {seen[key]})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


class Lined(dict):
    """A mapping read from YAML that knows the (1-based) line of each of its keys."""

    __slots__ = ("lines",)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lines: dict = {}


def _construct_lined(loader: _UniqueKeyLoader, node):
    data = Lined()
    yield data  # PyYAML's two-step construction: anchors may refer to the mapping
    data.update(loader.construct_mapping(node))
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        try:
            data.lines[key] = key_node.start_mark.line + 1
        except TypeError:  # an unhashable key: construct_mapping has already refused it
            pass


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:map", _construct_lined)
# what load_mapping returns dumps back as the plain mapping it is
yaml.SafeDumper.add_representer(Lined, yaml.SafeDumper.represent_dict)
yaml.Dumper.add_representer(Lined, yaml.Dumper.represent_dict)


def line_of(data: object, key: str | None) -> int | None:
    """The line of dotted ``key`` (``shard.axis``, ``shard.over[1]``) inside a ``Lined``
    mapping: the deepest key found along the path, None when ``data`` has no lines."""
    line = None
    cur = data
    for part in (key or "").split("."):
        part = part.split("[", 1)[0]
        if not isinstance(cur, Lined) or part not in cur.lines:
            break
        line = cur.lines[part]
        cur = cur[part]
    return line


def load_mapping(source: str | os.PathLike, *, what: str = "config") -> tuple[dict, str]:
    """Read a YAML file into a dict; return it with the name to quote in errors.

    Malformed YAML is a ``ConfigError`` carrying the file and line of the problem.
    """
    path = os.fspath(source)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read {what} file: {e.strerror}", file=path) from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{what} file is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})",
            file=path,
        ) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"malformed YAML: {problem}", file=path, line=line) from None
    if data is None:
        return {}, path
    if not isinstance(data, dict):
        raise ConfigError(
            f"top level must be a mapping of names, got {type(data).__name__}", file=path
        )
    return data, path


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "null")


def _coerce(tp: Any, value: Any, ctx: dict, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; build nested dataclasses."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        if value is None and len(options) < len(get_args(tp)):
            return None
        if len(options) == 1:  # Optional[X]: X's own error is the precise one
            return _coerce(options[0], value, ctx, key)
        for arg in options:
            try:
                return _coerce(arg, value, ctx, key)
            except ConfigError:
                pass
        raise ConfigError(
            f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}",
            key=key,
            value=value,
            **ctx,
        )
    if tp is type(None):
        if value is None:
            return None
    elif origin is Literal:
        if value in get_args(tp):
            return value
    elif origin in (list, tuple):
        if isinstance(value, (list, tuple)):
            (item_tp, *_) = get_args(tp) or (Any,)
            items = [_coerce(item_tp, v, ctx, f"{key}[{i}]") for i, v in enumerate(value)]
            return items if origin is list else tuple(items)
    elif origin is dict:
        if isinstance(value, dict):
            k_tp, v_tp = get_args(tp) or (Any, Any)
            return {
                _coerce(k_tp, k, ctx, key): _coerce(v_tp, v, ctx, f"{key}.{k}")
                for k, v in value.items()
            }
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return from_dict(tp, value, prefix=f"{key}.", **ctx)
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(
        f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}",
        key=key,
        value=value,
        **ctx,
    )


def from_dict(
    cls: type[T],
    data: dict,
    *,
    file: str | None = None,
    section: str | None = None,
    prefix: str = "",
    aliases: dict[str, str] | None = None,
) -> T:
    """Build dataclass ``cls`` from ``data``; reject unknown keys, check every value's type.

    ``aliases`` maps YAML spellings to field names (``backward`` -> ``backward_signal``). The
    dataclass's own ``__post_init__`` validation errors are re-raised naming file and section.
    """
    try:
        return _from_dict(cls, data, file, section, prefix, aliases)
    except ConfigError as e:
        if e.line is not None or not isinstance(data, Lined):
            raise
        line = line_of(data, (e.key or "").removeprefix(prefix))
        if line is None:
            raise
        raise e.located(line=line) from None


def _from_dict(cls, data, file, section, prefix, aliases):
    ctx = {"file": file, "section": section}
    if not isinstance(data, dict):
        raise ConfigError(
            f"expected a mapping, got {type(data).__name__} {data!r}",
            key=prefix.rstrip(".") or None,
            **ctx,
        )
    aliases = aliases or {}
    hints = get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if aliases.get(k, k) not in fields]
    if unknown:
        known = sorted(set(fields) | set(aliases)) if aliases else sorted(fields)
        known = [k for k in known if k not in aliases.values() or k in aliases]
        raise ConfigError(
            f"unknown key(s) {', '.join(map(repr, unknown))}; known keys: {', '.join(known)}",
            key=prefix + str(unknown[0]),
            value=data[unknown[0]],
            **ctx,
        )
    kwargs = {}
    for k, v in data.items():
        name = aliases.get(k, k)
        kwargs[name] = _coerce(hints[name], v, ctx, prefix + k)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if e.file or not (file or section):
            raise
        raise ConfigError(
            e.message,
            key=prefix + e.key if e.key else None,
            value=e.value,
            **ctx,
        ) from None
