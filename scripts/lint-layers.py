#!/usr/bin/env python3
"""The layers the compiler keeps, and the house's limits, checked.

- Each workspace crate has a layer (LAYERS below); a crate may depend only on crates of a lower
  layer, so no crate imports upward and no two crates form a circle.
- `foldhost-core` with its default features builds without wasmtime, RocksDB, async-nats or
  object_store.
- A path names its crate: no crate re-exports another workspace crate's items (`pub use
  foldhost_core::kv;`, `pub(crate) use foldhost_fold::applied;`, a glob, a group) and none renames
  one (`use foldhost_nats as nats;`), so `crate::kv` is always this crate's own `kv`.
- No source file holds more than MAX_LINES lines before its inline `#[cfg(test)] mod … { … }`
  unit tests, and no function is longer than MAX_FN_LINES lines — in every crate, tests, test
  helpers and harnesses included.
- No dependency is declared that nothing uses (`cargo machete`).

Findings that predate a limit are listed in ALLOW_FILE with their size. The list only shrinks:
a finding not listed, or larger than listed, fails; so does a listed one that is gone (remove its
line). Run by `make lint-sources`; exits non-zero with one line per finding. Its own tests:
scripts/test_lint_layers.py.
"""
import json
import pathlib
import re
import subprocess
import sys

LAYERS = {
    "foldhost-core": 0,
    "foldhost-localnats": 0,
    "foldhost-artifact": 1,
    "foldhost-nats": 1,
    "foldhost-fold": 2,
    "foldhost-guest": 3,
    "foldhost": 4,
    "foldhost-tests": 5,
}
CORE_FORBIDDEN = {"wasmtime", "rocksdb", "librocksdb-sys", "async-nats", "object_store"}
MAX_LINES = 800
MAX_FN_LINES = 80
ALLOW_FILE = "scripts/lint-layers.allow"
# Every Rust source of the workspace's crates: libraries, binaries, unit and integration tests.
SOURCES = ("crates/*/src/**/*.rs", "crates/*/tests/**/*.rs", "host/src/**/*.rs", "tests/**/*.rs")
FN = re.compile(
    r"^(\s*)(pub(\([^)]*\))? )?(default )?(const )?(async )?(unsafe )?(extern \"[^\"]*\" )?fn (\w+)"
)
USE = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?use\s+([^;]*);", re.M | re.S)
EXTERN_AS = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?extern\s+crate\s+(foldhost\w*)\s+as\s", re.M)
INLINE_TESTS = re.compile(r"^\s*(pub(\([^)]*\))? )?mod \w+\s*\{")


def strip_comments(text: str) -> str:
    """The text without `//` line comments (doc comments included), lines kept in place."""
    return "\n".join(re.sub(r"//.*$", "", line) for line in text.split("\n"))


def alias_findings(rel: str, text: str):
    """Re-exports and renames of another workspace crate's items in one source file."""
    code = strip_comments(text)
    for m in USE.finditer(code):
        tree = re.sub(r"\s+", " ", m.group(3)).strip().lstrip(":")
        line = code.count("\n", 0, m.start(3)) + 1
        first = re.split(r"[:\s{]", tree, maxsplit=1)[0]
        # `foldhost` is a crate only where the host is a dependency (the tests crate); elsewhere
        # it is a local module (the guest crate's WIT bindings, package `foldhost:guest`).
        if not (first.startswith("foldhost_") or (first == "foldhost" and rel.startswith("tests/"))):
            continue
        if m.group(1):
            yield f"{rel}:{line}: `{m.group(1).strip()} use {tree}` re-exports another crate's items: name them by their crate's path where they are used"
        elif re.search(r"\bas\s+\w+\s*$", tree) and "::" not in tree.split(" as ")[0]:
            yield f"{rel}:{line}: `use {tree}` renames a crate: name it by its own name"
    for m in EXTERN_AS.finditer(code):
        line = code.count("\n", 0, m.start()) + 1
        yield f"{rel}:{line}: `extern crate {m.group(3)} as …` renames a crate: name it by its own name"


def code_lines(lines: list) -> int:
    """Lines before the file's inline `#[cfg(test)] mod NAME {` (a `mod tests;` declaration does
    not end the count: the module's own file is counted on its own)."""
    for i, line in enumerate(lines[:-1]):
        if line.strip() == "#[cfg(test)]" and INLINE_TESTS.match(lines[i + 1]):
            return i
    return len(lines)


def long_functions(lines: list):
    """(name, line, length) of every function longer than MAX_FN_LINES: from its `fn` line to the
    first line that is its indentation and `}`."""
    for i, line in enumerate(lines):
        m = FN.match(line)
        if not m or line.rstrip().endswith((";", "{}")):
            continue
        closing = m.group(1) + "}"
        for j in range(i + 1, len(lines)):
            if lines[j] == closing:
                if j - i + 1 > MAX_FN_LINES:
                    yield m.group(9), i + 1, j - i + 1
                break


