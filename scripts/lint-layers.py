#!/usr/bin/env python3
"""The layers the compiler keeps, checked: the crates' dependency direction, what the lowest
crate pulls in, and the length of every source file.

- Each workspace crate has a layer (LAYERS below); a crate may depend only on crates of a lower
  layer, so no crate imports upward and no two crates form a circle.
- `foldhost-core` with its default features builds without wasmtime, RocksDB, async-nats or
  object_store.
- No source file holds more than MAX_LINES lines before its `#[cfg(test)]` unit tests (tests
  directories, `tests.rs` files and test-only modules are not counted).
- No function on the fold's path (the crates in FOLD_PATH: the fold's own and the artifact crate
  it exports to and bootstraps from) is longer than MAX_FN_LINES lines.

Run by `make lint`; exits non-zero with one line per finding.
"""
import json
import re
import pathlib
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
FOLD_PATH = ("foldhost-core", "foldhost-artifact", "foldhost-nats", "foldhost-fold", "foldhost-guest")
FN = re.compile(r"^(\s*)(pub(\([a-z]+\))? )?(async )?fn (\w+)")


def test_only_modules(root: pathlib.Path) -> set:
    """Files (`NAME.rs`) and directories (`NAME/`) of modules declared `#[cfg(test)] mod NAME;`."""
    out = set()
    for path in root.glob("**/src/**/*.rs"):
        if "target" in path.parts:
            continue
        lines = path.read_text().splitlines()
        base = path.parent if path.name in ("mod.rs", "lib.rs", "main.rs") else path.with_suffix("")
        for i, line in enumerate(lines[:-1]):
            m = re.match(r"^\s*mod (\w+);", lines[i + 1])
            if line.strip() == "#[cfg(test)]" and m:
                out.add(base / f"{m.group(1)}.rs")
                out.add(base / m.group(1))
    return out


def long_functions(lines: list, end: int):
    """(name, line, length) of every function longer than MAX_FN_LINES in `lines[:end]`."""
    for i in range(end):
        m = FN.match(lines[i])
        if not m or lines[i].rstrip().endswith((";", "{}")):
            continue
        closing = m.group(1) + "}"
        for j in range(i + 1, end):
            if lines[j] == closing:
                if j - i + 1 > MAX_FN_LINES:
                    yield m.group(5), i + 1, j - i + 1
                break


def main() -> int:
    root = pathlib.Path(__file__).resolve().parent.parent
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
    test_only = test_only_modules(root)
    for path in sorted(root.glob("crates/*/src/**/*.rs")) + sorted(root.glob("host/src/**/*.rs")):
        rel = path.relative_to(root)
        if (
            path.name == "tests.rs"
            or "tests" in rel.parts
            or path in test_only
            or any(parent in test_only for parent in path.parents)
        ):
            continue
        lines = path.read_text().splitlines()
        n = len(lines)
        for i, line in enumerate(lines):
            if line.strip() == "#[cfg(test)]" and i + 1 < n and lines[i + 1].startswith("mod tests"):
                n = i
                break
        if n > MAX_LINES:
            findings.append(f"{rel}: {n} lines before its tests (the limit is {MAX_LINES})")
        if len(rel.parts) > 1 and rel.parts[0] == "crates" and rel.parts[1] in FOLD_PATH:
            for name, at, length in long_functions(lines, n):
                findings.append(
                    f"{rel}:{at}: fn {name} is {length} lines (the limit on the fold's path is {MAX_FN_LINES})"
                )
    for f in findings:
        print(f"lint-layers: {f}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
