"""Build a :class:`TrainConfig` from the schema, a YAML file and ``key=value`` overrides.

Order of precedence (later wins): schema defaults < YAML file < command-line overrides. Every
failure is a :class:`ConfigError` that names the key and where the value came from, raised
before any distributed work starts, so a typo costs a second rather than a queued job.
"""

from __future__ import annotations

import difflib
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from megatron_wedlm.runtime.atomic_output import atomic_write_text

from .data_check import resolve_valid_path
from .schema import ConfigError, TrainConfig, blend_from_data_path, validate_config

__all__ = ["load_config", "config_to_yaml", "save_config", "config_from_yaml_text", "all_keys"]


def all_keys(schema: type = TrainConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (for suggestions in error messages)."""
    keys = []
    for f in fields(schema):
        name = f"{prefix}{f.name}"
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            keys.extend(all_keys(type(default), name + "."))
        else:
            keys.append(name)
    return keys


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _blend_as_list(raw: DictConfig, source: str) -> DictConfig:
    """``raw`` with a ``data.blend`` in Megatron-LM's ``--data-path`` form (a string, or a list of
    weights and paths or of paths alone) turned into the list of ``{path, weight}`` the schema
    holds (:func:`~.schema.blend_from_data_path`), before it meets the schema's types."""
    data = raw.get("data")
    blend = data.get("blend") if isinstance(data, DictConfig) else None
    plain = isinstance(blend, ListConfig) and len(blend) > 0 and not any(
        isinstance(item, (DictConfig, ListConfig)) for item in blend)
    if isinstance(blend, str) or plain:
        try:
            data.blend = blend_from_data_path(blend if isinstance(blend, str) else OmegaConf.to_container(blend))  # type: ignore[union-attr, arg-type]
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None
    return raw


def _merge(base: DictConfig, other: DictConfig, source: str) -> DictConfig:
    other = _blend_as_list(other, source)
    try:
        return OmegaConf.merge(base, other)  # type: ignore[return-value]
    except ConfigKeyError as err:
        key = err.full_key or str(err)
        raise ConfigError(f"{source}: unknown config key '{key}'{_suggest(str(key))}") from None
    except ValidationError as err:
        first = str(err).splitlines()[0]
        if err.full_key:
            raise ConfigError(f"{source}: bad value for '{err.full_key}': {first}") from None
        raise ConfigError(f"{source}: {first} (a section was given a plain value?)") from None
    except OmegaConfBaseException as err:
        raise ConfigError(f"{source}: {str(err).splitlines()[0]}") from None


def _read_yaml(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return OmegaConf.create(data)


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(
                f"command-line override {item!r} is not of the form key=value (e.g. optimizer.lr=1e-5)"
            )
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as err:
        raise ConfigError(f"command line: {str(err).splitlines()[0]}") from None


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    defaults: dict[str, Any] | None = None,
) -> TrainConfig:
    """Schema defaults, then ``defaults`` (e.g. the entry point's task), then the YAML file, then
    overrides; validated. Raises :class:`ConfigError` naming the key on any problem."""
    cfg = OmegaConf.structured(TrainConfig)
    if defaults:
        cfg = _merge(cfg, OmegaConf.create(defaults), "entry-point defaults")
    if path is not None:
        cfg = _merge(cfg, _read_yaml(Path(path)), str(path))
    if overrides:
        cfg = _merge(cfg, _parse_overrides(overrides), "command line")
    try:
        typed = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(str(err).splitlines()[0]) from None
    assert isinstance(typed, TrainConfig)
    resolve_valid_path(typed)
    validate_config(typed)
    return typed


def config_from_yaml_text(text: str) -> TrainConfig:
    """Re-read a saved (resolved) config; same checks as :func:`load_config`."""
    cfg = _merge(OmegaConf.structured(TrainConfig), OmegaConf.create(yaml.safe_load(text) or {}), "saved config")
    typed = OmegaConf.to_object(cfg)
    assert isinstance(typed, TrainConfig)
    validate_config(typed)
    return typed


def config_to_yaml(cfg: TrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: TrainConfig, path: str | Path) -> Path:
    """Write the resolved config (every key, defaults included) as YAML, replacing the file whole:
    each job of a chain rewrites its run's config while ``--follow`` reads it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, config_to_yaml(cfg))
