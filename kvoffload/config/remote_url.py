"""``remote_url``: where the shared remote tier lives, parsed once and checked.

Accepted forms::

    redis://host[:port][/db]          one Redis or Valkey server (port 6379, db 0)
    rediss://host[:port][/db]         the same over TLS
    redis+cluster://host[:port]       a Redis Cluster, through any one of its nodes
    rediss+cluster://host[:port]      the same over TLS

A user name may precede the host (``redis://user@host``); a password may
not: it belongs in the environment variable that ``remote_password_env``
names, so it never sits in a configuration file, a command line or a log.
"""

from __future__ import annotations

from typing import NamedTuple
from urllib.parse import urlsplit

from kvoffload.errors import ConfigError

__all__ = ["SCHEMES", "RemoteURL", "parse_remote_url"]

#: scheme -> (TLS, cluster)
SCHEMES: dict[str, tuple[bool, bool]] = {
    "redis": (False, False),
    "rediss": (True, False),
    "redis+cluster": (False, True),
    "rediss+cluster": (True, True),
}
_DEFAULT_PORT = 6379
#: Redis numbers its databases with a C int (its ``databases`` setting).
_MAX_DB = 2**31 - 1


class RemoteURL(NamedTuple):
    """A checked ``remote_url``; ``str()`` of it is safe to print (it holds no secret)."""

    host: str
    port: int
    db: int
    tls: bool
    cluster: bool
    username: str | None = None

    def __str__(self) -> str:
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        user = f"{self.username}@" if self.username else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        db = "" if self.cluster else f"/{self.db}"
        return f"{scheme}://{user}{host}:{self.port}{db}"


def parse_remote_url(key: str, text: str) -> RemoteURL:
    """Parse ``text`` (the value of ``key``); ``ConfigError`` naming what is wrong."""
    try:
        parts = urlsplit(text.strip())
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{key!r}: not a valid URL ({exc}); use redis://host:6379/0") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ConfigError(
            f"{key!r}: scheme {scheme or '(none)'!r} is not supported; use one of "
            f"{', '.join(s + '://' for s in SCHEMES)}"
        )
    if parts.password is not None:
        raise ConfigError(
            f"{key!r} must not carry a password; put it in an environment variable and name "
            "that variable in 'remote_password_env'"
        )
    if not parts.hostname:
        raise ConfigError(f"{key!r}: no host in {text.strip()!r}; use {scheme}://host:6379")
    if parts.query or parts.fragment:
        raise ConfigError(f"{key!r}: query strings and fragments are not supported")
    tls, cluster = SCHEMES[scheme]
    path = parts.path.strip("/")
    if path and not (path.isascii() and path.isdigit() and len(path) <= len(str(_MAX_DB))):
        raise ConfigError(f"{key!r}: the path must be a database number like /0, got /{path[:20]}")
    db = int(path) if path else 0
    if db > _MAX_DB:
        raise ConfigError(f"{key!r}: database /{db} is past Redis's largest, {_MAX_DB}")
    if cluster and db:
        raise ConfigError(f"{key!r}: a Redis Cluster has only database 0, got /{db}")
    if port == 0:
        raise ConfigError(f"{key!r}: port 0 is not a port; use 1 to 65535")
    return RemoteURL(parts.hostname, port or _DEFAULT_PORT, db, tls, cluster, parts.username)
