"""The example database of a fuzzing campaign: one place where nothing a run finds is lost, on one machine or many.

``kvproof fuzz --db PATH`` (default ``.kvproof/hypothesis``) keeps Hypothesis' own
``DirectoryBasedExampleDatabase`` there; ``--db redis://host:port/N`` keeps Hypothesis' ``RedisExampleDatabase``
(the optional extra ``kvproof[redis]``: the ``redis`` client) so that a fleet of machines shares one store
(upstream_0523_vllm_fuzz.md §4.2). Two kinds of entries live in it:

* Hypothesis' own, under the test's key (its choice sequences: saved the moment a failure is found and replaced
  as it shrinks; replayed first by every later run of the same test, on any machine sharing the store);
* kvproof's replayable vectors (:mod:`kvproof.conformance.vector`, JSON) under :func:`vector_key` of the test:
  what a breadth run (no Hypothesis engine) finds, and every failure's vector, so that a machine without the
  finder's ``.kvproof/failures/`` replays it too (:func:`save_vector`, :func:`load_vectors`).

A test's identity here is its component, config, implementation and run options (:func:`test_identity`): the same
suite against another implementation is another test, so a failure of a mutant is never replayed against the
runtime (and never deleted by it).
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from kvproof.conformance.errors import UsageError

__all__ = ["DEFAULT_DB", "DatabaseSpec", "load_vectors", "open_database", "save_vector", "test_identity",
           "vector_key"]

#: Where ``kvproof fuzz`` keeps its examples by default.
DEFAULT_DB = ".kvproof/hypothesis"
#: Seconds to wait for a Redis server before the run is refused (a fleet's store must be up when a worker starts).
REDIS_TIMEOUT_S = 5.0


class DatabaseSpec(str):
    """``--db``'s value as given: a directory, or ``redis://host[:port][/db]``."""

    @property
    def is_redis(self) -> bool:
        return self.startswith(("redis://", "rediss://", "unix://"))


def open_database(spec: str | None) -> ExampleDatabase:
    """The example database ``spec`` names (``None``: :data:`DEFAULT_DB`); :class:`UsageError` naming what is wrong:
    an unreadable directory, a Redis URL without the ``redis`` client installed, or a server that does not answer."""
    spec = DatabaseSpec(spec or DEFAULT_DB)
    if not spec.is_redis:
        path = Path(spec)
        if path.exists() and not path.is_dir():
            raise UsageError(f"--db {spec!r}: not a directory")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UsageError(f"--db {spec!r}: cannot create the directory ({err})") from err
        if not os.access(path, os.W_OK):
            raise UsageError(f"--db {spec!r}: the directory is not writable")
        return DirectoryBasedExampleDatabase(str(path))
    try:
        import redis
        from hypothesis.extra.redis import RedisExampleDatabase
    except ImportError as err:
        raise UsageError(f"--db {spec!r}: a Redis database needs the redis client: pip install 'kvproof[redis]' "
                         f"({err})") from err
    parsed = urllib.parse.urlparse(spec)
    if parsed.scheme != "unix" and not parsed.hostname:
        raise UsageError(f"--db {spec!r}: no host in the Redis URL (redis://host:port/db)")
    try:
        client = redis.Redis.from_url(spec, socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=30.0)
        client.ping()
    except (redis.RedisError, ValueError, OSError) as err:
        raise UsageError(f"--db {spec!r}: the Redis server does not answer ({type(err).__name__}: {err})") from err
    return RedisExampleDatabase(client)


def test_identity(component: str, label: str, impl: str, options: Mapping[str, Any]) -> str:
    """A test's name in the database: ``kvproof:<component>/<config>`` and, when it is not kvproof's default run,
    the implementation and the run options (the name Hypothesis digests into the database key)."""
    extra = json.dumps({"impl": impl, "options": dict(options)}, sort_keys=True, default=str)
    digest = hashlib.sha256(extra.encode()).hexdigest()[:12]
    return f"kvproof:{component}/{label}#{digest}"


def vector_key(identity: str) -> bytes:
    """The database key under which kvproof keeps the vectors of test ``identity``."""
    return b"kvproof.vectors." + hashlib.sha256(identity.encode()).hexdigest().encode()


def save_vector(db: ExampleDatabase, identity: str, vector: Mapping[str, Any],
                replaces: Mapping[str, Any] | None = None) -> None:
    """Keep ``vector`` (a failure) under the test's vector key, in place of ``replaces`` (the unshrunk vector saved
    when the failure was first seen); saving the same vector twice keeps it once."""
    key = vector_key(identity)
    db.save(key, json.dumps(vector, sort_keys=True).encode())
    if replaces is not None and replaces != vector:
        db.delete(key, json.dumps(replaces, sort_keys=True).encode())


def load_vectors(db: ExampleDatabase, identity: str) -> list[dict[str, Any]]:
    """Every vector kept for the test, oldest first where the store knows (a set in Redis: in its order)."""
    out = []
    for raw in db.fetch(vector_key(identity)):
        try:
            vector = json.loads(raw)
        except ValueError:
            continue
        if isinstance(vector, dict):
            out.append(vector)
    return out
