"""foldhost_guest: the Python SDK for foldhost WebAssembly guests.

A guest is a component of the world ``foldhost:guest/guest@0.1.0`` (wit/guest.wit), or, to keep
state in NATS buckets, of ``foldhost:guest/guest@0.3.0`` (wit/v0.3.0/guest.wit; see "State
buckets" below), built with componentize-py. Its raw exports are batch-shaped (``parse`` gets a
list of updates, ``apply`` gets nothing and must remember what ``parse`` accepted); this module
turns them into the shape of the Rust SDK's ``Folder`` trait (sdk/rust), so a guest author writes
only the domain logic::

    import foldhost_guest as fg

    class Greeter(fg.Folder):
        manifest = fg.Manifest("greeter", "0.1.0", ["greeting."])

        def __init__(self):
            self.greetings = {}  # name -> greeting

        def parse(self, key, value, rest):
            greeting = fg.text(value)
            return fg.SKIP if greeting is None else fg.accept(greeting)

        def apply(self, changes):
            for change in changes:
                if isinstance(change, fg.Put):
                    self.greetings[change.rest] = change.value
                else:
                    self.greetings.pop(change.rest, None)

        def query(self, request):
            name = fg.text(request, lossy=True)
            if name not in self.greetings:
                raise LookupError(f"nobody called {name}")
            return self.greetings[name]

    # componentize-py looks for the export under the WIT interface's name.
    Folder = fg.export(Greeter)

Build: ``componentize-py -d WIT_DIR -w guest componentize -p SDK_DIR -p . MODULE -o guest.wasm``.

What the SDK does between the host and the folder (the same as the Rust SDK):

- Scope: updates whose key starts with none of ``manifest.scope`` are answered skip without
  calling ``parse``. An empty scope is the whole bucket.
- Deletes and purges never reach ``parse``: in scope they are accepted and reach ``apply`` as
  ``Delete(key, rest, revision)``.
- Pending values: what the last ``parse`` accepted is kept in order and handed to the next
  ``apply``, then dropped, also when ``apply`` raises (the host retries a failed batch on a fresh
  instance rebuilt from the fold). A second ``parse`` without an ``apply`` replaces them.
- Errors: an exception from ``init``, ``apply`` or ``query`` becomes the WIT result's error string
  (its message). ``parse`` and ``on_applied`` have no error channel: an exception there is logged,
  then traps the instance (the host fails the batch and rebuilds a fresh instance).
- State: one instance of the folder class per component instance, made on first use.

``rest`` (on changes, and parse's third argument) is the key without its scope prefix: the first
that matches, in the manifest's order (as the Rust SDK's ``Change::rest``), or the whole key when
the scope is empty.

State buckets (contract 0.3.0, docs/state.md)
---------------------------------------------

Which contract a build speaks is the WIT it is built with, nothing in the guest's code: the SDK
looks at the bindings componentize-py generated (``wit_world``) and ``export`` makes the matching
export class. ``-d WIT_DIR`` (the checkout's ``wit/``) is 0.1.0, exactly as before;
``-d WIT_DIR/v0.3.0`` is 0.3.0. ``CONTRACT`` says which (``"0.1.0"`` or ``"0.3.0"``). A folder
written for 0.1.0 builds unchanged for 0.3.0 (no state, no reads: the host sees the main bucket
only); a manifest that declares ``state`` or ``reads`` fails the build on 0.1.0's bindings (at
``export``). 0.2.0's bindings are refused the same way: this SDK does not speak 0.2.0.

A 0.3.0 guest declares the buckets it owns and the other modules' buckets it reads::

    class Counter(fg.Folder):
        manifest = fg.Manifest("counter", "0.1.0", [],
                               state=[fg.StateBucket("counts")], reads=["catalog.items"])

        def apply_state(self, bucket, changes):      # "catalog.items" or "counts"
            ...                                      # Put.value is the raw bytes

        def on_applied(self, cursor):                # the main bucket committed: write here
            try:
                fg.state.put("counts", "total", str(self.count))
            except fg.Refused as refused:            # refused.reason: one word
                fg.log.warn(str(refused))            # "refused (<reason>): <message>"

and, next to the 0.1.0 API, which stays as it is for the main bucket:

- ``parse``/``apply`` see the main bucket only, with scope, deletes and pending values as above.
  (0.3.0's packed batches are unpacked by the SDK.)
- ``apply_state(bucket, changes)``: each batch of a declared bucket (``bucket`` as the manifest
  names it: the local name of an owned one, ``<module>.<name>`` of a read one), every update
  accepted without a ``parse``: ``Put.value`` is the raw bytes, ``rest`` the whole key (a state
  bucket has no scope). Raise to fail the batch, as ``apply``. The default ignores them.
- ``end_of_current(bucket)``: every current value of ``bucket`` (``""``: the main bucket) has been
  given; what follows are changes. Once per bucket per instance. The default does nothing.
- ``on_applied(cursor)`` stays the main bucket's; ``on_state_applied(bucket, cursor)`` is a
  declared bucket's (the default does nothing). ``end_of_current``, ``on_applied`` and
  ``on_state_applied`` have no error channel: an exception is logged, then traps the instance.
- ``state``: the ``state`` import. ``state.get(bucket, key)`` (an entry or ``None``),
  ``state.keys(bucket, prefix, start_after, limit)`` (one page of keys) and ``state.keys_all``
  read this node's committed fold of a declared bucket, from any call; ``state.put(bucket, key,
  value, ...)`` and ``state.delete(bucket, key, ...)`` write an owned one, from ``on_applied``,
  ``on_state_applied`` and ``query`` only (the host refuses a write from ``parse`` or ``apply``:
  they re-run on hydration and retry), and answer a ``Written`` (``outcome`` ``"applied"``,
  ``"pending"`` — durable at ``revision``, do not retry; a write from inside a guest call usually
  is — or ``"unknown"`` — retry with the same ``op_id``). A call the host refuses raises
  ``Refused``: ``reason`` is one word (``undeclared``, ``read_only``, ``wrong_call``,
  ``too_large``, ``bucket_full``, ``credential``, ``no_ttl``, or the write path's ``conflict``,
  ``op_reused``, ``permission``, ``invalid``), ``message`` the host's explanation, and its text
  ``refused (<reason>): <message>``. Uncaught, it is what any other exception is: ``apply``'s or
  ``query``'s error, a trap in ``on_applied`` — catch it where a refusal is an expected answer (a
  write from ``on_applied`` should, or a full bucket traps the instance batch after batch). On
  0.1.0's bindings every ``state`` call raises ``RuntimeError``.

The names follow the Rust SDK's ``state`` feature and the JS SDK's ``foldhost-guest/state``.

Build a 0.3.0 guest with ``componentize-py -d WIT_DIR/v0.3.0 -w guest componentize ...``; its
native tests run with ``FOLDHOST_WIT=WIT_DIR/v0.3.0`` (fake_host.py).
"""

