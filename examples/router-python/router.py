"""router-py: the router guest (guests/router) in Python, with the same answers byte for byte.

Keys ``route.<host>`` hold JSON ``{"upstream": "<addr>"}``. A query's request is a host name
(UTF-8); the answer is ``{"upstream":"<addr>"}``, or the error ``unknown host: <name>``.

The key's current value is the truth: a put whose value is not such a route (unparseable, no
``upstream`` string, an empty one) removes the host's route, exactly as if the router were rebuilt
from the fold. A key with an empty host (``route.``) is skipped.

Why a hand-written decoder instead of json.loads: the Rust router decodes with serde_json into
``struct Route { upstream: String }``, and a host may run either guest over the same bucket, so the
two must agree on every value. serde_json differs from json.loads at the edges: it refuses a
duplicate "upstream" (json.loads keeps the last), NaN and Infinity, and lone surrogate escapes and
ill-formed UTF-8 in the strings it decodes (the keys and the upstream) but not in the values it
skips; it takes the one-element array form ``["<addr>"]``; and json.loads stops at a nesting depth
serde_json's skipping does not have. decode_route reproduces serde_json, as guests/router-c/router.c
does in C.
"""

from __future__ import annotations

import re
from typing import Optional

import foldhost_guest as fg

PREFIX = "route."


class Router(fg.Folder):
    manifest = fg.Manifest("router-py", "0.1.0", [PREFIX])

    def __init__(self) -> None:
        self.routes: dict[str, str] = {}  # host -> upstream

    def parse(self, key: str, value: bytes, host: str):
        # The value is the upstream, or None for a value that is not a route (no route for host).
        return fg.SKIP if host == "" else fg.accept(decode_route(value))

    def apply(self, changes: list[fg.Change]) -> None:
        for change in changes:
            if isinstance(change, fg.Put) and change.value is not None:
                self.routes[change.rest] = change.value
            else:
                self.routes.pop(change.rest, None)

    def query(self, request: bytes) -> bytes:
        # Lossy, as the Rust router's String::from_utf8_lossy: the error names what was asked.
        host = fg.text(request, lossy=True)
        upstream = self.routes.get(host)
        if upstream is None:
            raise LookupError(f"unknown host: {host}")
        # json.dumps with ensure_ascii=False escapes exactly as serde_json does (\" \\ \b \f \n \r
        # \t, \u00xx in lower case for the other controls, nothing else).
        return fg.json_bytes({"upstream": upstream})


Folder = fg.export(Router)

# ---- serde_json's reading of a route value ------------------------------------------------------


class _NotARoute(Exception):
    pass


_WS = b" \n\t\r"
_ESCAPES = {ord('"'): '"', ord("\\"): "\\", ord("/"): "/", ord("b"): "\b", ord("f"): "\f",
            ord("n"): "\n", ord("r"): "\r", ord("t"): "\t"}
_HEX = {c: int(chr(c), 16) for c in b"0123456789abcdefABCDEF"}


class _Reader:
    """A read position in the value's bytes; past the end, peek() is -1."""

    __slots__ = ("b", "i")

    def __init__(self, data: bytes):
        self.b = data
        self.i = 0

    def peek(self) -> int:
        return self.b[self.i] if self.i < len(self.b) else -1

    def eat(self, c: int) -> bool:
        if self.peek() != c:
            return False
        self.i += 1
        return True

    def expect(self, c: int) -> None:
        if not self.eat(c):
            raise _NotARoute

    def ws(self) -> None:
        while self.i < len(self.b) and self.b[self.i] in _WS:
            self.i += 1

    def hex4(self) -> int:
        v = 0
        for _ in range(4):
            d = _HEX.get(self.peek())
            if d is None:
                raise _NotARoute
            self.i += 1
            v = v * 16 + d
        return v


def _read_escape(r: _Reader, strict: bool) -> str:
    """One escape, after its backslash. Strict: decoded (surrogates must pair); else only checked."""
    c = r.peek()
    r.i += 1
    if c in _ESCAPES:
        return _ESCAPES[c]
    if c != ord("u"):
        raise _NotARoute  # not one of JSON's escapes (or the end)
    u = r.hex4()
    if not strict:
        return ""  # serde_json's ignore_str takes any four hex digits
    if 0xDC00 <= u <= 0xDFFF:
        raise _NotARoute  # a low surrogate first
    if not 0xD800 <= u <= 0xDBFF:
        return chr(u)
    r.expect(ord("\\"))
    r.expect(ord("u"))
    low = r.hex4()
    if not 0xDC00 <= low <= 0xDFFF:
        raise _NotARoute
    return chr(0x10000 + ((u - 0xD800) << 10) + (low - 0xDC00))


def _read_string(r: _Reader, strict: bool) -> str:
    """A string's body, the reader just past its opening quote, through the closing quote. Strict
    (as serde_json's parse_str, for what it decodes): raw bytes must be well-formed UTF-8, and the
    text is returned. Not strict (its ignore_str, for skipped values): any raw bytes but controls.
    Controls U+0000..U+001F are refused raw in both."""
    out = []
    run = r.i  # the start of the current run of raw bytes
    while True:
        c = r.peek()
        if c < 0x20:
            raise _NotARoute  # a control, or the end inside the string
        if c != 0x22 and c != 0x5C:
            r.i += 1
            continue
        # An escape decodes to whole characters, so each raw run is checked on its own.
        if strict:
            try:
                out.append(r.b[run:r.i].decode("utf-8"))
            except UnicodeDecodeError:
                raise _NotARoute from None
        r.i += 1
        if c == 0x22:
            return "".join(out)
        out.append(_read_escape(r, strict))
        run = r.i


