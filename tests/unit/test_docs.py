"""The commands of README.md and docs/*.md exist as written.

Every shell block (```bash) is split into commands (continuation lines joined, ``$(...)`` read as a command of its
own, ``;``, ``&&``, ``|`` and ``&`` between them). For each command, what it names must exist here: a make target
and the make variables it sets (the Makefile); a file or directory of the repository; a module (``python -m X``);
a flag of our own CLIs (their ``--help``, run in this process; the trainer's keys from ``python -m trainer
--help-config``, and a trainer command's whole configuration through the trainer's own parsing and validation); a
flag of one of our scripts (its source); an environment variable it sets (the project's code reads it, or the same
page uses it; ``TRAINER_*``, ``FT_*`` and ``PET_*`` knobs must be read by the trainer's image or a benchmark script).
Commands with ``--help`` or ``--help-config`` are run; the rest (they train, build images, call a cluster) are
checked by name. The prose is checked too: every relative link, every path in backticks that names a file of the
repository, every ``make`` target, trainer key (``section.key``) and knob in backticks.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import io
import logging
import re
import runpy
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from testlib import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SECTIONS = ("model", "data", "optim", "train", "checkpoint", "resiliency")
OUR_PACKAGES = ("pipelines", "components", "trainer")
TRAINER_OWN_FLAGS = {"--config", "--help-config", "--print-config"}
KNOB = re.compile(r"^(TRAINER|FT|PET)_[A-Z0-9_]+$")
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
IGNORED_DIRS = ("runs", ".venv", ".benchdata", ".bench-ckpt", ".whl", ".whl07")
OPERATORS = set(";&|()<>")
CODE_SUFFIXES = (".py", ".sh", ".toml", ".yaml", ".yml", ".ipynb")


@dataclass
class Command:
    page: str
    line: str
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.page}: {self.line.strip()[:110]}"


def shell_blocks(markdown: str) -> list[str]:
    return re.findall(r"```(?:bash|sh|shell)\n(.*?)```", markdown, flags=re.S)


def split_commands(page: str, line: str) -> list[Command]:
    """The simple commands of one shell line; each ``$(...)`` is one more, and stands for a word in its own."""
    commands = []
    while (inner := re.search(r"\$\(([^()]*)\)", line)) is not None:
        commands += split_commands(page, inner[1])
        line = line[:inner.start()] + "SUBST" + line[inner.end():]
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split, lexer.commenters = True, "#"
    current = Command(page, line)
    words = list(lexer)
    i = 0
    while i < len(words):
        word = words[i]
        if set(word) <= OPERATORS:
            if word in ("<", ">", ">>", "2>", "&>"):
                i += 2  # a redirection and its target
                continue
            commands.append(current)
            current = Command(page, line)
        elif not current.argv and word == "export":
            pass
        elif not current.argv and (match := ASSIGNMENT.match(word)):
            current.env[match[1]] = match[2]
        else:
            current.argv.append(word)
        i += 1
    commands.append(current)
    return [c for c in commands if c.argv or c.env]


def page_commands() -> list[Command]:
    found = []
    for page in PAGES:
        for block in shell_blocks(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                found += split_commands(str(page.relative_to(REPO)), line)
    return found


COMMANDS = page_commands()


@functools.cache
def top_level() -> set[str]:
    return {p.name for p in REPO.iterdir()} - set(IGNORED_DIRS) - {".git"}


def repo_path(word: str) -> Path | None:
    """The repository path a word names (``trainer/x.py`` is under ``trainer_image/``), or None when it names none:
    an absolute path, a URI, a placeholder, a file the command makes (``runs/...``, ``pipeline.yaml``)."""
    word = word.removeprefix("./").rstrip(",;:.")
    if not word or "$" in word or "<" in word or "://" in word or " " in word or word.startswith(("/", "-", "~")):
        return None
    first = word.split("/", 1)[0]
    if first == "trainer" and "/" in word:
        return REPO / "trainer_image" / word
    if first in top_level() and ("/" in word or (REPO / word).is_file()):
        return REPO / word
    return None


def exists(path: Path) -> bool:
    return bool(glob.glob(str(path))) if "*" in str(path) else path.exists()


@functools.cache
def make_targets() -> tuple[set[str], str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, flags=re.M)), text


@functools.cache
def project_words() -> set[str]:
    """Every identifier the project's code, scripts and Makefile hold (environment variables it reads among them)."""
    words: set[str] = set()
    for path in [REPO / "Makefile", REPO / ".ci" / "run", REPO / "trainer_image" / "Dockerfile",
                 *[p for d in ("bench", "components", "pipelines", "trainer_image", "tests")
                   for p in (REPO / d).rglob("*") if p.suffix in CODE_SUFFIXES]]:
        words |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", path.read_text(errors="replace")))
    return words


