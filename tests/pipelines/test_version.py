"""The build stamp, and the first step's check that the pipeline YAML and its image were built together."""

import subprocess

import pytest

from components.lib.version import VERSION_ENV, VersionMismatch, build_stamp, check_image_version, package_version
from components.validate import validate_params

IMAGE = "registry.example.com/team/resilient-train:0.1.0"


def test_stamp_is_the_package_version_plus_git_describe(tmp_path):
    assert build_stamp(tmp_path) == package_version()  # not a git checkout
    git = ["git", "-C", str(tmp_path), "-c", "user.email=t@example.com", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "f").write_text("1")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert build_stamp(tmp_path) == f"{package_version()}+{commit}"
    (tmp_path / "f").write_text("2")
    assert build_stamp(tmp_path) == f"{package_version()}+{commit}-dirty"


def test_mismatch_names_both_versions_and_the_fix():
    with pytest.raises(VersionMismatch) as info:
        check_image_version("0.1.0+aaa", IMAGE, {VERSION_ENV: "0.1.0+bbb"})
    message = str(info.value)
    assert "0.1.0+aaa" in message and "0.1.0+bbb" in message and IMAGE in message
    assert "--build-arg VERSION" in message
    assert "both resilient-train 0.1.0+aaa" in check_image_version("0.1.0+aaa", IMAGE, {VERSION_ENV: "0.1.0+aaa"})
    assert "not checked" in check_image_version("0.1.0+aaa", IMAGE, {})  # a local run: no image
    assert "not checked" in check_image_version("", IMAGE, {VERSION_ENV: "0.1.0+bbb"})


def test_the_first_step_fails_on_a_mismatched_image(monkeypatch, tmp_path, capsys):
    from components.lib.params import PipelineParams

    values = {name: getattr(PipelineParams(), name) for name in PipelineParams.__dataclass_fields__}
    values.update(image=IMAGE)
    monkeypatch.setenv(VERSION_ENV, "0.1.0+other")
    with pytest.raises(VersionMismatch, match="0.1.0\\+other"):
        validate_params.python_func(**values, compiled_version="0.1.0+mine", compiled_pull_secrets=[])
    monkeypatch.setenv(VERSION_ENV, "0.1.0+mine")
    assert validate_params.python_func(**values, compiled_version="0.1.0+mine", compiled_pull_secrets=[])
    assert "both resilient-train 0.1.0+mine" in capsys.readouterr().out
