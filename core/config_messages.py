"""pydantic's validation errors of a kvtier config turned into messages that name the key as the user wrote
it (``tiers[1].capacity``), the value, and what is allowed.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from kvtier.core.errors import shown


class Problems(ValueError):
    """Errors found by a cross-field check, each at its own key path below the validated model."""

    def __init__(self, problems: list[tuple[tuple[str | int, ...], str]]) -> None:
        super().__init__("; ".join(msg for _, msg in problems))
        self.problems = problems


Tagged = Mapping[str, type[BaseModel]]
"""The models a discriminated union picks between, by tag (the tier models by medium)."""


def _key_path(loc: tuple[str | int, ...], tagged: Tagged) -> str:
    """``('tiers', 1, 'host', 'capacity')`` -> ``tiers[1].capacity``: indices in brackets, union tags dropped."""
    out = ""
    prev: str | int | None = None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(prev, int) and part in tagged:
            pass  # pydantic's discriminator tag, not a key the user wrote
        else:
            out += f".{part}" if out else str(part)
        prev = part
    return out


def _only_model(annotation: Any) -> type[BaseModel] | None:
    """The one model class inside a field's type (``X | None``, ``list[X]``), or None if zero or several."""
    found: list[type[BaseModel]] = []

    def walk(tp: Any) -> None:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            found.append(tp)
        for arg in typing.get_args(tp):
            walk(arg)

    walk(annotation)
    return found[0] if len(found) == 1 else None


def _model_at(loc: tuple[str | int, ...], root: type[BaseModel], tagged: Tagged) -> type[BaseModel] | None:
    """The model that validated the mapping at ``loc`` (with pydantic's tags), for listing its keys."""
    model: type[BaseModel] | None = root
    for part in loc:
        if isinstance(part, int):
            continue
        if model is not None and part in model.model_fields:
            model = _only_model(model.model_fields[part].annotation)
        elif part in tagged:  # a union's tag: the model it picked (below a field typed by the union's base)
            model = tagged[part]
        else:
            return None
    return model


def _field_at(loc: tuple[str | int, ...], root: type[BaseModel], tagged: Tagged) -> FieldInfo | None:
    """The field that validated the value at ``loc``, if a model's field did."""
    model = _model_at(loc[:-1], root, tagged)
    return model.model_fields.get(loc[-1]) if model is not None and isinstance(loc[-1], str) else None


def _literal_values(field: FieldInfo | None) -> list[Any] | None:
    if field is None:
        return None
    for tp in [field.annotation, *typing.get_args(field.annotation)]:
        if typing.get_origin(tp) is Literal:
            return list(typing.get_args(tp))
    return None


_TYPE_NAMES = {
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "list_type": "a list",
    "int_from_float": "an integer",
}
_BOUNDS = {
    "greater_than": ("gt", "greater than"),
    "greater_than_equal": ("ge", "at least"),
    "less_than": ("lt", "less than"),
    "less_than_equal": ("le", "at most"),
}


def explain(exc: ValidationError, root: type[BaseModel], tagged: Tagged) -> list[tuple[str, str]]:
    """Each of ``exc``'s errors (validating ``root``, whose union of ``tagged`` models picks by ``medium``) as
    (key path, message naming the value and what is allowed). A pattern a string must match is explained
    by its field's ``description``."""
    out: list[tuple[str, str]] = []
    media = ", ".join(tagged)
    for err in exc.errors(include_url=False):
        kind, loc, value, ctx = err["type"], tuple(err["loc"]), err.get("input"), err.get("ctx") or {}
        path = _key_path(loc, tagged)
        if kind == "extra_forbidden":
            model = _model_at(loc[:-1], root, tagged)
            allowed = f"; allowed: {', '.join(model.model_fields)}" if model is not None else ""
            out.append((path, f"unknown key {str(loc[-1])!r}{allowed}"))
        elif kind == "missing":
            out.append((_key_path(loc[:-1], tagged), f"missing key {str(loc[-1])!r}"))
        elif kind == "union_tag_invalid":
            tag = value["medium"] if isinstance(value, dict) and "medium" in value else ctx.get("tag")
            out.append((_key_path(loc + ("medium",), tagged), f"{shown(tag)} is not a medium; allowed: {media}"))
        elif kind == "union_tag_not_found":
            out.append((path, f"missing key 'medium'; allowed media: {media}"))
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            model = _model_at(loc, root, tagged)
            keys = (
                f" with keys {', '.join(model.model_fields)}"
                if model is not None
                else f" such as {{medium: host, capacity: 8GiB}} (media: {media})"
            )
            out.append((path, f"expected a mapping{keys}, got {shown(value)}"))
        elif kind == "literal_error":
            values = _literal_values(_field_at(loc, root, tagged))
            allowed = ", ".join(map(str, values)) if values else ctx.get("expected", "?")
            out.append((path, f"{shown(value)} is not allowed; allowed: {allowed}"))
        elif kind in ("value_error", "assertion_error"):
            error = ctx.get("error")
            if isinstance(error, Problems):
                out.extend((_key_path(loc + sub, tagged), msg) for sub, msg in error.problems)
            else:
                out.append((path, str(error) if error is not None else err["msg"]))
        elif kind in _TYPE_NAMES:
            out.append((path, f"expected {_TYPE_NAMES[kind]}, got {shown(value)}"))
        elif kind in _BOUNDS:
            key, words = _BOUNDS[kind]
            out.append(
                (path, f"{shown(value)} is too {'small' if key[0] == 'g' else 'large'}; must be {words} {ctx.get(key)}")
            )
        elif kind == "too_short" and isinstance(value, list) and not value:
            out.append((path, f"needs at least {ctx.get('min_length', 1)} entry, got an empty list"))
        elif kind == "string_too_short":
            out.append((path, f"{shown(value)} is empty; give a non-empty string"))
        elif kind == "string_pattern_mismatch":
            field = _field_at(loc, root, tagged)
            wanted = (
                field.description
                if field is not None and field.description
                else f"a string matching {ctx.get('pattern')}"
            )
            out.append((path, f"{shown(value)} is not {wanted}"))
        else:
            out.append((path, f"{err['msg']} (got {shown(value)})"))
    return out
