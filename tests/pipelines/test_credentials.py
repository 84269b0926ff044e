"""The credentials Secret as data prep sees it (components/lib/credentials.py): mounted files -> its environment."""

from components.lib.credentials import KEYS, load_mounted


def test_keys_present_are_exported_and_files_stay_files(tmp_path):
    (tmp_path / "AWS_ACCESS_KEY_ID").write_text("AKIA-sentinel\n")
    (tmp_path / "AWS_SECRET_ACCESS_KEY").write_text("s3cr3t")
    (tmp_path / "AWS_REGION").write_text("  \n")  # empty: skipped, not exported as ""
    (tmp_path / "GOOGLE_APPLICATION_CREDENTIALS").write_text('{"type": "service_account"}')
    (tmp_path / "UNRELATED").write_text("ignored")
    env = {"AWS_ACCESS_KEY_ID": "from-the-pod", "PATH": "/bin"}
    found = load_mounted(tmp_path, env)
    assert found == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "GOOGLE_APPLICATION_CREDENTIALS"]
    assert env["AWS_ACCESS_KEY_ID"] == "AKIA-sentinel"  # the Secret wins over what the pod inherited
    assert env["GOOGLE_APPLICATION_CREDENTIALS"] == str(tmp_path / "GOOGLE_APPLICATION_CREDENTIALS")  # a path
    assert "AWS_REGION" not in env and "UNRELATED" not in env and env["PATH"] == "/bin"


def test_no_secret_means_nothing_changes(tmp_path):
    env = {"HF_TOKEN": "from-the-shell"}
    assert load_mounted(tmp_path / "not-mounted", env) == [] and env == {"HF_TOKEN": "from-the-shell"}
    assert load_mounted(tmp_path, env) == []  # an optional Secret that does not exist mounts an empty directory
    assert set(KEYS) >= {"HF_TOKEN", "AWS_ENDPOINT_URL"}
