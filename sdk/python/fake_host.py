"""Runs the Python SDK and Python guests natively, outside any component, for their unit tests
(``guests/router-py/build.sh test``).

Importing it generates the WIT bindings with ``componentize-py bindings`` into a temporary
directory (the same ``wit_world`` package a build generates; never checked in), puts that on
``sys.path``, and replaces the host imports — stubs there that raise — with fakes over ``FAKE``:
``FAKE.entries`` is the committed fold (key -> (value, revision)), ``FAKE.logs`` collects
``(level, message)``, ``FAKE.page_cap`` caps a scan's page as the host does.

The WIT is the checkout's ``wit/`` (contract 0.1.0), or the directory the environment variable
``FOLDHOST_WIT`` names: ``FOLDHOST_WIT=.../wit/v0.3.0`` tests a guest of contract 0.3.0 (state
buckets, docs/state.md) with the bindings its build uses. Then the ``state`` import is faked too,
over:

- ``FAKE.buckets``: each declared bucket's committed fold, by the name the guest declares it by
  (bucket -> key -> (value, revision)). ``FAKE.declare(manifest)`` adds an empty one for each
  bucket a manifest (the SDK's or the WIT's) owns or reads. A bucket not in it is refused
  ``undeclared``; a write to one whose name has a ``.`` (another module's) ``read_only``; an
  ``if_revision`` that is not the key's revision (0: absent) ``conflict``.
- ``FAKE.refuse``: when set, ``(verb, bucket, key) -> (reason, message) or None``: a refusal the
  host would make (``wrong_call``, ``too_large``, ``bucket_full``, ...) before the fake's checks.
- ``FAKE.writes``: every write made (not those refused), ``("put", bucket, key, value,
  options)`` or ``("delete", bucket, key, options)``. A write lands in ``FAKE.buckets`` at once,
  at the bucket's next revision (``FAKE.revisions``: each bucket's last), and answers ``applied``
  (the host answers a write from a guest call ``pending``, and its fold applies it with the
  bucket's next batch).

``FAKE.packed(bucket, updates)`` makes a packed batch (0.3.0's ``parse``) of ``(key, value,
revision[, op])`` tuples — ``op`` ``"put"`` (the default), ``"delete"`` or ``"purge"``, ``value``
bytes or str, ignored for a deletion — and folds it into the fake's fold of the bucket
(``FAKE.entries`` for ``""``, the main bucket), as the host's fold holds what it gave the guest.
"""

import atexit
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

WIT = Path(os.environ.get("FOLDHOST_WIT") or Path(__file__).resolve().parents[2] / "wit")

_OPS = {"put": 0, "delete": 1, "purge": 2}


def pack(updates) -> bytes:
    """A packed batch of ``(key, value, revision[, op])`` tuples (see the module's docstring)."""
    out = bytearray()
    for key, value, revision, *op in updates:
        code = _OPS[op[0] if op else "put"]
        value = b"" if code or value is None else value.encode() if isinstance(value, str) else bytes(value)
        key = key.encode()
        out += struct.pack("<IIQB", len(key), len(value), revision, code) + key + value
    return bytes(out)


class Fake:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.entries: dict[str, tuple[bytes, int]] = {}
        self.logs: list[tuple[str, str]] = []
        self.page_cap = 10_000
        self.buckets: dict[str, dict[str, tuple[bytes, int]]] = {}
        self.refuse = None
        self.writes: list[tuple] = []
        self.revisions: dict[str, int] = {}  # each bucket's last revision ("": the main bucket)

    def declare(self, manifest) -> None:
        """An empty fold for each bucket ``manifest`` owns (``state``) or reads (``reads``)."""
        for bucket in manifest.state:
            self.buckets.setdefault(bucket.name, {})
        for bucket in manifest.reads:
            self.buckets.setdefault(bucket, {})

    def packed(self, bucket: str, updates) -> bytes:
        """``pack(updates)``, folded into the fake's fold of ``bucket`` (``""``: ``entries``)."""
        updates = list(updates)
        fold = self.entries if bucket == "" else self.buckets.setdefault(bucket, {})
        for key, value, revision, *op in updates:
            self.revisions[bucket] = max(self.revisions.get(bucket, 0), revision)
            if op and op[0] != "put":
                fold.pop(key, None)
            else:
                fold[key] = (value.encode() if isinstance(value, str) else bytes(value), revision)
        return pack(updates)


FAKE = Fake()


def _install() -> None:
    out = tempfile.mkdtemp(prefix="foldhost-py-bindings-")
    atexit.register(shutil.rmtree, out, True)
    subprocess.run(
        ["componentize-py", "-d", str(WIT), "-w", "guest", "bindings", out],
        check=True,
        capture_output=True,
    )
    sys.path.insert(0, out)
    from wit_world.imports import fold, log, types

    def get(key):
        e = FAKE.entries.get(key)
        return None if e is None else types.Entry(key, *e)

    def scan(prefix, start_after, limit):
        keys = sorted(
            k for k in FAKE.entries if k.startswith(prefix) and (start_after is None or k > start_after)
        )
        return [types.Entry(k, *FAKE.entries[k]) for k in keys[: min(limit, FAKE.page_cap)]]

    fold.get = get
    fold.scan = scan
    log.log = lambda level, message: FAKE.logs.append((level.name.lower(), message))

    try:
        from wit_world.imports import state
    except ImportError:
        return  # a contract without the state import
    _install_state(state, types)


def _install_state(state, types) -> None:
    from componentize_py_types import Err

    def refuse(reason, message):
        return Err(state.Refusal(reason, message))

    def declared(verb, bucket, key):
        refusal = FAKE.refuse and FAKE.refuse(verb, bucket, key)
        if refusal:
            raise refuse(*refusal)
        fold = FAKE.buckets.get(bucket)
        if fold is None:
            raise refuse("undeclared", f"bucket {bucket!r} is not in the manifest")
        return fold

    def writable(verb, bucket, key, options):
        fold = declared(verb, bucket, key)
        if "." in bucket:
            raise refuse("read_only", f"bucket {bucket!r} is only read")
        current = fold.get(key, (b"", 0))[1]
        if options.if_revision is not None and options.if_revision != current:
            raise refuse("conflict", f"{bucket}/{key} is at revision {current}, not {options.if_revision}")
        return fold

    def written(bucket, options):
        revision = FAKE.revisions[bucket] = FAKE.revisions.get(bucket, 0) + 1
        op_id = options.op_id or f"fake-op-{len(FAKE.writes)}"
        return revision, state.Written(state.Outcome.APPLIED, op_id, revision)

    def get(bucket, key):
        e = declared("get", bucket, key).get(key)
        return None if e is None else types.Entry(key, *e)

    def keys(bucket, prefix, start_after, limit):
        fold = declared("keys", bucket, prefix)
        found = sorted(k for k in fold if k.startswith(prefix) and (start_after is None or k > start_after))
        return found[: min(limit, FAKE.page_cap)]

    def put(bucket, key, value, options):
        fold = writable("put", bucket, key, options)
        FAKE.writes.append(("put", bucket, key, value, options))
        revision, answer = written(bucket, options)
        fold[key] = (value, revision)
        return answer

    def delete(bucket, key, options):
        fold = writable("delete", bucket, key, options)
        FAKE.writes.append(("delete", bucket, key, options))
        _, answer = written(bucket, options)
        fold.pop(key, None)
        return answer

    state.get, state.keys, state.put, state.delete = get, keys, put, delete


_install()
