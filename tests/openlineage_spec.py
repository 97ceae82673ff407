"""The OpenLineage JSON schema of the installed client, to validate emitted events against.

openlineage-python 1.54.0 ships no JSON schema file (neither do its sdist,
openlineage-integration-common, openlineage-airflow or the Airflow provider, which were
checked); it ships the spec as classes generated from it (``openlineage.client.generated``:
one attrs class per ``$defs`` entry, each naming its ``_schemaURL``). This module turns those
classes back into a JSON Schema: properties and their types from the type hints, required
properties (fields without a default, and the ``producer`` / ``schemaURL`` / ``_producer`` /
``_schemaURL`` that the spec requires and the client fills in), enums, and the formats the
client's validators check (uuid, date-time, uri). ``validate(event)`` checks an event against
the RunEvent definition and every facet against the definition its ``_schemaURL`` names;
a custom facet must name a schema in ``custom`` (ours: the file shipped in the package).
"""

from __future__ import annotations

import enum
import importlib
import inspect
import pkgutil
import types
import typing
import uuid
from datetime import datetime
from typing import Any
from urllib.parse import urlparse

import attr
import jsonschema

ALWAYS_SET = {"producer", "schemaURL", "_producer", "_schemaURL"}  # required by the spec, filled by the client


def _classes() -> dict[str, type]:
    """Every generated class by the schema URL it names."""
    import openlineage.client.generated as gen

    found: dict[str, type] = {}
    for m in pkgutil.iter_modules(gen.__path__):
        mod = importlib.import_module(f"{gen.__name__}.{m.name}")
        for obj in vars(mod).values():
            if inspect.isclass(obj) and attr.has(obj) and obj.__module__ == mod.__name__ and "_get_schema" in vars(obj):
                found[obj._get_schema()] = obj
    return found


def _format(field: attr.Attribute) -> str | None:
    v = field.validator
    if v is None:
        return None
    src = inspect.getsource(v if inspect.isfunction(v) else type(v))
    return "uuid" if "UUID(" in src else "date-time" if "isoparse" in src else "uri" if "urlparse" in src else None


class _Builder:
    def __init__(self) -> None:
        self.defs: dict[str, dict] = {}

    def ref(self, cls: type) -> dict:
        key = f"{cls.__module__}.{cls.__qualname__}"
        if key not in self.defs:
            self.defs[key] = {}  # placeholder against recursion
            self.defs[key] = self.object(cls)
        return {"$ref": f"#/$defs/{key}"}

    def object(self, cls: type) -> dict:
        scope = {**vars(typing), **vars(importlib.import_module(cls.__module__))}
        props, required = {}, []
        for f in attr.fields(cls):
            schema = self.type(eval(f.type, scope) if isinstance(f.type, str) else f.type)  # noqa: S307
            fmt = _format(f)
            if fmt:
                schema = {**schema, "format": fmt}
            if f.name == "schemaURL" or f.name == "_schemaURL":
                schema = {**schema, "format": "uri"}
            props[f.name] = schema
            if f.default is attr.NOTHING or f.name in ALWAYS_SET:
                required.append(f.name)
        return {"type": "object", "properties": props, "required": required}

    def type(self, hint: Any) -> dict:
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin in (typing.Union, types.UnionType):
            rest = [a for a in args if a is not type(None)]
            return self.type(rest[0]) if len(rest) == 1 else {"anyOf": [self.type(a) for a in rest]}
        if origin is list:
            return {"type": "array", "items": self.type(args[0])}
        if origin is dict:
            return {"type": "object", "additionalProperties": self.type(args[1])}
        if inspect.isclass(hint) and issubclass(hint, enum.Enum):
            return {"enum": [e.value for e in hint]}
        if inspect.isclass(hint) and attr.has(hint):
            return self.ref(hint)
        return {str: {"type": "string"}, int: {"type": "integer"}, float: {"type": "number"},
                bool: {"type": "boolean"}}.get(hint, {})


def _checker() -> jsonschema.FormatChecker:
    checker = jsonschema.FormatChecker()

    @checker.checks("uuid", raises=ValueError)
    def _uuid(v: object) -> bool:
        return not isinstance(v, str) or str(uuid.UUID(v)) == v.lower()

    @checker.checks("date-time", raises=ValueError)
    def _dt(v: object) -> bool:
        return not isinstance(v, str) or ("T" in v and datetime.fromisoformat(v).tzinfo is not None)

    @checker.checks("uri")
    def _uri(v: object) -> bool:
        return not isinstance(v, str) or bool(urlparse(v).scheme and (urlparse(v).netloc or urlparse(v).path))

    return checker


_CACHE: dict[str, Any] = {}


def definitions() -> tuple[dict[str, type], _Builder]:
    if not _CACHE:
        classes, builder = _classes(), _Builder()
        for cls in classes.values():
            builder.ref(cls)
        _CACHE["v"] = (classes, builder)
    return _CACHE["v"]


def schema_for(url: str) -> dict:
    """The JSON schema (draft 2020-12) of the class a spec URL names."""
    classes, builder = definitions()
    ref = builder.ref(classes[url])
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **ref, "$defs": builder.defs}


RUN_EVENT = "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent"


def _facets(event: dict) -> list[tuple[str, dict]]:
    out = [(f"run.{k}", v) for k, v in (event["run"].get("facets") or {}).items()]
    out += [(f"job.{k}", v) for k, v in (event["job"].get("facets") or {}).items()]
    for side in ("inputs", "outputs"):
        for ds in event.get(side) or []:
            for group in ("facets", "inputFacets", "outputFacets"):
                out += [(f"{side}[{ds['name']}].{k}", v) for k, v in (ds.get(group) or {}).items()]
    return out


def validate(event: dict, custom: dict[str, dict] | None = None) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``event`` is a valid RunEvent whose every facet
    is valid against the schema its ``_schemaURL`` names (``custom``: URL -> schema of ours)."""
    checker = _checker()
    jsonschema.Draft202012Validator(schema_for(RUN_EVENT), format_checker=checker).validate(event)
    classes, _ = definitions()
    for where, facet in _facets(event):
        url = facet.get("_schemaURL")
        if url in classes:
            schema = schema_for(url)
        elif custom and url in custom:
            schema = custom[url]
        else:
            raise jsonschema.ValidationError(f"{where}: facet names an unknown schema {url!r}")
        jsonschema.Draft202012Validator(schema, format_checker=checker).validate(facet)
