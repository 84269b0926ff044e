"""The per-job secret of the trainer's peer tier, as the launch step hands it to a job's pods.

The trainer's replica servers (``trainer_image/trainer/checkpoint/replicas.py``) serve and accept whole snapshots of
the training state, to requests signed with a secret every rank of the job shares (``peerauth.py``), read from the
file ``TRAINER_JOB_SECRET_FILE`` names. The cluster launcher makes it a Kubernetes Secret owned by the job
(``components.lib.k8s_guard``) and mounts it at `SECRET_FILE` in every pod; the local launcher writes a 0600 file in
the launch's own temporary directory (0700, removed when the launch ends) and names it to every node it starts.
Either way the secret never appears in a manifest, an argument list or a process's environment: only its path does.
(Mirrors of the trainer's names: components never import the trainer; a test keeps them equal.)
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

SECRET_FILE_ENV = "TRAINER_JOB_SECRET_FILE"
"""The trainer reads the job's secret from the file this names (``trainer.checkpoint.peerauth.SECRET_FILE_ENV``)."""
REPLICA_ADDR_ENV = "TRAINER_REPLICA_ADDR"
"""The address the other nodes reach a node's replica servers at, and the one they listen on
(``trainer.checkpoint.replicas.ADDR_ENV``)."""
SECRET_KEY = "peer-secret"
"""The key of the job's Secret, and the file name under `SECRET_DIR`."""
SECRET_DIR = "/var/run/secrets/resilient-train"
SECRET_FILE = f"{SECRET_DIR}/{SECRET_KEY}"
SECRET_VOLUME = "peer-secret"
SECRET_MODE = 0o440
"""Read-only for the image's user and its fsGroup (Kubernetes gives a Secret volume's files the pod's fsGroup)."""


def new_secret() -> str:
    """64 random URL-safe characters (48 bytes of entropy)."""
    return secrets.token_urlsafe(48)


def write_secret_file(directory: Path) -> Path:
    """A new secret in ``directory/job-secret``, readable by this user only."""
    path = Path(directory) / "job-secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(new_secret())
    return path


def secret_name(job: str) -> str:
    """The job's Secret (a job name is at most 40 characters: the result is a valid DNS-1123 name)."""
    return f"{job}-peer-secret"


def policy_name(job: str) -> str:
    """The job's NetworkPolicy."""
    return f"{job}-peers"


def peer_env(models: Any) -> list[Any]:
    """The training container's env of the peer tier, as `models`' (``kubernetes.client`` or the Trainer API's
    models, which name their classes ``IoK8sApiCoreV1...``) objects: the secret's file, and the pod's IP as its
    replica servers' address (downward API)."""
    env, source, field = _models(models, "EnvVar", "EnvVarSource", "ObjectFieldSelector")
    return [env(name=SECRET_FILE_ENV, value=SECRET_FILE),
            env(name=REPLICA_ADDR_ENV, value_from=source(field_ref=field(field_path="status.podIP")))]


def secret_volume(models: Any, job: str) -> Any:
    """The pod volume of the job's Secret (read-only files, `SECRET_MODE`)."""
    volume, secret = _models(models, "Volume", "SecretVolumeSource")
    return volume(name=SECRET_VOLUME, secret=secret(secret_name=secret_name(job), default_mode=SECRET_MODE))


def secret_mount(models: Any) -> Any:
    (mount,) = _models(models, "VolumeMount")
    return mount(name=SECRET_VOLUME, mount_path=SECRET_DIR, read_only=True)


def _models(models: Any, *names: str) -> list[Any]:
    return [getattr(models, f"V1{n}", None) or getattr(models, f"IoK8sApiCoreV1{n}") for n in names]
