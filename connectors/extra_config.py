"""The settings an engine hands kvtier as one JSON object (vLLM's ``kv_connector_extra_config``, SGLang's
``--hicache-storage-backend-extra-config``), validated strictly: one ConfigError names every key that is
unknown, missing or wrong, so a typo stops the engine at start instead of being ignored.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from kvtier.core.errors import ConfigError

Settings = TypeVar("Settings", bound=BaseModel)


def engine_settings(model: type[Settings], extra: dict[str, Any] | None, where: str, example: str) -> Settings:
    """``extra`` as ``model``; ``where`` names the engine's option in messages, ``example`` a YAML path for them."""
    extra = extra or {}
    if "config" not in extra:
        raise ConfigError(
            f'{where} needs "config": the path of a kvtier YAML file or the same settings inline, '
            f'e.g. {{"config": "{example}"}}'
        )
    try:
        return model.model_validate(extra)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            key = ".".join(map(str, err["loc"]))
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown key {key!r}; allowed: {', '.join(model.model_fields)}")
            else:
                problems.append(f"{key}: {err['msg']} (got {err.get('input')!r:.60})")
        raise ConfigError(f"{where}: {'; '.join(problems)}") from None
