"""Strict typed configuration, parsed once at the edge.

Every YAML kvlab reads (topologies, gateway policies, latency profiles) is converted into
msgspec structs declared with `forbid_unknown_fields=True`; a typo is an error that names the
file, the path inside it and the fields that are allowed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

from kvlab.errors import ConfigError

T = TypeVar("T")


class Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Base for config structs: unknown keys are errors; values are read-only once parsed."""


def _allowed(cls: type, path: str) -> str:
    """The field names allowed at a msgspec error path like `$.pools[0]`, best effort."""
    node: Any = cls
    for part in path.lstrip("$").replace("[", ".[").split("."):
        if not part or part.startswith("["):
            continue
        is_struct = isinstance(node, type) and issubclass(node, msgspec.Struct)
        fields = {f.name: f for f in msgspec.structs.fields(node)} if is_struct else {}
        if part not in fields:
            return ""
        node = fields[part].type
        for _ in range(3):  # unwrap list[X] / X | None
            args = getattr(node, "__args__", None)
            if not args:
                break
            node = next((a for a in args if isinstance(a, type) and issubclass(a, msgspec.Struct)), args[0])
    if isinstance(node, type) and issubclass(node, msgspec.Struct):
        return ", ".join(f.name for f in msgspec.structs.fields(node))
    return ""


def convert(data: Any, cls: type[T], source: str = "<config>") -> T:
    """Convert plain data (from YAML/JSON) into `cls`, or raise a ConfigError saying how to fix it."""
    try:
        return msgspec.convert(data if data is not None else {}, cls, strict=False)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        hint = ""
        if "unknown field" in msg and " - at `" in msg:
            allowed = _allowed(cls, msg.rsplit(" - at `", 1)[1].rstrip("`"))
            hint = f" (allowed here: {allowed})" if allowed else ""
        elif "unknown field" in msg:
            hint = f" (allowed: {_allowed(cls, '$')})"
        raise ConfigError(f"{source}: {msg}{hint}") from None


class _Yaml12Loader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML is untyped (no stubs installed)
    """SafeLoader with YAML 1.2 booleans: only true/false, so `traces: off` stays the string "off"."""


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))


def read_yaml(path: str | Path) -> Any:
    """Plain data from a YAML file (YAML 1.2 booleans), or a ConfigError naming the file."""
    p = Path(path)
    try:
        return yaml.load(p.read_text(), Loader=_Yaml12Loader)
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None


def load_yaml(path: str | Path, cls: type[T]) -> T:
    """Read a YAML file into `cls` (see `convert`)."""
    return convert(read_yaml(path), cls, str(path))
