#!/usr/bin/env python3
"""No citation of a seed, an issue or a stop by its number in the tracked sources and docs.

The repository stands on its own: a comment or a document cites the project's own docs (a file
and a section, e.g. docs/design.md, "Bucket identity"), never a seed document, an issue or a
work stop by number, and docs/ says what is true now with a date or a commit where a figure needs
provenance. This lint reports each `path:line: text` of a tracked file (`git ls-files`) that names
one — "seed", "issue" or "stop", singular or plural, any case, then a number of one to three
digits, with or without a space, a hyphen or a `#` between (`'s` after it changes nothing) — and
exits 1 when it finds any. A word at the end of a line followed by the number at the start of the
next counts too (prose wraps).

ALLOWED lists the legitimate uses, each by a precise pattern that must cover the whole hit: a
random seed passed to a simulation or a test, a duration after a process's stop, a value a test
writes to a bucket. Add one there, with its reason, rather than exempting a file.

Run by `make lint-sources` (and so by `make test` and CI).
"""
import re
import subprocess
import sys

# The kinds of tracked file checked: sources, scripts, manifests and docs.
SUFFIXES = (".rs", ".md", ".wit", ".py", ".toml", ".sh", ".c", ".h", ".js", ".mjs", ".wat", ".tmpl")
NAMES = ("Makefile",)

WORD = r"\b(?:seed|stop|issue)s?"
CITATION = re.compile(WORD + r"[ \t\-\u2013]?#?\d{1,3}(?![\d.,]\d)\b", re.IGNORECASE)
# A line ending in the word, the next line starting with the number.
TRAILING_WORD = re.compile(WORD + r"[ \t]*$", re.IGNORECASE)
LEADING_NUMBER = re.compile(r"^[ \t]*(?://[/!]?|#|\*|--)?[ \t]*#?\d{1,3}\b")

# (pattern, why it is not a citation). A hit is allowed when one match of a pattern covers it.
ALLOWED = [
    (
        re.compile(r"--seed[ =]\d+\b", re.IGNORECASE),
        "a simulation's random seed on a command line: `--seed N`",
    ),
    (
        re.compile(r"\bstops? \d+(?:\.\d+)?[ \u00a0]?(?:ns|µs|us|ms|s|min)\b", re.IGNORECASE),
        "a duration after a stop: `a clean stop 2.2 ms`, `stop 2 s`",
    ),
    (
        re.compile(r"\bclean[ -]stops? \d+(?:\.\d+)?\b", re.IGNORECASE),
        "a clean stop's duration in a list of milliseconds: `the clean stop 3; the exit 2`",
    ),
    (
        re.compile(r"\bseed\d+\"", re.IGNORECASE),
        "a value a test writes to a bucket and reads back: `\"ok: seedN\"`",
    ),
]


def tracked_files():
    out = subprocess.run(
        ["git", "ls-files", "-z"], check=True, capture_output=True
    ).stdout.decode("utf-8", "surrogateescape")
    for path in out.split("\0"):
        name = path.rsplit("/", 1)[-1]
        if path and (path.endswith(SUFFIXES) or name in NAMES):
            yield path


def allowed(line: str, start: int, end: int) -> bool:
    for pattern, _why in ALLOWED:
        for m in pattern.finditer(line):
            if m.start() <= start and m.end() >= end:
                return True
    return False


def findings(path: str):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except (FileNotFoundError, IsADirectoryError):
        return  # deleted in the work tree, or a submodule
    for i, line in enumerate(lines):
        hit = any(not allowed(line, m.start(), m.end()) for m in CITATION.finditer(line))
        if not hit and i + 1 < len(lines):
            tail = TRAILING_WORD.search(line)
            head = LEADING_NUMBER.match(lines[i + 1])
            if tail and head:
                joined = line[tail.start():].rstrip() + " " + lines[i + 1].lstrip()
                m = CITATION.match(joined)
                hit = m is not None and not allowed(joined, m.start(), m.end())
        if hit:
            yield i + 1, line.strip()


def main() -> int:
    found = 0
    for path in tracked_files():
        for number, text in findings(path):
            print(f"{path}:{number}: {text}")
            found += 1
    if found:
        print(
            f"lint-citations: {found} line(s) cite a seed, an issue or a stop by number; "
            "cite the project's own docs instead (or, for a legitimate use, extend ALLOWED "
            "in scripts/lint-citations.py)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
