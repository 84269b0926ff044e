"""Data prep from S3 against a real S3 server: moto's server mode on 127.0.0.1 (as s3fs's own tests run it),
reset between tests, with IAM authentication on: requests are signed with keys of an IAM user created in the
test and checked by the server, so wrong keys fail as they would on AWS.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests
from kfp import dsl
from moto.server import ThreadedMotoServer

from components.data_prep import data_prep
from components.lib import tokendata
from components.lib.tokendata import NullProgress, build_dataset

BUCKET = "corpus-bucket"
REGION = "us-east-1"
VOCAB = 300
_AWS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "ACCESS_KEY_ID",
            "SECRET_ACCESS_KEY", "ENDPOINT", "REGION", "HF_TOKEN", "ACCESS_TOKEN")


def _docs(n: int = 16) -> list[str]:
    return [f"doc {i}: " + " ".join(f"tok{(i + j) % 11} naïve" for j in range(20 + i)) + "\n" for i in range(n)]


def _corpus_files() -> dict[str, bytes]:
    """Relative path -> bytes: text files, JSON Lines (one gzipped) and Parquet, under one prefix per format."""
    docs = _docs()
    files = {f"text/sub{i % 2}/doc-{i:02d}.txt": d.encode() for i, d in enumerate(docs)}
    lines = [json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(docs)]
    files["jsonl/part-0.jsonl"] = "".join(lines[:8]).encode()
    files["jsonl/part-1.jsonl.gz"] = gzip.compress("".join(lines[8:]).encode())
    for part in range(2):
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({"text": docs[part::2]}), sink, row_group_size=3)
        files[f"parquet/part-{part}.parquet"] = sink.getvalue().to_pybytes()
    return files


@pytest.fixture(scope="module")
def endpoint() -> str:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


class S3:
    """The test's S3: endpoint, the reader's IAM keys, the local copy of the bucket's objects, an admin client."""

    def __init__(self, endpoint: str, key: str, secret: str, local: Path, admin) -> None:
        self.endpoint, self.key, self.secret, self.local, self.admin = endpoint, key, secret, local, admin

    def reader(self):
        """A boto3 client with the reader's keys (the admin keys stop working once authentication is on)."""
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=self.key,
                            aws_secret_access_key=self.secret)

    def env(self, **overrides: str) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.key, "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_REGION": REGION, **overrides}


