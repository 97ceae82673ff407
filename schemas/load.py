"""Load manifests, configs and policies from YAML/JSON with errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from modalign.schemas.errors import ConfigError

M = TypeVar("M", bound=BaseModel)
_YamlLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser where the wheel has it
MAX_FILE_BYTES = 4 * 2**20  # a manifest or config larger than this is refused before it is parsed
MAX_ALIASES = 64  # YAML aliases (*ref) per file: an alias bomb expands exponentially when traversed


def format_validation_error(err: ValidationError, where: Path | str) -> str:
    """One line naming every bad field by its dotted path, prefixed by the file (or object)."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "<root>"
        parts.append(f"{loc}: {e['msg']}")
    return f"{where}: " + "; ".join(parts)


def read_mapping(path: Path) -> dict:
    """Parse a YAML or JSON file into a dict, or raise ConfigError naming the file."""
    try:
        size = Path(path).stat().st_size
        if size > MAX_FILE_BYTES:
            raise ConfigError(f"{path} is {size} bytes, over the {MAX_FILE_BYTES}-byte limit for a manifest or "
                              "config; list fewer sources per manifest")
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    return parse_mapping(data, path)


def parse_mapping(raw: bytes, path: Path | str) -> dict:
    """Parse the bytes of a YAML or JSON document (JSON when ``path`` ends in ``.json``) into a
    dict, or raise ConfigError naming ``path`` (a file, or an object-store URI)."""
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"{path} is {len(raw)} bytes, over the {MAX_FILE_BYTES}-byte limit for a manifest or "
                          "config; list fewer sources per manifest")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text") from None
    try:
        if not str(path).endswith(".json"):
            aliases = sum(isinstance(e, yaml.AliasEvent) for e in yaml.parse(text, Loader=_YamlLoader))
            if aliases > MAX_ALIASES:
                raise ConfigError(f"{path} uses {aliases} YAML aliases, over the limit of {MAX_ALIASES}; "
                                  "write the values out")
        data = json.loads(text) if str(path).endswith(".json") else yaml.load(text, Loader=_YamlLoader)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not valid YAML/JSON: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def validate_mapping(model: type[M], data: dict, where: Path | str) -> M:
    """Validate parsed data against ``model``; ConfigError lists every bad field by dotted path."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, where)) from None


def load_model(model: type[M], path: Path) -> M:
    """Validate a file against ``model``; ConfigError lists every bad field by dotted path."""
    return validate_mapping(model, read_mapping(path), path)


def dump_yaml(model: BaseModel) -> str:
    return yaml.safe_dump(model.model_dump(mode="json", exclude_none=True, exclude_defaults=True), sort_keys=False)