from __future__ import annotations

import json as _json
import struct as _struct
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Iterator, Optional, TypeVar, Union

# Generated by componentize-py from the WIT while it builds the component (never checked in).
from componentize_py_types import Err
from wit_world.imports import fold as _fold
from wit_world.imports import log as _log
from wit_world.imports import types as _types

try:
    # Only contract 0.3.0's world imports `state`.
    from wit_world.imports import state as _state
except ImportError:
    _state = None

CONTRACT = "0.3.0" if _state is not None else "0.1.0" if hasattr(_types, "Update") else "0.2.0"
"""The guest contract of the bindings this build is made with: ``"0.1.0"`` or ``"0.3.0"``."""

__all__ = [
    "Manifest", "StateBucket", "Folder", "export", "accept", "Accept", "SKIP", "DEFER", "Put",
    "Delete", "Change", "log", "fold", "state", "Refused", "Written", "text", "parse_json",
    "json_bytes", "CONTRACT",
]

V = TypeVar("V")


# ---- The guest's declarations ---------------------------------------------------------------------


@dataclass(frozen=True)
class StateBucket:
    """A bucket the module owns (contract 0.3.0): its local name (1 to 32 of ``a-z``, ``0-9``,
    ``-``; the server bucket is ``state_<module>_<name>``) and the owner's options: values kept per
    key (1 to 64), how long a value lives in milliseconds (0: for ever), the most the bucket may
    hold in bytes (0: the host's cap), whether a write may carry its own time to live."""

    name: str
    history: int = 1
    max_age_ms: int = 0
    max_bytes: int = 0
    per_key_ttl: bool = False