@functools.cache
def knob_readers() -> str:
    """What reads a ``TRAINER_*``, ``FT_*`` or ``PET_*`` knob: the image (entrypoint.sh, the trainer) and the
    benchmark scripts (``TRAINER_OVERRIDES``)."""
    return "\n".join(p.read_text() for p in [REPO / "trainer_image" / "entrypoint.sh",
                                               *(REPO / "trainer_image" / "trainer").rglob("*.py"),
                                               *(REPO / "bench").glob("*.sh")])


def run_module(module: str, *args: str) -> tuple[int, str]:
    """``python -m module args`` in this process: (exit code, what it printed)."""
    out = io.StringIO()
    saved, root = sys.argv, logging.getLogger()
    handlers, level = root.handlers[:], root.level  # a CLI may configure logging: this process's stays as it was
    sys.argv = [module, *args]
    code: object = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv = saved
        root.handlers[:] = handlers
        root.setLevel(level)
    return (0 if code is None else code if isinstance(code, int) else 1), out.getvalue()


@functools.cache
def help_text(module: str, subcommand: str = "") -> str:
    code, text = run_module(module, *([subcommand] if subcommand else []), "--help")
    assert code == 0 and text.strip(), f"python -m {module} {subcommand} --help: exit {code}\n{text}"
    return text


@functools.cache
def trainer_keys() -> frozenset[str]:
    code, text = run_module("trainer", "--help-config")
    assert code == 0, text
    keys, section = set(), ""
    for line in text.splitlines():
        if match := re.match(r"^\[(\w+)\]$", line):
            section = match[1]
        elif match := re.match(r"^  (\w+) = ", line):
            keys.add(f"{section}.{match[1]}")
    assert len(keys) > 50, text[:500]
    return frozenset(keys)


def flags(args: list[str]) -> list[str]:
    """The ``--flags`` among ``args``, and a trainer override given as another flag's value
    (``--trainer-override=--train.steps=5``)."""
    found = []
    for arg in args:
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            found.append(name)
            if value.startswith("--"):
                found.append(value.partition("=")[0])
    return found


def trainer_flag_problems(args: list[str]) -> list[str]:
    problems = []
    for flag in flags(args):
        if "." in flag and flag[2:].split(".", 1)[0] in SECTIONS:
            if flag[2:] not in trainer_keys():
                problems.append(f"{flag}: no such trainer key (python -m trainer --help-config)")
        elif flag not in TRAINER_OWN_FLAGS:
            problems.append(f"{flag}: not a flag of python -m trainer")
    if "--config" in args and (i := args.index("--config") + 1) < len(args) and "/" not in args[i]:
        if not (REPO / "trainer_image" / "trainer" / "configs" / f"{args[i]}.toml").is_file():
            problems.append(f"--config {args[i]}: no such flavour")
    return problems


