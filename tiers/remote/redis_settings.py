"""Redis or Valkey as a remote tier's backend (``backend: redis``): its settings and how to open its
clients (``redis_client``, or ``redis_cluster`` for a Redis Cluster; imported only then: the redis
package is an optional extra)."""

from __future__ import annotations

import functools
import os
import re
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from kvtier.core.config_messages import Problems
from kvtier.core.errors import ConfigError, shown
from kvtier.core.tier_config import ConfigModel, EnvName, ProblemList, env_name_hint
from kvtier.tiers.remote.config import INSTALL, StoreBackend
from kvtier.tiers.remote.link import Connector

URL = re.compile(r"rediss?://\S+")  # redis://host:port/db, or rediss:// for TLS
URL_HINT = "a redis:// or rediss:// URL, e.g. redis://127.0.0.1:6379/0"


class RedisConfig(ConfigModel):
    """How to reach a Redis or Valkey server, or a Redis Cluster (``cluster: true``: ``url`` and ``seeds``
    are some of its nodes, every node reached with the same options). The password comes from the
    environment (``password_env``)."""

    url: str = Field(pattern=f"^{URL.pattern}$", description=URL_HINT)
    password_env: EnvName | None = Field(None, description=env_name_hint("KVTIER_REDIS_PASSWORD"))
    pool_size: int = Field(4, ge=1)  # connections open at once for loads and stores, and for a stack's lookups
    ca_file: str | None = Field(None, min_length=1)  # the CA that signs a rediss:// server's certificate
    cluster: bool = False  # url is one node of a Redis Cluster; records spread over its hash slots
    seeds: list[str] = []  # more nodes' URLs, asked for the cluster's topology when url's node is down

    @field_validator("url")
    @classmethod
    def _no_password(cls, value: str) -> str:
        return _without_password(value)

    @field_validator("seeds")
    @classmethod
    def _seed_urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not URL.fullmatch(url):
                raise ValueError(f"{shown(url)} is not {URL_HINT}")
        return [_without_password(url) for url in value]

    @model_validator(mode="after")
    def _ca_for_tls(self) -> RedisConfig:
        if self.ca_file is not None and not self.url.startswith("rediss://"):
            raise ValueError("ca_file applies to TLS connections only; use a rediss:// URL or remove ca_file")
        return self

    @model_validator(mode="after")
    def _seeds_of_a_cluster(self) -> RedisConfig:
        """Seeds name more nodes of the same cluster, reached the same way; a cluster has database 0 only."""
        problems: ProblemList = []
        if self.seeds and not self.cluster:
            problems.append((("seeds",), "seeds apply to a Redis Cluster only; set cluster: true or remove seeds"))
        scheme = urlsplit(self.url).scheme
        for i, url in enumerate(self.seeds):
            if urlsplit(url).scheme != scheme:
                problems.append(
                    (
                        ("seeds", i),
                        f"{url} is not a {scheme}:// URL like url: every node of a cluster is reached the same "
                        f"way (TLS or not)",
                    )
                )
        if self.cluster:
            for path, url in ((("url",), self.url), *((("seeds", i), url) for i, url in enumerate(self.seeds))):
                if urlsplit(url).path.strip("/") not in ("", "0"):
                    problems.append((path, f"{url} names a database; a Redis Cluster has database 0 only"))
        if problems:
            raise Problems(problems)
        return self


def connector(options: RedisConfig, timeout: float, lends_memory: bool) -> Connector:
    """The configured pool of connections, calls in parallel; a password only from the environment."""
    try:
        from kvtier.tiers.remote.redis_client import RedisClient
        from kvtier.tiers.remote.redis_cluster import RedisClusterClient
    except ImportError as exc:
        raise ConfigError(f"backend: redis needs the redis and hiredis packages ({exc}); {INSTALL}") from None
    password = _password(options.password_env)
    if options.cluster:
        cluster = functools.partial(
            RedisClusterClient,
            options.url,
            timeout=timeout,
            password=password,
            ca_file=options.ca_file,
            seeds=tuple(options.seeds),
        )
        return Connector(cluster, options.pool_size, f"redis cluster at {options.url}")
    connect = functools.partial(RedisClient, options.url, timeout=timeout, password=password, ca_file=options.ca_file)
    return Connector(connect, options.pool_size, f"redis at {options.url}")


def _without_password(url: str) -> str:
    if urlsplit(url).password is not None:
        raise ValueError(
            "the URL carries a password; remove it and name an environment variable holding "
            "it in password_env (a secret never belongs in a config file)"
        )
    return url


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


BACKEND = StoreBackend("redis", RedisConfig, connector, fetches=True)