@dataclass(frozen=True)
class Manifest:
    """Name, version and scope (key prefixes of the main bucket; empty means the whole bucket).

    Contract 0.3.0 only: ``state``, the buckets the module owns (``StateBucket``s), and
    ``reads``, other modules' buckets it reads, each ``"<module>.<name>"``. With either declared,
    ``name`` is the module's name (1 to 32 of ``a-z``, ``0-9``, ``-``)."""

    name: str
    version: str
    scope: list[str] = field(default_factory=list)
    state: list[StateBucket] = field(default_factory=list)
    reads: list[str] = field(default_factory=list)


class Accept(Generic[V]):
    """What ``parse`` returns to keep ``value`` for the next ``apply``."""

    __slots__ = ("value",)

    def __init__(self, value: V):
        self.value = value

    def __repr__(self) -> str:
        return f"accept({self.value!r})"


def accept(value: V) -> Accept[V]:
    """Apply this put: ``value`` (what parse made of the bytes) reaches ``apply`` as ``Put.value``."""
    return Accept(value)


class _Verdict:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


SKIP = _Verdict("SKIP")
"""Irrelevant or corrupt: nothing to apply (the host's cursor still moves past it)."""

DEFER = _Verdict("DEFER")
"""This version of the guest cannot decode it: the host retains it for a later version."""


@dataclass(frozen=True)
class Put(Generic[V]):
    """The key now holds ``value`` (what ``parse`` made of the raw bytes)."""

    key: str
    rest: str
    revision: int
    value: V
    op: ClassVar[str] = "put"


@dataclass(frozen=True)
class Delete:
    """The key was deleted or purged."""

    key: str
    rest: str
    revision: int
    op: ClassVar[str] = "delete"


Change = Union[Put, Delete]


class Folder:
    """A guest: decodes updates and folds them into its own live structure.

    Subclass it, set ``manifest``, implement ``parse`` and ``apply`` (and the others as needed),
    and export the subclass with ``Folder = export(MyFolder)`` at the module's top level. The
    class is instantiated without arguments, once per component instance.
    """

    manifest: ClassVar[Manifest]

    def init(self, config: dict[str, str]) -> None:
        """The operator's configuration, once, after ``manifest``. Raise to refuse it."""

    def parse(self, key: str, value: bytes, rest: str) -> Union[Accept[Any], _Verdict]:
        """Decodes one put in scope: ``accept(value)``, ``SKIP`` or ``DEFER``.

        Must not change the state: the host may fail the batch before ``apply``.
        """
        raise NotImplementedError

    def apply(self, changes: list[Change]) -> None:
        """Applies, in order, what the last ``parse`` accepted. Raise to fail the batch."""
        raise NotImplementedError

    def on_applied(self, cursor: int) -> None:
        """The host has committed everything through ``cursor`` (a bucket revision) of the main
        bucket. Contract 0.3.0: a place to write state (``state.put``)."""

    def on_state_applied(self, bucket: str, cursor: int) -> None:
        """Contract 0.3.0: the host has committed everything of the declared bucket ``bucket``
        through ``cursor``. A place to write state, as ``on_applied``."""

    def apply_state(self, bucket: str, changes: list[Change]) -> None:
        """Contract 0.3.0: applies, in order, a batch of the declared bucket ``bucket`` (every
        update, no ``parse``: ``Put.value`` is the raw bytes, ``rest`` the whole key). Raise to
        fail the batch. Must not write state (the host refuses it: the batch re-runs). The
        default ignores them."""

    def end_of_current(self, bucket: str) -> None:
        """Contract 0.3.0: every current value of ``bucket`` (``""``: the main bucket) has been
        given to this instance; what follows are changes. Once per bucket per instance."""

    def query(self, request: bytes) -> Union[bytes, str]:
        """Answers a query (a ``str`` answer is sent as UTF-8). Raise for an error answer."""
        raise LookupError("this guest answers no queries")


# ---- Text and JSON ------------------------------------------------------------------------------


def text(data: bytes, lossy: bool = False) -> Optional[str]:
    """``data`` as text: ``None`` when it is not UTF-8, or, with ``lossy``, each ill-formed
    sequence replaced by U+FFFD (as Rust's ``String::from_utf8_lossy`` does)."""
    if lossy:
        return data.decode("utf-8", "replace")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json(data: bytes, default: Any = None) -> Any:
    """The JSON value in ``data`` (UTF-8), or ``default`` when it is not UTF-8 or not strict JSON
    (NaN and Infinity are refused, as JSON has no such numbers)."""
    try:
        return _json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return default


