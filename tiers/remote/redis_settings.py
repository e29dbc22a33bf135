"""Redis or Valkey as a remote tier's backend (``backend: redis``): its settings and how to open its
clients (``redis_client``, imported only then: the redis package is an optional extra)."""

from __future__ import annotations

import functools
import os
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from kvtier.core.config import ConfigModel, EnvName, env_name_hint
from kvtier.core.errors import ConfigError
from kvtier.tiers.remote.config import INSTALL, StoreBackend
from kvtier.tiers.remote.link import Connector


class RedisConfig(ConfigModel):
    """How to reach a Redis or Valkey server. The password comes from the environment (``password_env``)."""

    url: str = Field(
        pattern=r"^rediss?://\S+$",  # redis://host:port/db, or rediss:// for TLS
        description="a redis:// or rediss:// URL, e.g. redis://127.0.0.1:6379/0",
    )
    password_env: EnvName | None = Field(None, description=env_name_hint("KVTIER_REDIS_PASSWORD"))
    pool_size: int = Field(4, ge=1)  # connections open at once for loads and stores (calls in parallel)
    ca_file: str | None = Field(None, min_length=1)  # the CA that signs a rediss:// server's certificate

    @field_validator("url")
    @classmethod
    def _no_password(cls, value: str) -> str:
        if urlsplit(value).password is not None:
            raise ValueError(
                "the URL carries a password; remove it and name an environment variable holding "
                "it in password_env (a secret never belongs in a config file)"
            )
        return value

    @model_validator(mode="after")
    def _ca_for_tls(self) -> RedisConfig:
        if self.ca_file is not None and not self.url.startswith("rediss://"):
            raise ValueError("ca_file applies to TLS connections only; use a rediss:// URL or remove ca_file")
        return self


def connector(options: RedisConfig, timeout: float, lends_memory: bool) -> Connector:
    """The configured pool of connections, calls in parallel; a password only from the environment."""
    try:
        from kvtier.tiers.remote.redis_client import RedisClient
    except ImportError as exc:
        raise ConfigError(f"backend: redis needs the redis and hiredis packages ({exc}); {INSTALL}") from None
    connect = functools.partial(
        RedisClient, options.url, timeout=timeout, password=_password(options.password_env), ca_file=options.ca_file
    )
    return Connector(connect, options.pool_size, f"redis at {options.url}")


def _password(env_name: str | None) -> str | None:
    """The server's password from the environment variable ``env_name``; never a config value."""
    if env_name is None:
        return None
    value = os.environ.get(env_name, "")
    if not value:
        raise ConfigError(
            f"password_env: the environment variable {env_name} is unset or empty; set it to the "
            f"server's password, or remove password_env"
        )
    return value


BACKEND = StoreBackend("redis", RedisConfig, connector)