@pytest.fixture
def s3(endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> S3:
    """A freshly reset server: an IAM user allowed to read the bucket, the corpus uploaded (versioned bucket),
    the same files on local disk, then authentication switched on; the reader's keys are in the environment."""
    requests.post(f"{endpoint}/moto-api/reset-auth", data=b"inf", timeout=10).raise_for_status()
    requests.post(f"{endpoint}/moto-api/reset", timeout=10).raise_for_status()
    admin_kw = dict(endpoint_url=endpoint, region_name=REGION, aws_access_key_id="admin-setup",
                    aws_secret_access_key="admin-setup")
    iam, admin = boto3.client("iam", **admin_kw), boto3.client("s3", **admin_kw)
    iam.create_user(UserName="corpus-reader")
    policy = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["s3:ListBucket", "s3:ListBucketVersions"], "Resource": "arn:aws:s3:::*"},
        {"Effect": "Allow", "Action": ["s3:GetObject", "s3:GetObjectVersion"], "Resource": f"arn:aws:s3:::{BUCKET}/*"},
    ]}
    iam.put_user_policy(UserName="corpus-reader", PolicyName="read-corpus", PolicyDocument=json.dumps(policy))
    keys = iam.create_access_key(UserName="corpus-reader")["AccessKey"]
    admin.create_bucket(Bucket=BUCKET)
    admin.put_bucket_versioning(Bucket=BUCKET, VersioningConfiguration={"Status": "Enabled"})
    local = tmp_path / "local"
    for rel, data in _corpus_files().items():
        admin.put_object(Bucket=BUCKET, Key=f"corpus/{rel}", Body=data)
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(data)
    for name in _AWS_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask an instance metadata service
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials-file"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config-file"))
    state = S3(endpoint, keys["AccessKeyId"], keys["SecretAccessKey"], local, admin)
    for name, value in state.env().items():
        monkeypatch.setenv(name, value)
    requests.post(f"{endpoint}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()  # auth on
    yield state
    requests.post(f"{endpoint}/moto-api/reset-auth", data=b"inf", timeout=10).raise_for_status()


@pytest.mark.parametrize("fmt", ["text", "jsonl", "parquet"])
def test_each_format_from_s3_equals_the_same_corpus_read_locally(s3: S3, fmt: str, tmp_path: Path) -> None:
    remote = build_dataset(f"s3://{BUCKET}/corpus/{fmt}/", tmp_path / "remote", vocab_size=VOCAB, val_fraction=0.25,
                           progress=NullProgress())
    local = build_dataset(s3.local / fmt, tmp_path / "local", vocab_size=VOCAB, val_fraction=0.25,
                          progress=NullProgress())
    assert remote["splits"] == local["splits"], "the same shards, byte for byte"
    assert remote["tokenizer_sha256"] == local["tokenizer_sha256"]
    assert remote["source"]["num_documents"] == local["source"]["num_documents"] == 16
    assert remote["source"]["uri"] == f"s3://{BUCKET}/corpus/{fmt}/"
    objects = remote["source"]["objects"]
    assert [o["path"] for o in objects] == [o["path"] for o in local["source"]["objects"]]
    client = s3.reader()
    for entry in objects:
        head = client.head_object(Bucket=BUCKET, Key=f"corpus/{fmt}/{entry['path']}")
        assert entry["etag"] == head["ETag"].strip('"')
        assert entry["version_id"] == head["VersionId"], "a versioned bucket's VersionId is recorded"
        assert entry["size"] == head["ContentLength"] and entry["last_modified"].endswith("+00:00")


def test_a_glob_in_the_uri_selects_objects(s3: S3, tmp_path: Path) -> None:
    manifest = build_dataset(f"s3://{BUCKET}/corpus/text/sub1/*.txt", tmp_path / "ds", vocab_size=VOCAB,
                             progress=NullProgress())
    assert [o["path"] for o in manifest["source"]["objects"]] == [f"doc-{i:02d}.txt" for i in range(1, 16, 2)]
    manifest = build_dataset(f"s3://{BUCKET}/corpus/**/*.jsonl*", tmp_path / "ds2", vocab_size=VOCAB,
                             progress=NullProgress())
    assert [o["path"] for o in manifest["source"]["objects"]] == ["jsonl/part-0.jsonl", "jsonl/part-1.jsonl.gz"]
    assert manifest["source"]["pattern"] == "**/*.jsonl*" and manifest["source"]["num_documents"] == 16


def test_kubeflow_initializer_variable_names_work(s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("ACCESS_KEY_ID", s3.key)
    monkeypatch.setenv("SECRET_ACCESS_KEY", s3.secret)
    monkeypatch.setenv("ENDPOINT", s3.endpoint)
    monkeypatch.setenv("REGION", REGION)
    manifest = build_dataset(f"s3://{BUCKET}/corpus/jsonl", tmp_path / "ds", vocab_size=VOCAB, progress=NullProgress())
    assert manifest["source"]["num_documents"] == 16


def _cli(capfd: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    rc = tokendata.main(list(args))
    out, err = capfd.readouterr()
    return rc, out, err


@pytest.mark.parametrize(("env", "expected"), [
    ({"AWS_SECRET_ACCESS_KEY": "wrong-secret-value-123"}, "access denied (The request signature we calculated"),
    ({"AWS_ACCESS_KEY_ID": "AKIAUNKNOWNKEY000000"}, "access denied (The AWS Access Key Id you provided does not exist"),
])
def test_wrong_keys_give_one_line_and_exit_2(s3: S3, env: dict, expected: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch, capfd) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    rc, _, err = _cli(capfd, "--corpus", f"s3://{BUCKET}/corpus/jsonl", "--out", str(tmp_path / "ds"))
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("error: corpus s3://corpus-bucket/corpus/jsonl: ")
    assert expected in err and "check the credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY" in err
    assert not (tmp_path / "ds").exists()


def test_missing_bucket_gives_one_line_and_exit_2(s3: S3, tmp_path: Path, capfd) -> None:
    rc, _, err = _cli(capfd, "--corpus", "s3://no-such-bucket/corpus", "--out", str(tmp_path / "ds"))
    assert rc == 2 and err.count("\n") == 1
    assert "the bucket does not exist" in err and "check the bucket name in the URI" in err
    rc, _, err = _cli(capfd, "--corpus", f"s3://{BUCKET}/corpus/nothing-here/", "--out", str(tmp_path / "ds"))
    assert rc == 2 and err.count("\n") == 1 and "does not exist" in err
    rc, _, err = _cli(capfd, "--corpus", f"s3://{BUCKET}/corpus/text", "--pattern", "*.md", "--out",
                      str(tmp_path / "ds"))
    assert rc == 2 and err.count("\n") == 1 and "has no files matching '*.md'" in err
    assert not (tmp_path / "ds").exists()


def test_an_unreachable_endpoint_is_exit_3(s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    rc, _, err = _cli(capfd, "--corpus", f"s3://{BUCKET}/corpus/jsonl", "--out", str(tmp_path / "ds"))
    assert rc == 3 and err.count("\n") == 1
    assert "could not be read (EndpointConnectionError" in err and "check its endpoint and network" in err


def test_credentials_never_appear_in_output_manifest_or_the_kfp_step(s3: S3, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch, capfd) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_not_for_s3_but_secret")
    secrets = [s3.key, s3.secret, "hf_not_for_s3_but_secret"]
    rc, out, err = _cli(capfd, "--corpus", f"s3://{BUCKET}/corpus/parquet/", "--out", str(tmp_path / "cli"))
    assert rc == 0 and "tokendata: done:" in err
    logs = out + err
    artifact = dsl.Dataset(uri=str(tmp_path / "artifact" / "dataset"))
    data_prep.python_func(corpus=f"s3://{BUCKET}/corpus/jsonl/", vocab_size=VOCAB, max_corpus_bytes=0,
                          workdir=str(tmp_path / "w"), run_id="r1", init_from="", model="tiny", promoted_registry="",
                          dataset=artifact, text_field="text")
    out, err = capfd.readouterr()
    logs += out + err
    assert artifact.metadata["corpus"] == f"s3://{BUCKET}/corpus/jsonl/" and "[data] " in out
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "another-wrong-secret-456")
    secrets.append("another-wrong-secret-456")
    rc, out, err = _cli(capfd, "--corpus", f"s3://{BUCKET}/corpus/text", "--out", str(tmp_path / "failed"))
    assert rc == 2
    logs += out + err
    written = [p.read_bytes().decode("utf-8", "replace") for p in tmp_path.rglob("*") if p.is_file()
               and p.suffix in (".json", "")]
    everything = "\n".join([logs, json.dumps(artifact.metadata), *written])
    assert "manifest" in "".join(str(p) for p in tmp_path.rglob("manifest.json"))
    for secret in secrets:
        assert secret not in everything