def json_bytes(value: Any) -> bytes:
    """Compact JSON of ``value`` as UTF-8 bytes, for a query's answer (non-ASCII written as is,
    as serde_json writes it)."""
    return _json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


# ---- Logging ------------------------------------------------------------------------------------


class _Log:
    """Logging into the host's log, which tags each line with the guest's name.

    ``log.info("routes: %d", n)``: the message is %-formatted with the arguments when there are
    any, as the ``logging`` module does (a formatting error logs the message and the arguments).
    """

    _LEVELS = {
        "trace": _log.Level.TRACE,
        "debug": _log.Level.DEBUG,
        "info": _log.Level.INFO,
        "warn": _log.Level.WARN,
        "error": _log.Level.ERROR,
    }

    def log(self, level: str, message: object, *args: object) -> None:
        text = str(message)
        if args:
            try:
                text = text % args
            except (TypeError, ValueError):
                text = f"{text} {args!r}"
        _log.log(self._LEVELS[level], text)

    def trace(self, message: object, *args: object) -> None:
        self.log("trace", message, *args)

    def debug(self, message: object, *args: object) -> None:
        self.log("debug", message, *args)

    def info(self, message: object, *args: object) -> None:
        self.log("info", message, *args)

    def warn(self, message: object, *args: object) -> None:
        self.log("warn", message, *args)

    def error(self, message: object, *args: object) -> None:
        self.log("error", message, *args)


log = _Log()

# ---- The committed fold -------------------------------------------------------------------------

# The host caps a page at 10 000 entries; a smaller default keeps one page's memory modest.
_DEFAULT_PAGE = 1000


class _Fold:
    """Read access to the host's committed fold: the raw bytes of the bucket as of the last
    committed batch, never the batch being applied. Entries have ``key``, ``value`` (bytes) and
    ``revision``."""

    @staticmethod
    def get(key: str) -> Optional[_types.Entry]:
        """The live entry for ``key``, or ``None``."""
        return _fold.get(key)

    @staticmethod
    def scan(prefix: str, start_after: Optional[str] = None, limit: int = _DEFAULT_PAGE) -> list[_types.Entry]:
        """One page of the entries whose key starts with ``prefix``, in key order, strictly after
        ``start_after``. The host caps ``limit``, so a short page is not the end: page on with the
        last key as ``start_after`` until a page comes back empty (or use ``scan_all``)."""
        return _fold.scan(prefix, start_after, limit)

    @staticmethod
    def scan_all(prefix: str, page_size: int = _DEFAULT_PAGE) -> Iterator[_types.Entry]:
        """Every entry whose key starts with ``prefix``, in key order, a page at a time."""
        start_after = None
        while True:
            page = _fold.scan(prefix, start_after, page_size)
            if not page:
                return
            yield from page
            start_after = page[-1].key


fold = _Fold()

# ---- State buckets (contract 0.3.0) -------------------------------------------------------------