def trainer_config_problems(args: list[str]) -> list[str]:
    """A trainer command's flags and values, as its own parsing and validation take them (nothing runs)."""
    problems = trainer_flag_problems(args)
    if problems or any("$" in arg for arg in args):
        return problems
    from trainer.config import ConfigError, parse_args

    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            parse_args(args)
    except ConfigError as exc:
        return [f"the trainer refuses it: {exc}"]
    except SystemExit:
        return [f"the trainer refuses it: {err.getvalue().strip()}"]
    return []


def module_problems(module: str, args: list[str]) -> list[str]:
    sys.path[:0] = [p for p in (str(REPO), str(REPO / "trainer_image")) if p not in sys.path]
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        return [f"python -m {module}: no such module"]
    if module.split(".", 1)[0] not in OUR_PACKAGES:
        return []
    if module == "trainer":
        return trainer_config_problems(args)
    subcommand = args[0] if module == "pipelines.cli" and args and not args[0].startswith("-") else ""
    if subcommand == "plan":  # pipelines.cli plan passes its arguments to the planner
        module, subcommand, args = "trainer.plan", "", args[1:]
    text = help_text(module, subcommand)
    problems = []
    for flag in flags(args):
        if "." in flag and flag[2:].split(".", 1)[0] in SECTIONS:
            problems += trainer_flag_problems([flag])
        elif not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
            problems.append(f"{flag}: not in python -m {module} {subcommand} --help")
    return problems


def script_problems(script: Path, args: list[str]) -> list[str]:
    """A script of ours: its flags are in its source (a trainer key: in the trainer's config); a shell script's bare
    words (gpu_suite.sh's parts) are in its source too."""
    if not script.is_file():
        return [f"{script.relative_to(REPO)}: no such file"]
    source = script.read_text()
    if script.name == "entrypoint.sh":
        return trainer_config_problems(args)
    problems = []
    for flag in flags(args):
        if "." in flag and flag[2:].split(".", 1)[0] in SECTIONS:
            problems += trainer_flag_problems([flag])
        elif flag not in source:
            problems.append(f"{flag}: not in {script.relative_to(REPO)}")
    if script.suffix == ".sh":
        for word in args:
            if re.fullmatch(r"[a-z]+", word) and word not in source:
                problems.append(f"{word}: not in {script.relative_to(REPO)}")
    return problems


def python_problems(args: list[str]) -> list[str]:
    """After ``python``: ``-m MODULE ARGS``, ``-c CODE`` or ``SCRIPT ARGS`` (interpreter options skipped)."""
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-m", "-c"):
        i += 1
    if i >= len(args):
        return []
    if args[i] == "-m":
        return module_problems(args[i + 1], args[i + 2:])
    if args[i] == "-c":
        try:
            compile(args[i + 1], "<docs>", "exec")
        except SyntaxError as exc:
            return [f"python -c: {exc}"]
        return []
    path = repo_path(args[i])
    return script_problems(path, args[i + 1:]) if path else []


def command_problems(command: Command, page_text: str) -> list[str]:
    problems = []
    for name, value in command.env.items():
        if KNOB.match(name) and not re.search(rf"\b{name}\b", knob_readers()):
            problems.append(f"{name}: no knob of trainer_image/ (entrypoint.sh, the trainer) nor of bench/ reads it")
        elif not KNOB.match(name) and name not in project_words() and f"${name}" not in page_text \
                and f"${{{name}}}" not in page_text:
            problems.append(f"{name}: neither the project's code nor this page reads it")
        for part in value.split(":") if name.endswith("PATH") else [value]:
            if (path := repo_path(part)) and not exists(path):
                problems.append(f"{name}={part}: no such path")
    argv = command.argv
    if not argv:
        return problems
    for word in argv:
        for part in (word, word.partition("=")[2]):
            if (path := repo_path(part)) and not exists(path):
                problems.append(f"{part}: no such file or directory")
    program = argv[0].rsplit("/", 1)[-1]
    if program == "make":
        targets, makefile = make_targets()
        for word in argv[1:]:
            if match := ASSIGNMENT.match(word):
                if match[1] not in makefile:
                    problems.append(f"make {match[1]}=: the Makefile has no such variable")
            elif not word.startswith("-") and word not in targets:
                problems.append(f"make {word}: no such target")
    elif re.fullmatch(r"python3?(\.\d+)?", program):
        problems += python_problems(argv[1:])
    elif program == "torchrun":
        rest = argv[1:]
        if "-m" in rest:
            problems += module_problems(rest[rest.index("-m") + 1], rest[rest.index("-m") + 2:])
        elif scripts := [i for i, w in enumerate(rest) if w.endswith(".py")]:
            problems += python_problems(rest[scripts[0]:])
    elif program in ("bash", "source", "."):
        if len(argv) > 1 and (path := repo_path(argv[1])):
            problems += script_problems(path, argv[2:])
    elif "/" in argv[0] and (path := repo_path(argv[0])):
        problems += script_problems(path, argv[1:])
    return problems


