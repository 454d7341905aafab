"""How the pydantic edge schema (cluster/config.py) meets the frozen dataclasses inside.

Each layer owns its configuration as frozen dataclasses with their defaults (the engine's in
worker/config.py, the router's in router/, the autoscaling policy's in cluster/autoscaling.py).
The user-facing sections only add what an edge needs (validation bounds, byte-size strings,
readable errors). So that no default is written twice:

  * a section field that configures a dataclass field takes its default from it:
        block_size: int = Field(default_of(CacheConfig, "block_size"), gt=0, le=256)
  * a section becomes its dataclass through one mapping, driven by `dataclasses.fields`:
        build(CacheConfig, engine_section, renames={"num_blocks_override": "num_blocks"})
    every dataclass field is taken from the section field of the same name (or the renamed
    one); fields the sections do not have keep the dataclass's default.

tests/unit/cluster/test_config_mapping.py checks that every section field either reaches a
dataclass this way or is a documented deployment-only field.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, GetJsonSchemaHandler

T = TypeVar("T")


class Section(BaseModel):
    """A block of the user's YAML: unknown keys are errors, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def default_of(cls: type, name: str) -> Any:
    """The default of dataclass `cls`'s field `name`: the one place it is written."""
    for f in dataclasses.fields(cls):
        if f.name != name:
            continue
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        raise TypeError(f"{cls.__name__}.{name} has no default to derive from")
    raise AttributeError(f"{cls.__name__} has no field {name!r}")


def build(cls: type[T], *sections: BaseModel, renames: Mapping[str, str] | None = None, **given: Any) -> T:
    """The dataclass `cls` from pydantic sections: each field from `given`, else from the one
    section that has it (under its own name, or `renames[field]`), else cls's default.

    A field offered by two sections is an error: which one wins must be said in `given`."""
    renames = renames or {}
    unknown = sorted(set(given) - {f.name for f in dataclasses.fields(cls)})  # type: ignore[arg-type]
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {unknown}")
    values: dict[str, Any] = dict(given)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in given:
            continue
        source = renames.get(f.name, f.name)
        owners = [s for s in sections if source in type(s).model_fields]
        if len(owners) > 1:
            raise TypeError(f"{cls.__name__}.{f.name}: offered by {[type(s).__name__ for s in owners]}; pass it explicitly")
        if owners:
            values[f.name] = getattr(owners[0], source)
    return cls(**values)


def mapped_fields(cls: type, section: type[BaseModel], renames: Mapping[str, str] | None = None) -> set[str]:
    """The section's fields that `build(cls, section, renames=...)` reads."""
    renames = renames or {}
    return {renames.get(f.name, f.name) for f in dataclasses.fields(cls)} & set(section.model_fields)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4}


def parse_bytes(value: Any) -> Any:
    """`268435456`, `"256MiB"`, `"1GiB"`, `"512MB"` -> bytes (other types pass through)."""
    if not isinstance(value, str):
        return value
    match = _SIZE.match(value)
    if match is None:
        raise ValueError(f"not a byte size: {value!r} (examples: 268435456, '256MiB', '2GiB')")
    number, unit = float(match.group(1)), (match.group(2) or "").upper()
    if "I" in unit:  # KiB, MiB, ... (binary)
        scale = 1024 ** ("KMGT".index(unit[0]) + 1)
    else:  # K, KB, M, MB, ... (decimal), B or nothing (bytes)
        scale = _UNITS[unit if unit in ("", "B") else unit[0]]
    return int(number * scale)


# The strings parse_bytes accepts, as a JSON-schema pattern (no inline flags: draft 7).
BYTE_SIZE_PATTERN = r"^\s*[0-9]+(\.[0-9]+)?\s*([KkMmGgTt][Ii]?[Bb]?|[Bb])?\s*$"


class OrString:
    """JSON-schema side of a field that also accepts a string form (a before-validator turns
    it into the typed value): the published schema (`model_json_schema`, the Helm chart's
    values.schema.json) says `anyOf: [typed, string]`, so it accepts what the model does."""

    def __init__(self, description: str, pattern: str | None = None) -> None:
        self.string: dict[str, Any] = {"type": "string", "description": description}
        if pattern is not None:
            self.string["pattern"] = pattern

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        return {"anyOf": [handler(core_schema), dict(self.string)]}


# A section field holding a byte size: accepts parse_bytes' forms, stores the int.
ByteSize = Annotated[
    int, BeforeValidator(parse_bytes), OrString("a byte size: '256MiB', '2GiB', '512MB'", BYTE_SIZE_PATTERN),
]