class Refused(Exception):
    """A ``state`` call the host refused, before anything reached the server: ``reason`` is one
    word (``undeclared``, ``read_only``, ``wrong_call``, ``too_large``, ``bucket_full``,
    ``credential``, ``no_ttl``, or the write path's ``conflict``, ``op_reused``, ``permission``,
    ``invalid``), ``message`` says what and why, for a person. Its text is
    ``"refused (<reason>): <message>"`` (what a query answers when it lets the exception out)."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"refused ({reason}): {message}")
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Written:
    """How a write went: ``outcome`` ``"applied"`` (durable at ``revision`` and applied by this
    node's fold), ``"pending"`` (durable at ``revision``, not applied here yet: do not retry) or
    ``"unknown"`` (retry with the same ``op_id``); ``op_id`` is the caller's or the one the host
    minted."""

    outcome: str
    op_id: str
    revision: Optional[int]


def _state_call(verb: str, *args: Any) -> Any:
    if _state is None:
        raise RuntimeError(
            f"state.{verb}: the state import is contract 0.3.0's, and this build's bindings are "
            f"{CONTRACT}'s: build with componentize-py -d WIT_DIR/v0.3.0"
        )
    try:
        return getattr(_state, verb)(*args)
    except Err as e:
        refusal = e.value
        raise Refused(refusal.reason, refusal.message) from None


def _options(op_id: Optional[str], if_revision: Optional[int], wait_ms: int,
             ttl_ms: Optional[int]) -> Any:
    return _state.WriteOptions(op_id, if_revision, wait_ms, ttl_ms) if _state is not None else None


def _written(w: Any) -> Written:
    return Written(w.outcome.name.lower(), w.op_id, w.revision)


class _State:
    """The module's state buckets (the ``state`` import of contract 0.3.0), each named as the
    manifest declares it: an owned one by its local name, a read one as ``<module>.<name>``. Reads
    come from this node's committed fold of the bucket (what the guest was given through
    ``apply_state``); writes go to the server through the host's write path. A refusal raises
    ``Refused``. Entries have ``key``, ``value`` (bytes) and ``revision``."""

    @staticmethod
    def get(bucket: str, key: str) -> Optional[_types.Entry]:
        """The live entry for ``key`` in ``bucket``, or ``None``."""
        return _state_call("get", bucket, key)

    @staticmethod
    def keys(bucket: str, prefix: str = "", start_after: Optional[str] = None,
             limit: int = _DEFAULT_PAGE) -> list[str]:
        """One page of the keys of ``bucket`` that start with ``prefix``, in key order, strictly
        after ``start_after``. The host caps ``limit``: page on with the last key until a page
        comes back empty (or use ``keys_all``)."""
        return _state_call("keys", bucket, prefix, start_after, limit)

    @staticmethod
    def keys_all(bucket: str, prefix: str = "", page_size: int = _DEFAULT_PAGE) -> Iterator[str]:
        """Every key of ``bucket`` that starts with ``prefix``, in key order, a page at a time."""
        start_after = None
        while True:
            page = _state_call("keys", bucket, prefix, start_after, page_size)
            if not page:
                return
            yield from page
            start_after = page[-1]

    @staticmethod
    def put(
        bucket: str,
        key: str,
        value: Union[bytes, str],
        *,
        op_id: Optional[str] = None,
        if_revision: Optional[int] = None,
        wait_ms: int = 0,
        ttl_ms: Optional[int] = None,
    ) -> Written:
        """Writes ``value`` (bytes, or str sent as UTF-8) at ``key`` of an owned bucket, from
        ``on_applied``, ``on_state_applied`` or ``query`` only. ``op_id`` (a UUIDv7) makes a retry
        safe (the host mints one when absent); ``if_revision`` makes it a compare-and-set (0: the
        key is absent); ``wait_ms`` (from ``query``) how long to wait for this node's fold to apply
        it; ``ttl_ms`` a time to live of its own (a bucket declared ``per_key_ttl``)."""
        if isinstance(value, str):
            value = value.encode()
        options = _options(op_id, if_revision, wait_ms, ttl_ms)
        return _written(_state_call("put", bucket, key, bytes(value), options))

    @staticmethod
    def delete(
        bucket: str,
        key: str,
        *,
        op_id: Optional[str] = None,
        if_revision: Optional[int] = None,
        wait_ms: int = 0,
        ttl_ms: Optional[int] = None,
    ) -> Written:
        """Deletes ``key`` of an owned bucket (the same calls and options as ``put``)."""
        options = _options(op_id, if_revision, wait_ms, ttl_ms)
        return _written(_state_call("delete", bucket, key, options))


state = _State()

# ---- The folder export --------------------------------------------------------------------------


def _message(e: BaseException) -> str:
    """An exception's message (``str(KeyError("x"))`` would quote it)."""
    if len(e.args) == 1 and isinstance(e.args[0], str):
        return e.args[0]
    return str(e) or type(e).__name__


def _strip_scope(scope: list[str], key: str) -> Optional[str]:
    """``key`` without the first scope prefix (in the manifest's order) it starts with, as the Rust
    SDK's ``Manifest::strip``; ``None`` when outside the scope. An empty scope is the whole bucket."""
    if not scope:
        return key
    prefix = next((p for p in scope if key.startswith(p)), None)
    return None if prefix is None else key[len(prefix):]


