"""The project's words: code, tests and docs in the present tense, and BENCHMARKS.md as today's figures.

- No file names a "session" (a diary's unit of time) except where the word means something else technically: a
  POSIX process session, a pytest session, an HTTP session cookie, an AWS session token (``ALLOWED``, exact phrases).
- Every table row of BENCHMARKS.md names its card, date, commit and command and links its raw lines, which exist;
  every directory of raw lines backs a row, and none of its files is left uncompressed over ``RAW_MAX_BYTES``.
- Every citation ``BENCHMARKS.md, "<table>"`` names a table that is there.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from testlib import REPO

BENCHMARKS = REPO / "BENCHMARKS.md"
RESULTS = "bench/results/"
VENDORED = ("deploy/crds/",)  # third-party schemas, kept as published
ALLOWED = (
    "start_new_session", "os.setsid", "run_session",  # a POSIX process session (setsid)
    "a session of its own", "its own session", "of any session", "whatever session it runs in", "process session",
    'scope="session"', "pytest session",  # pytest's session scope
    "session cookie", "browser session", "authservice_session",  # HTTP sessions (Kubeflow's gateway)
    "AWS_SESSION_TOKEN",  # temporary AWS credentials
)
CARD = re.compile(r"^(H100 80 GB|H200|CPU)\b")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
LINK = re.compile(r"\]\(([^)\s]+)\)")
REQUIRED = ("card", "date", "commit", "command", "raw")
RAW_MAX_BYTES = 200 * 1024


def tracked() -> list[str]:
    done = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [name for name in done.stdout.splitlines() if (REPO / name).is_file()]


def text_of(name: str) -> str | None:
    try:
        return (REPO / name).read_text()
    except (UnicodeDecodeError, OSError):
        return None  # a binary file (a chart, a gzip)


def test_no_file_or_path_names_a_session():
    """Raw lines under bench/results/ are what a program printed (pytest's "test session starts"): their paths are
    checked, not their text. This module names the word in its allow-list, so it is not read either."""
    found = []
    for name in tracked():
        if "session" in name.lower():
            found.append(f"{name}: the path")
        if name.startswith((RESULTS, *VENDORED)) or name == "tests/unit/test_wording.py":
            continue
        for number, line in enumerate((text_of(name) or "").splitlines(), 1):
            rest = line
            for phrase in ALLOWED:
                rest = rest.replace(phrase, "")
            if "session" in rest.lower():
                found.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not found, ("'session' where it is no process session, pytest session, cookie or token (cite a figure as "
                       "BENCHMARKS.md, \"<table>\", never by when it was measured):\n" + "\n".join(found))


def tables(markdown: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(heading, header cells, rows of cells) of every pipe table, under the ``##`` heading it sits in."""
    found, heading, block = [], "", []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("## "):
            heading = line[3:].strip()
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip().strip("|").split("|")])
            continue
        if len(block) >= 2:
            found.append((heading, block[0], block[2:]))
        block = []
    return found


def test_every_benchmarks_row_names_its_card_date_commit_command_and_raw_lines():
    found = tables(BENCHMARKS.read_text())
    assert found, "BENCHMARKS.md has no table"
    wrong = []
    for heading, header, rows in found:
        columns = [cell.lower() for cell in header]
        missing = [c for c in REQUIRED if c not in columns]
        if missing:
            wrong.append(f"{heading}: the table has no column {missing} (each row: card, date, commit, command, raw)")
            continue
        at = {c: columns.index(c) for c in REQUIRED}
        for row in rows:
            cell = {c: row[i] if i < len(row) else "" for c, i in at.items()}
            where = f"{heading}, row {row[0]!r}"
            if not CARD.match(cell["card"]):
                wrong.append(f"{where}: card {cell['card']!r} is none of H100 80 GB, H200, CPU")
            if not DATE.match(cell["date"]):
                wrong.append(f"{where}: date {cell['date']!r} is not YYYY-MM-DD")
            if not COMMIT.match(cell["commit"]):
                wrong.append(f"{where}: commit {cell['commit']!r} is not a commit's hash")
            if not re.search(r"`[^`]+`", cell["command"]):
                wrong.append(f"{where}: no command")
            links = LINK.findall(cell["raw"])
            if not links:
                wrong.append(f"{where}: no link to its raw lines")
            for target in links:
                if not target.startswith(RESULTS) or not (REPO / target).is_file():
                    wrong.append(f"{where}: raw lines {target!r} are not a file under {RESULTS}")
    assert not wrong, "\n".join(wrong)


def test_benchmarks_commits_exist():
    rows = [row for _, header, rows in tables(BENCHMARKS.read_text()) if "commit" in [c.lower() for c in header]
            for row in rows]
    commits = sorted({cell for row in rows for cell in row if COMMIT.match(cell)})
    shallow = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"], capture_output=True,
                             text=True, check=False)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("not a full git clone: old commits may be missing")
    done = subprocess.run(["git", "-C", str(REPO), "cat-file", "--batch-check"], input="".join(
        f"{c}^{{commit}}\n" for c in commits), capture_output=True, text=True, check=True)
    assert "missing" not in done.stdout, done.stdout


def test_raw_lines_back_a_row_and_large_ones_are_compressed():
    """bench/results/<table>/<card>-<date>-<commit>/: each such directory (a run's own files may lie deeper in it) is
    linked from BENCHMARKS.md (what no figure shows any more leaves; git keeps it), and every file over RAW_MAX_BYTES
    is gzipped."""
    text = BENCHMARKS.read_text()
    linked = {Path(*Path(target).parts[:4]) for target in LINK.findall(text) if target.startswith(RESULTS)}
    names = [n for n in tracked() if n.startswith(RESULTS)]
    runs = {Path(*Path(n).parts[:4]) for n in names}
    loose = sorted(n for n in names if len(Path(n).parts) < 5)
    assert not loose, f"raw lines outside a bench/results/<table>/<card>-<date>-<commit>/ directory: {loose}"
    named = re.compile(r"(h100|h200|cpu)-\d{4}-\d{2}-\d{2}-[0-9a-f]{7,40}")
    wrong = sorted(str(r) for r in runs if not named.fullmatch(r.name))
    assert not wrong, f"a run directory is named <card>-<date>-<commit> (h100, h200 or cpu): {wrong}"
    unbacked = sorted(runs - linked)
    assert not unbacked, f"raw lines no row of BENCHMARKS.md links (delete them, or link them): {unbacked}"
    large = [n for n in names if (REPO / n).stat().st_size > RAW_MAX_BYTES and not n.endswith(".gz")]
    assert not large, f"gzip these: {large}"


def test_citations_name_a_table_of_benchmarks():
    headings = set(re.findall(r"^## (.+?)\s*$", BENCHMARKS.read_text(), flags=re.M))
    wrong = []
    for name in tracked():
        if name.startswith((RESULTS, *VENDORED)) or name == "BENCHMARKS.md":
            continue
        text = text_of(name)
        if not text or "BENCHMARKS.md" not in text:
            continue
        flat = re.sub(r"[ \t]*\n[ \t]*(?:#+[ \t]*|//[ \t]*)?", " ", text)  # a citation may wrap, in a comment too
        for cited in re.findall(r'BENCHMARKS\.md, "([^"<]+)"', flat):  # "<table>": the pattern, not a citation
            if cited not in headings:
                wrong.append(f"{name}: BENCHMARKS.md, {cited!r}")
    assert not wrong, f"no such table in BENCHMARKS.md ({sorted(headings)}):\n" + "\n".join(wrong)
