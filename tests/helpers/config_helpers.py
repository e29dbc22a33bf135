"""What the config tests share: the message of the one ConfigError a bad config raises."""

from __future__ import annotations

import pytest

from kvtier.core.config import load_config
from kvtier.core.errors import ConfigError


def error_of(source) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source)
    return str(info.value)
