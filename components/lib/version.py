"""Which build of the project this is, and the check that a compiled pipeline runs the image built with it.

`build_stamp` is ``<package version>+<git describe>`` of the checkout (``0.1.0+7aef037``, ``...-dirty`` with
uncommitted changes; the package version alone outside a git checkout). ``python -m pipelines.compile``
writes it into the pipeline YAML (its description and the first step's ``compiled_version`` input), and
``trainer_image/Dockerfile`` bakes the same string into the image (build arg ``VERSION`` -> env
`VERSION_ENV` and label `VERSION_LABEL`). The pipeline's first step calls `check_image_version`, so a YAML
compiled from one commit and an image built from another fail in seconds, naming both.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

PACKAGE = "resilient-train"
VERSION_ENV = "RESILIENT_TRAIN_VERSION"
VERSION_LABEL = "org.opencontainers.image.version"
GIT_TIMEOUT_S = 10
_SAFE = re.compile(r"[^A-Za-z0-9.+_-]")


class VersionMismatch(RuntimeError):
    """The pipeline YAML and the image it runs were built from different versions."""


def package_version() -> str:
    """The installed package's version ("unknown" when the project is not installed)."""
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return "unknown"


def git_describe(repo: Path) -> str:
    """``git describe --tags --always --dirty`` of ``repo``; "" when it is not a git checkout or git is absent."""
    try:
        proc = subprocess.run(["git", "-C", str(repo), "describe", "--tags", "--always", "--dirty"],
                              capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def build_stamp(repo: Path | None = None) -> str:
    """``<package version>+<git describe>`` (e.g. ``0.1.0+7aef037-dirty``), or the package version alone."""
    described = git_describe(repo or Path(__file__).resolve().parents[2])
    return _SAFE.sub("_", f"{package_version()}+{described}") if described else package_version()


def check_image_version(compiled: str, image: str, environ: Mapping[str, str] | None = None) -> str:
    """Compare the pipeline's stamp with the running image's; raise `VersionMismatch`, else say what was checked."""
    environ = os.environ if environ is None else environ
    running = environ.get(VERSION_ENV, "")
    if not compiled:
        return "pipeline not compiled with a version stamp (python -m pipelines.compile adds one): not checked"
    if not running:
        return (f"image {image or '(local run)'} carries no {VERSION_ENV} (not built from trainer_image/Dockerfile, "
                f"or a local run): version {compiled} not checked")
    if running != compiled:
        raise VersionMismatch(
            f"the pipeline was compiled from resilient-train {compiled} but its image {image} was built from "
            f"{running}: build and push the image from the same checkout (docker build --build-arg "
            f"VERSION=\"$(python -m pipelines.compile --print-version)\" ...) or compile with --image naming the "
            "image that matches")
    return f"pipeline and image {image} are both resilient-train {compiled}"
