"""Runs the Python SDK and Python guests natively, outside any component, for their unit tests
(``guests/router-py/build.sh test``).

Importing it generates the WIT bindings with ``componentize-py bindings`` into a temporary
directory (the same ``wit_world`` package a build generates; never checked in), puts that on
``sys.path``, and replaces the host imports — stubs there that raise — with fakes over ``FAKE``:
``FAKE.entries`` is the committed fold (key -> (value, revision)), ``FAKE.logs`` collects
``(level, message)``, ``FAKE.page_cap`` caps a scan's page as the host does.
"""

import atexit
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

WIT = Path(__file__).resolve().parents[2] / "wit"


class Fake:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.entries: dict[str, tuple[bytes, int]] = {}
        self.logs: list[tuple[str, str]] = []
        self.page_cap = 10_000


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


_install()