def _digits(r: _Reader) -> bool:
    start = r.i
    while 0x30 <= r.peek() <= 0x39:
        r.i += 1
    return r.i > start


def _skip_number(r: _Reader) -> None:
    """A number without its '-': no leading zeros; a fraction and an exponent need a digit each."""
    if r.eat(0x30):
        if 0x30 <= r.peek() <= 0x39:
            raise _NotARoute
    elif not _digits(r):
        raise _NotARoute
    if r.eat(ord(".")) and not _digits(r):
        raise _NotARoute
    if r.eat(ord("e")) or r.eat(ord("E")):
        if not r.eat(ord("+")):
            r.eat(ord("-"))
        if not _digits(r):
            raise _NotARoute


_WORDS = {ord("n"): b"ull", ord("t"): b"rue", ord("f"): b"alse"}
_CLOSER = {0x5B: 0x5D, 0x7B: 0x7D}  # [ -> ], { -> }


def _skip_value(r: _Reader) -> None:
    """Skips one value the router ignores, as serde_json's ignore_value: iteratively (it has no
    nesting limit, so neither has this), strings checked leniently."""
    open_ = []  # the enclosing brackets, innermost last
    while True:
        r.ws()
        c = r.peek()
        opened = False
        if 0x30 <= c <= 0x39:
            _skip_number(r)
        else:
            r.i += 1
            if c in _WORDS:
                for w in _WORDS[c]:
                    r.expect(w)
            elif c == 0x22:
                _read_string(r, False)
            elif c == ord("-"):
                _skip_number(r)
            elif c in _CLOSER:
                open_.append(c)
                opened = True
            else:
                raise _NotARoute  # not the start of a value
        if not open_:
            return  # a scalar
        # After a value: a comma, or closers. Right after an opener: a closer, or a first member.
        want_comma = not opened
        while True:
            r.ws()
            nxt = r.peek()
            if nxt == ord(",") and want_comma:
                r.i += 1
                break
            if nxt == _CLOSER[open_[-1]]:
                r.i += 1
                open_.pop()
                if not open_:
                    return
                want_comma = True
                continue
            if nxt < 0 or want_comma:
                raise _NotARoute
            break
        if open_[-1] == 0x7B:
            r.ws()
            r.expect(0x22)
            _read_string(r, False)
            r.ws()
            r.expect(ord(":"))


def _string_value(r: _Reader) -> str:
    """A strict string value where the reader is (after whitespace)."""
    r.ws()
    r.expect(0x22)
    return _read_string(r, True)


# The common case, decided exactly without the reader above: one object holding only the key
# "upstream" with a string that has no escape and no control character, nothing but JSON's
# whitespace around. serde_json reads such a value as exactly the characters between the quotes
# (once they decode as UTF-8). Everything else takes the full reader, which runs byte by byte in
# the interpreter; the pattern runs in the engine.
_SIMPLE_ROUTE = re.compile(
    rb'[ \t\n\r]*\{[ \t\n\r]*"upstream"[ \t\n\r]*:[ \t\n\r]*"([^"\\\x00-\x1f]*)"[ \t\n\r]*\}[ \t\n\r]*'
)


def _simple_route(data: bytes) -> Optional[str]:
    m = _SIMPLE_ROUTE.fullmatch(data)
    if m is None:
        return None
    try:
        return m.group(1).decode("utf-8")
    except UnicodeDecodeError:
        return None


def decode_route(data: bytes) -> Optional[str]:
    """The upstream of a route value, or None when serde_json would not decode it into the Rust
    router's ``Route`` or the upstream is empty."""
    simple = _simple_route(data)
    if simple is not None:
        return simple or None
    return decode_route_fully(data)


def decode_route_fully(data: bytes) -> Optional[str]:
    """decode_route without the fast path: the reader alone (the tests hold the two to
    agreement)."""
    r = _Reader(data)
    try:
        upstream = None
        r.ws()
        if r.eat(0x5B):
            # serde's derived visit_seq: exactly one element, the upstream string.
            upstream = _string_value(r)
            r.ws()
            r.expect(0x5D)
        elif r.eat(0x7B):
            first = True
            while True:
                r.ws()
                if r.eat(0x7D):
                    break
                if not first:
                    r.expect(ord(","))
                    r.ws()
                first = False
                r.expect(0x22)
                key = _read_string(r, True)  # keys are decoded (escapes too) before the comparison
                r.ws()
                r.expect(ord(":"))
                if key != "upstream":
                    _skip_value(r)
                elif upstream is not None:
                    raise _NotARoute  # serde: duplicate field
                else:
                    upstream = _string_value(r)
            if upstream is None:
                raise _NotARoute  # serde: missing field
        else:
            raise _NotARoute
        r.ws()
        if r.i != len(data):
            raise _NotARoute  # serde_json: trailing characters
        return upstream or None
    except _NotARoute:
        return None
