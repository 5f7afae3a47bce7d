"""Loading the settings: defaults, then a YAML file, then ``KVSTORE_*`` variables, then flags.

The dataclasses and their validation are ``kvstore.config``; this module turns text (YAML
values, environment strings) into their fields' types and says where a bad value was written
(``file:line: section.field``).
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from kvstore.config import KVStoreConfig, parse_size
from kvstore.errors import ConfigError


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Turn a YAML or environment value into the field's type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        return _coerce(value, args[0], where)
    try:
        if tp is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if tp is int:
            return parse_size(value) if isinstance(value, str) else int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
    except ConfigError as exc:  # a size: its message lists the valid units
        raise ConfigError(f"{where}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {value!r} is not a valid {tp.__name__}") from exc
    return value


def _yaml_lines(path: str | Path, text: str) -> dict[str, int]:
    """``{"section": line, "section.field": line}`` (1-based) of a parsed YAML file, so an
    error about a setting names where the operator wrote it."""
    out: dict[str, int] = {}
    root = yaml.compose(text)
    if not isinstance(root, yaml.MappingNode):
        return out
    for key, value in root.value:
        section = str(key.value)
        out[section] = key.start_mark.line + 1
        if isinstance(value, yaml.MappingNode):
            for k, _ in value.value:
                out[f"{section}.{k.value}"] = k.start_mark.line + 1
    return out


def _where(name: str, path: str | Path | None, lines: Mapping[str, int]) -> str:
    """``file:line: name`` for a setting read from the file, plain ``name`` otherwise."""
    return f"{path}:{lines[name]}: {name}" if path is not None and name in lines else name


def _build(cls: type, values: Mapping[str, Any], section: str, path: str | Path | None = None,
           lines: Mapping[str, int] | None = None) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    lines = lines or {}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"{_where(f'{section}.{unknown[0]}', path, lines)}: unknown "
                          f"setting(s) {unknown} in '{section}'; known: {sorted(names)}")
    kwargs = {k: _coerce(v, hints[k], _where(f"{section}.{k}", path, lines))
              for k, v in values.items()}
    try:
        return cls(**kwargs)
    except ConfigError as exc:  # __post_init__ names the setting; add where it was written
        bad = [k for k in values if f"{section}.{k}" in str(exc)]
        if path is None or not bad or f"{section}.{bad[0]}" not in lines:
            raise
        raise ConfigError(f"{path}:{lines[f'{section}.{bad[0]}']}: {exc}") from None


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> KVStoreConfig:
    """Load settings: defaults, then the YAML file, then ``KVSTORE_*`` variables, then overrides.

    ``overrides`` is ``{component: {field: value}}``, a command's flags as
    ``kvstore.command_flags`` reads them; a ``None`` value is a flag not given and overrides
    nothing.
    """
    env = os.environ if env is None else env
    raw: dict[str, dict[str, Any]] = {}
    lines: dict[str, int] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
        try:
            loaded = yaml.safe_load(text) or {}
            lines = _yaml_lines(path, text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"{at}: YAML syntax error: {problem}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must be a mapping of components "
                              "(pool:, server:, client:, index:, coordinator:, worker:, serve:)")
        for section, values in loaded.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{_where(str(section), path, lines)}: config section "
                                  f"{section!r} must be a mapping of settings")
            raw[str(section)] = dict(values)
    sections = {f.name: f.type for f in dataclasses.fields(KVStoreConfig)}
    unknown = sorted(set(raw) - set(sections))
    if unknown:
        raise ConfigError(f"{_where(unknown[0], path, lines)}: unknown config section(s) "
                          f"{unknown}; known: {sorted(sections)}")
    hints = typing.get_type_hints(KVStoreConfig)
    for section in sections:
        cls = hints[section]
        prefix = f"KVSTORE_{section.upper()}_"
        for f in dataclasses.fields(cls):
            var = prefix + f.name.upper()
            if var in env:
                raw.setdefault(section, {})[f.name] = env[var]
    for section, values in (overrides or {}).items():
        raw.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    built = {s: _build(hints[s], raw.get(s, {}), s, path, lines) for s in sections}
    return KVStoreConfig(**built)
