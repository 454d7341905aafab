"""Configuration errors a user reads: one line per problem, with the closest known key."""
from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    """An invalid configuration, with one readable line per problem."""


# Fields whose bad value is not repeated in the error (a URL may carry a password).
_UNECHOED_FIELDS = frozenset({"redis_url"})


def format_validation_error(error: ValidationError, root: type[BaseModel]) -> str:
    """One line per problem: dotted path, what is wrong, and for a typo the closest key."""
    lines = []
    for item in error.errors():
        loc = [str(p) for p in item["loc"]]
        path = ".".join(loc) or "(top level)"
        if item["type"] == "extra_forbidden":
            known = _known_fields(root, loc[:-1])
            close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            where = ".".join(loc[:-1]) or "the top level"
            lines.append(f"{path}: unknown key{hint} (known keys in {where}: {', '.join(sorted(known))})")
        else:
            message = item["msg"].removeprefix("Value error, ")
            got = repr(item.get("input"))
            if loc and loc[-1] in _UNECHOED_FIELDS:  # may hold a secret
                got = message
            lines.append(f"{path}: {message}" + ("" if got in message else f" (got {got})"))
    return "invalid kvserve configuration:\n  " + "\n  ".join(lines)


def _known_fields(root: type[BaseModel], parents: list[str]) -> list[str]:
    model: Any = root
    for part in parents:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return []
        model = _section_type(field.annotation)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return []


def _section_type(annotation: Any) -> Any:
    """`X | None` -> X for section-typed fields."""
    for arg in getattr(annotation, "__args__", (annotation,)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return annotation