def test_the_pages_have_shell_blocks_and_every_command_is_read():
    assert len(COMMANDS) > 40, [str(c) for c in COMMANDS]
    assert {p.name for p in PAGES} >= {"README.md", "cluster.md", "data-and-model.md", "recovery.md", "nodes.md",
                                       "checkpoints.md", "planning.md", "benchmarks.md", "demo.md"}
    for page in PAGES:  # a command block tagged otherwise would escape these checks
        untagged = re.findall(r"^```\n(?:\.venv/bin/|python |make |kubectl |docker )", page.read_text(), flags=re.M)
        assert not untagged, f"{page.name}: a block of commands without ```bash"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.page}:{' '.join(c.argv[:4])[:60]}")
def test_what_each_command_names_exists(command):
    problems = list(dict.fromkeys(command_problems(command, (REPO / command.page).read_text())))
    assert not problems, f"{command}\n" + "\n".join(problems)


@pytest.mark.parametrize("command", [c for c in COMMANDS if {"--help", "--help-config"} & set(c.argv)],
                         ids=lambda c: " ".join(c.argv[-3:]))
def test_the_cheap_commands_run(command):
    """``--help`` and ``--help-config``: run here, as written, and say something."""
    argv = command.argv
    module = argv[argv.index("-m") + 1]
    code, text = run_module(module, *argv[argv.index("-m") + 2:])
    assert code == 0 and text.strip(), f"{command}: exit {code}\n{text[-2000:]}"


def prose(markdown: str) -> str:
    return re.sub(r"```.*?```", "", markdown, flags=re.S)


@pytest.mark.parametrize("page", [*PAGES, REPO / "BENCHMARKS.md"], ids=lambda p: p.name)
def test_links_and_named_paths_exist(page):
    text = page.read_text()
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        if not (page.parent / target.split("#", 1)[0]).exists():
            problems.append(f"link {target}: no such file")
    for span in re.findall(r"`([^`\n]+)`", prose(text)):
        for word in span.split():
            if (path := repo_path(word)) and not exists(path):
                problems.append(f"`{span}`: {word} does not exist")
    assert not problems, f"{page.name}:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_named_make_targets_trainer_keys_and_knobs_exist(page):
    text = prose(page.read_text())
    targets, _ = make_targets()
    problems = [f"make {t}: no such target" for t in re.findall(r"`make ([\w-]+)", text) if t not in targets]
    for span in re.findall(r"`([^`\n]+)`", text):
        for section, key in re.findall(r"(?<![\w/.-])(" + "|".join(SECTIONS) + r")\.([a-z_]+)(?![\w/.(-])", span):
            if f"{section}.{key}" not in trainer_keys():
                problems.append(f"`{span}`: {section}.{key} is no trainer key")
        for knob in re.findall(r"\b(?:TRAINER|FT|PET)_[A-Z0-9_]+\b", span):
            if not re.search(rf"\b{knob}\b", knob_readers()):
                problems.append(f"`{span}`: {knob} is no knob of trainer_image/ nor of bench/")
    assert not problems, f"{page.name}:\n" + "\n".join(problems)
