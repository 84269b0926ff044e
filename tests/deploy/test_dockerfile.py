"""Static checks of trainer_image/Dockerfile and .dockerignore (no Docker engine needed)."""
from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import subprocess
from pathlib import PurePosixPath

import pytest
from deploy_checks import REPO

DOCKERFILE = REPO / "trainer_image" / "Dockerfile"
NGC_PYTORCH = re.compile(r"^nvcr\.io/nvidia/pytorch:(\d\d)\.(\d\d)-py3$")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and line continuations joined."""
    result, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, args = full.partition(" ")
        result.append((keyword.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a line continuation"
    return result


@pytest.fixture(scope="module")
def steps() -> list[tuple[str, str]]:
    assert DOCKERFILE.is_file(), f"missing {DOCKERFILE}"
    return instructions(DOCKERFILE.read_text())


def final_stage(steps):
    starts = [i for i, (k, _) in enumerate(steps) if k == "FROM"]
    assert starts, "no FROM"
    return steps[starts[-1]:]


def copies(stage) -> list[tuple[str, PurePosixPath]]:
    """(source in the repo, absolute path in the image) of each COPY; WORKDIR resolves relative paths.
    A file copied to a directory (dest ending in / or .) lands under its own name."""
    workdir, result = PurePosixPath("/"), []
    for keyword, args in stage:
        if keyword == "WORKDIR":
            workdir = workdir / args
        elif keyword == "COPY":
            *sources, dest = [w for w in shlex.split(args) if not w.startswith("--")]
            for source in sources:
                into_dir = dest.endswith(("/", ".")) and (REPO / source).is_file()
                target = workdir / dest / PurePosixPath(source).name if into_dir else workdir / dest
                result.append((source, target))
    return result


def pip_installs(stage) -> list[list[str]]:
    """Argument lists of every `pip install` in RUN instructions (shell operators split commands)."""
    found = []
    for keyword, args in stage:
        if keyword != "RUN":
            continue
        lexer = shlex.shlex(args, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token in ("&&", "||", ";", "|", ">", "<"):
                words, command = command, []
                for i in range(len(words) - 1):
                    if words[i].endswith("pip") and words[i + 1] == "install":
                        found.append(words[i + 2:])
                    elif words[i:i + 3] == ["-m", "pip", "install"]:
                        found.append(words[i + 3:])
            else:
                command.append(token)
    return found


def test_base_image_is_ngc_pytorch_with_python_312(steps):
    (image,) = [args.split()[0] for k, args in final_stage(steps) if k == "FROM"]
    match = NGC_PYTORCH.match(image)
    assert match, f"base must be an NGC PyTorch image nvcr.io/nvidia/pytorch:YY.MM-py3; got {image}"
    # 2025 and 2026 releases ship Python 3.12 (Ubuntu 24.04), which the wheels we install are built for.
    assert match.group(1) in ("25", "26"), f"use a 2025/2026 NGC release; got {image}"


def test_torch_comes_from_the_base_and_is_never_reinstalled(steps):
    stage = final_stage(steps)
    installs = pip_installs(stage)
    assert installs, "the Dockerfile installs nothing with pip"
    constraint_runs = [a for k, a in stage if k == "RUN" and "torch.__version__" in a]
    assert len(constraint_runs) == 1, "one RUN must record the base image's torch version as a pip constraint"
    constraint_file = re.search(r">\s*(\S+)", constraint_runs[0]).group(1)
    for args in installs:
        packages = [a for a in args if not a.startswith("-")]
        assert not any(re.match(r"^torch([<>=!~\[ ]|$)", p) for p in packages), f"pip reinstalls torch: {args}"
        assert not {"-U", "--upgrade", "--force-reinstall", "--ignore-installed", "-I"} & set(args), args
        assert any(args[i] in ("-c", "--constraint") and args[i + 1] == constraint_file
                   for i in range(len(args) - 1)), f"pip install without the torch constraint: {args}"


def test_dependencies_are_installed_before_the_source_is_copied(steps):
    stage = final_stage(steps)
    copy_index = [i for i, (k, _) in enumerate(stage) if k == "COPY"]
    first_copy_sources = [a for k, a in stage if k == "COPY"][0].split()[:-1]
    assert first_copy_sources == ["pyproject.toml"], "copy pyproject.toml alone first, so deps are a cached layer"
    deps_run = next(i for i, (k, a) in enumerate(stage) if k == "RUN" and "pyproject.toml" in a)
    assert copy_index[0] < deps_run < copy_index[1], "install the dependencies between the two COPY steps"
    project_install = [a for a in pip_installs(stage) if "." in a]
    assert project_install and all("--no-deps" in a for a in project_install)


def test_runs_as_a_non_root_user(steps):
    stage = final_stage(steps)
    users = [args for k, args in stage if k == "USER"]
    assert users, "no USER instruction: the image would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"final USER is root: {users[-1]}"
    if user.isdigit():
        created = any(re.search(rf"useradd\b.*--uid {user}\b", a) for k, a in stage if k == "RUN")
        assert created, f"USER {user} has no useradd --uid {user}: give the UID a named user and home"
    else:
        pytest.fail(f"USER {user}: use a numeric UID so Kubernetes' runAsNonRoot can verify it")


def test_entrypoint_script_is_copied_in_and_executable(steps):
    stage = final_stage(steps)
    entrypoints = [args for k, args in stage if k == "ENTRYPOINT"]
    assert entrypoints, "no ENTRYPOINT"
    exec_form = json.loads(entrypoints[-1])
    assert isinstance(exec_form, list), "use the exec form of ENTRYPOINT, so signals reach ft_launcher"
    target = PurePosixPath(exec_form[0])
    for source, dest in copies(stage):
        if target == dest or ((REPO / source).is_dir() and target.is_relative_to(dest)):
            script = REPO / source / target.relative_to(dest)
            break
    else:
        pytest.fail(f"ENTRYPOINT {target} is not inside any COPY destination")
    assert script == REPO / "trainer_image" / "entrypoint.sh"
    assert script.is_file(), f"{script.relative_to(REPO)} is missing"
    assert script.read_text().startswith("#!"), f"{script.relative_to(REPO)} needs a shebang line"
    assert os.access(script, os.X_OK), f"{script.relative_to(REPO)} is not executable: chmod +x it"
    tracked = subprocess.run(["git", "ls-files", "-s", "--", str(script)], cwd=REPO,
                             capture_output=True, text=True, check=False).stdout.split()
    if tracked:  # untracked while being written; once committed the mode must survive a clone
        assert tracked[0] == "100755", f"git stores {script.name} as {tracked[0]}: git add --chmod=+x it"


def test_environment_and_labels(steps):
    stage = final_stage(steps)
    env = " ".join(a for k, a in stage if k == "ENV")
    assert re.search(r"\bPYTHONUNBUFFERED=1\b", env)
    assert [a for k, a in stage if k == "WORKDIR"][-1] == "/opt/app"
    labels = " ".join(a for k, a in stage if k == "LABEL")
    assert "org.opencontainers.image.title=" in labels


def test_the_image_carries_the_build_stamp_the_pipeline_checks(steps):
    """ARG VERSION (no default) -> ENV RESILIENT_TRAIN_VERSION (read by components/lib/version.py) and the OCI
    version label; the build fails without it instead of baking a placeholder."""
    from components.lib.version import VERSION_ENV, VERSION_LABEL

    stage = final_stage(steps)
    assert ("ARG", "VERSION") in stage, "VERSION must be a build arg without a default"
    assert ("ENV", f'{VERSION_ENV}="$VERSION"') in stage
    assert ("LABEL", f'{VERSION_LABEL}="$VERSION"') in stage
    (check,) = [a for k, a in stage if k == "RUN" and "$VERSION" in a]
    def build_step(value: str) -> subprocess.CompletedProcess:
        return subprocess.run(["sh", "-c", check], env={"VERSION": value, "PATH": os.environ["PATH"]},
                              capture_output=True, text=True, check=False)

    missing = build_step("")
    assert missing.returncode != 0 and "--print-version" in missing.stderr
    assert build_step("0.1.0+7aef037").returncode == 0


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent directories wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        options = [pattern, pattern[3:]] if pattern.startswith("**/") else [pattern]
        if any(fnmatch.fnmatchcase(c, p) for c in candidates for p in options):
            excluded = not negate
    return excluded


def test_dockerignore_sends_what_the_dockerfile_copies_and_nothing_heavy(steps):
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for source, _ in copies(final_stage(steps)):
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        assert not dockerignored(source, patterns), f"COPY {source} is excluded by .dockerignore"
    assert not dockerignored("trainer_image/entrypoint.sh", patterns)
    for heavy in (".venv/bin/python", ".git/HEAD", "runs/x/ckpt", "tests/deploy/test_dockerfile.py",
                  "components/__pycache__/x.pyc", "resilient_train.egg-info/PKG-INFO", ".pytest_cache/v"):
        assert dockerignored(heavy, patterns), f"{heavy} would be sent to the Docker daemon"