class _Runtime:
    """A guest's whole state inside the component: the folder, its scope, and what the last
    ``parse`` accepted."""

    def __init__(self, cls: type[Folder]):
        manifest = cls.manifest
        if not isinstance(manifest, Manifest):
            raise TypeError(f"{cls.__name__}.manifest must be a foldhost_guest.Manifest")
        self.manifest = manifest
        self.scope = list(manifest.scope)
        self.folder = cls()
        self.pending: list[Change] = []

    def verdict(self, key: str, value: bytes, revision: int, is_put: bool) -> _types.Verdict:
        """One main-bucket update's verdict; what it accepts joins ``pending``."""
        rest = _strip_scope(self.scope, key)
        if rest is None:
            return _types.Verdict.SKIP
        if not is_put:
            # A delete or a purge: nothing to decode.
            self.pending.append(Delete(key, rest, revision))
            return _types.Verdict.ACCEPT
        try:
            verdict = self.folder.parse(key, value, rest)
        except Exception as e:
            log.error("parse raised on %r: %s", key, _message(e))
            raise
        if isinstance(verdict, Accept):
            self.pending.append(Put(key, rest, revision, verdict.value))
            return _types.Verdict.ACCEPT
        if verdict is SKIP:
            return _types.Verdict.SKIP
        if verdict is DEFER:
            return _types.Verdict.DEFER
        message = f"parse returned {verdict!r} for {key!r}: return accept(value), SKIP or DEFER"
        log.error(message)
        raise TypeError(message)

    def parse(self, batch: list[_types.Update]) -> list[_types.Verdict]:
        self.pending = []
        return [self.verdict(u.key, u.value, u.revision, u.op == _types.Op.PUT) for u in batch]

    def apply(self) -> None:
        changes, self.pending = self.pending, []
        self.folder.apply(changes)

    def query(self, request: bytes) -> bytes:
        try:
            answer = self.folder.query(request)
        except Exception as e:
            raise Err(_message(e))
        if isinstance(answer, str):
            return answer.encode()
        if isinstance(answer, (bytes, bytearray, memoryview)):
            return bytes(answer)
        raise Err(f"query returned {type(answer).__name__}: return bytes or str")


# A packed update's header (contract 0.3.0): key length, value length, revision, op.
_HEADER = _struct.Struct("<IIQB")


def _unpack(batch: bytes) -> Iterator[tuple[str, bytes, int, int]]:
    """The updates of a packed batch, as ``(key, value, revision, op byte)``. A host never sends a
    torn or malformed batch: one raises ``ValueError``."""
    view = memoryview(batch)
    at, end = 0, len(view)
    while at < end:
        if end - at < _HEADER.size:
            raise ValueError(f"packed batch torn at byte {at}: a header needs {_HEADER.size} bytes")
        key_len, value_len, revision, op = _HEADER.unpack_from(view, at)
        at += _HEADER.size
        if end - at < key_len + value_len or op > 2:
            raise ValueError(f"packed batch malformed at byte {at - _HEADER.size}")
        key = str(view[at:at + key_len], "utf-8")
        at += key_len
        yield key, bytes(view[at:at + value_len]), revision, op
        at += value_len


class _StateRuntime(_Runtime):
    """Contract 0.3.0's runtime: packed batches tagged with their bucket. A main-bucket batch goes
    through the folder's ``parse`` and ``apply`` as in 0.1.0; a state bucket's through
    ``apply_state``."""

    def __init__(self, cls: type[Folder]):
        super().__init__(cls)
        m = self.manifest
        for bucket in m.state:
            if not isinstance(bucket, StateBucket):
                raise TypeError(f"{cls.__name__}.manifest.state: {bucket!r} is not a StateBucket")
        for read in m.reads:
            if not isinstance(read, str):
                raise TypeError(f"{cls.__name__}.manifest.reads: {read!r} is not a str")
        self.bucket = ""  # the bucket of the last parse

    def wit_manifest(self) -> _types.GuestManifest:
        m = self.manifest
        state = [
            _types.StateBucket(b.name, b.history, b.max_age_ms, b.max_bytes, b.per_key_ttl)
            for b in m.state
        ]
        return _types.GuestManifest(m.name, m.version, list(m.scope), state, list(m.reads))

    def parse_packed(self, bucket: str, batch: bytes) -> list[_types.Verdict]:
        self.pending = []
        self.bucket = bucket
        try:
            updates = list(_unpack(batch))
        except ValueError as e:  # UnicodeDecodeError included
            log.error("parse of bucket %r: %s", bucket, _message(e))
            raise
        if bucket == "":
            return [self.verdict(key, value, rev, op == 0) for key, value, rev, op in updates]
        for key, value, revision, op in updates:
            change = Put(key, key, revision, value) if op == 0 else Delete(key, key, revision)
            self.pending.append(change)
        return [_types.Verdict.ACCEPT] * len(updates)

    def apply(self) -> None:
        changes, self.pending = self.pending, []
        if self.bucket == "":
            self.folder.apply(changes)
        else:
            self.folder.apply_state(self.bucket, changes)

    def on_applied(self, bucket: str, cursor: int) -> None:
        if bucket == "":
            self.folder.on_applied(cursor)
        else:
            self.folder.on_state_applied(bucket, cursor)