def size_findings(rel: str, text: str) -> dict:
    """{key: (size, message)} of the file's limits broken; keys stay put when lines move."""
    lines = text.splitlines()
    out = {}
    n = code_lines(lines)
    if n > MAX_LINES:
        out[f"file {rel}"] = (n, f"{rel}: {n} lines before its inline tests (the limit is {MAX_LINES})")
    seen = {}
    for name, at, length in long_functions(lines):
        seen[name] = seen.get(name, 0) + 1
        key = f"fn {rel}::{name}" + (f"#{seen[name]}" if seen[name] > 1 else "")
        out[key] = (length, f"{rel}:{at}: fn {name} is {length} lines (the limit is {MAX_FN_LINES})")
    return out


def parse_allow(text: str) -> dict:
    """ALLOW_FILE's `KIND PATH SIZE` lines ({`KIND PATH`: SIZE}); `#` starts a comment."""
    allow = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, _, size = line.rpartition(" ")
        allow[key] = int(size)
    return allow


def ratchet(found: dict, allow: dict) -> list:
    """The findings the allowance does not cover, and the allowances no longer needed."""
    out = []
    for key, (size, message) in sorted(found.items()):
        if key not in allow:
            out.append(message)
        elif size > allow[key]:
            out.append(f"{message}: grown past the {allow[key]} {ALLOW_FILE} allows")
    for key in sorted(set(allow) - set(found)):
        out.append(f"{ALLOW_FILE}: `{key}` is within the limits now: remove its line")
    for key in sorted(k for k in allow if k in found and found[k][0] < allow[k]):
        out.append(f"{ALLOW_FILE}: `{key}` shrank to {found[key][0]}: lower its line to that")
    return out


def machete_findings(root: pathlib.Path) -> list:
    """Dependencies `cargo machete` finds nothing using, one line each."""
    try:
        run = subprocess.run(
            ["cargo", "machete", str(root)], cwd=root, capture_output=True, text=True
        )
    except FileNotFoundError:
        return ["cargo not found"]
    if "no such command" in run.stderr:
        return ["cargo-machete is not installed (scripts/setup.sh --test installs it)"]
    if run.returncode == 0:
        return []
    out, crate = [], None
    for line in run.stdout.splitlines():
        m = re.match(r"^(\S+) -- (\S+):$", line)
        if m:
            crate = f"{m.group(1)} ({m.group(2)})"
        elif line.startswith("\t") and crate:
            out.append(f"{crate}: dependency {line.strip()} is unused")
    return out or [f"cargo machete failed: {run.stderr.strip() or run.stdout.strip()}"]


def layer_findings(root: pathlib.Path) -> list:
    findings = []
    meta = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--format-version", "1", "--no-deps"],
            cwd=root, check=True, capture_output=True, text=True,
        ).stdout
    )
    for pkg in meta["packages"]:
        name = pkg["name"]
        if name not in LAYERS:
            findings.append(f"{name}: a workspace crate without a layer in scripts/lint-layers.py")
            continue
        for dep in pkg["dependencies"]:
            d = dep["name"]
            if d in LAYERS and dep["kind"] != "dev" and LAYERS[d] >= LAYERS[name]:
                findings.append(
                    f"{name} (layer {LAYERS[name]}) depends on {d} (layer {LAYERS[d]}): upward or sideways"
                )
    tree = subprocess.run(
        ["cargo", "tree", "-p", "foldhost-core", "-e", "normal", "--prefix", "none"],
        cwd=root, check=True, capture_output=True, text=True,
    ).stdout
    pulled = {line.split(" ")[0] for line in tree.splitlines() if line.strip()}
    for bad in sorted(CORE_FORBIDDEN & pulled):
        findings.append(f"foldhost-core pulls in {bad}")
    return findings


def sources(root: pathlib.Path) -> list:
    paths = set()
    for pattern in SOURCES:
        paths.update(p for p in root.glob(pattern) if "target" not in p.relative_to(root).parts)
    return sorted(paths)


def main() -> int:
    root = pathlib.Path(__file__).resolve().parent.parent
    findings = layer_findings(root)
    found = {}
    for path in sources(root):
        rel = str(path.relative_to(root))
        text = path.read_text()
        findings.extend(alias_findings(rel, text))
        found.update(size_findings(rel, text))
    allow_path = root / ALLOW_FILE
    allow = parse_allow(allow_path.read_text()) if allow_path.exists() else {}
    findings.extend(ratchet(found, allow))
    findings.extend(machete_findings(root))
    for f in findings:
        print(f"lint-layers: {f}")
    if allow and not findings:
        print(f"lint-layers: ok; {len(allow)} findings older than the limits remain in {ALLOW_FILE}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