def export(cls: type[Folder]) -> type:
    """The class componentize-py exports as the WIT interface ``folder``: assign it to ``Folder``
    at the guest module's top level (``Folder = export(MyFolder)``). It holds no state of its own
    (whether the runtime makes one instance or one per call does not matter): the folder lives in
    one runtime, made on the first call.

    Its shape is the contract of the bindings the build generated (``CONTRACT``): 0.1.0's, or
    0.3.0's (packed batches tagged with a bucket, ``end_of_current``). A manifest that declares
    ``state`` or ``reads`` is refused here, so the build fails, unless the bindings are 0.3.0's."""
    if CONTRACT == "0.3.0":
        return _export_state(cls)
    manifest = getattr(cls, "manifest", None)
    if CONTRACT != "0.1.0" or (isinstance(manifest, Manifest) and (manifest.state or manifest.reads)):
        what = "declares state buckets" if CONTRACT == "0.1.0" else "is built"
        raise TypeError(
            f"{cls.__name__} {what} against contract {CONTRACT}'s bindings: the Python SDK speaks "
            "0.1.0 (componentize-py -d WIT_DIR) and, for state buckets, 0.3.0 (-d WIT_DIR/v0.3.0)"
        )
    return _export_v1(cls)


def _export_v1(cls: type[Folder]) -> type:
    """Contract 0.1.0's export class."""
    runtime: Optional[_Runtime] = None

    def rt() -> _Runtime:
        nonlocal runtime
        if runtime is None:
            runtime = _Runtime(cls)
        return runtime

    class FolderExport:
        @staticmethod
        def instance() -> Folder:
            """The folder instance (made on first use): for a guest's native tests."""
            return rt().folder

        def manifest(self) -> _types.GuestManifest:
            m = rt().manifest
            return _types.GuestManifest(m.name, m.version, list(m.scope))

        def init(self, config: list[tuple[str, str]]) -> None:
            try:
                rt().folder.init(dict(config))
            except Exception as e:
                raise Err(_message(e))

        def parse(self, batch: list[_types.Update]) -> list[_types.Verdict]:
            return rt().parse(batch)

        def apply(self) -> None:
            try:
                rt().apply()
            except Exception as e:
                raise Err(_message(e))

        def on_applied(self, cursor: int) -> None:
            try:
                rt().folder.on_applied(cursor)
            except Exception as e:
                log.error("on_applied raised: %s", _message(e))
                raise

        def query(self, request: bytes) -> bytes:
            return rt().query(request)

    FolderExport.__name__ = FolderExport.__qualname__ = f"{cls.__name__}Export"
    return FolderExport


def _export_state(cls: type[Folder]) -> type:
    """Contract 0.3.0's export class."""
    runtime: Optional[_StateRuntime] = None

    def rt() -> _StateRuntime:
        nonlocal runtime
        if runtime is None:
            runtime = _StateRuntime(cls)
        return runtime

    class FolderExport:
        @staticmethod
        def instance() -> Folder:
            """The folder instance (made on first use): for a guest's native tests."""
            return rt().folder

        def manifest(self) -> _types.GuestManifest:
            return rt().wit_manifest()

        def init(self, config: list[tuple[str, str]]) -> None:
            try:
                rt().folder.init(dict(config))
            except Exception as e:
                raise Err(_message(e))

        def parse(self, bucket: str, batch: bytes) -> list[_types.Verdict]:
            return rt().parse_packed(bucket, batch)

        def apply(self) -> None:
            try:
                rt().apply()
            except Exception as e:
                raise Err(_message(e))

        def end_of_current(self, bucket: str) -> None:
            try:
                rt().folder.end_of_current(bucket)
            except Exception as e:
                log.error("end_of_current(%r) raised: %s", bucket, _message(e))
                raise

        def on_applied(self, bucket: str, cursor: int) -> None:
            try:
                rt().on_applied(bucket, cursor)
            except Exception as e:
                log.error("on_applied(%r) raised: %s", bucket, _message(e))
                raise

        def query(self, request: bytes) -> bytes:
            return rt().query(request)

    FolderExport.__name__ = FolderExport.__qualname__ = f"{cls.__name__}Export"
    return FolderExport
