"""The credentials Secret (``corpus_secret``): which keys it may hold, and how each consumer receives them.

One Secret, named by the pipeline parameter ``corpus_secret``, carries the credentials for the corpus, the
tokenizer and the base model. Its keys are the environment variables the readers already understand (s3fs /
botocore, huggingface_hub, gcsfs / google-auth), so a Secret made for one tool works for the others:

``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``HF_TOKEN``,
``GOOGLE_APPLICATION_CREDENTIALS`` (a service-account key's JSON; its env variable names a file, so that key is
handed over as a file). Keys that are absent are skipped, and so is a Secret that does not exist.

How each consumer gets them (the mappings are data, below):

- **data prep** (a KFP step): the Secret is mounted as files at `MOUNT_DIR` (``kfp.kubernetes.
  use_secret_as_volume(..., optional=True)``: the name can be a run parameter since KFP 2.5, and a missing
  Secret mounts an empty directory); `load_mounted` exports the keys present into the step's environment.
  Why files and not ``use_secret_as_env``: before KFP 2.15 each env key is required, so a Secret holding only
  ``HF_TOKEN`` would keep the pod from starting; and the Google key must be a file anyway.
- **the training pods** of a PyTorchJob, when ``base_model`` is a URI the trainer downloads: `TRAINER_ENV`,
  optional ``secretKeyRef`` env variables (Kubernetes skips absent keys).
- **a TrainJob's model initializer**: Kubeflow Trainer's names (``ACCESS_TOKEN``, ``ACCESS_KEY_ID``...), see
  ``components.lib.trainjob.MODEL_INITIALIZER_ENV``.

Values are never printed, logged or written to an artifact; only the names of the keys found are.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION", "HF_TOKEN",
        "GOOGLE_APPLICATION_CREDENTIALS")
FILE_KEYS = frozenset({"GOOGLE_APPLICATION_CREDENTIALS"})
"""Keys whose environment variable names a file holding the value, rather than holding it."""
MOUNT_DIR = "/var/run/secrets/resilient-train/credentials"
"""Where data prep mounts the Secret."""
TRAINER_ENV = {key: key for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION",
                                    "HF_TOKEN")}
"""Secret key -> env variable of the training container (PyTorchJob): what the trainer's hf:// and s3://
download reads."""


def load_mounted(directory: str | Path = MOUNT_DIR, env: MutableMapping[str, str] | None = None) -> list[str]:
    """Export the credentials found in a mounted Secret `directory` into `env` (default ``os.environ``); return
    the names set, sorted. A key in the Secret wins over the same variable inherited from the pod; a missing or
    empty directory (no Secret) sets nothing."""
    env = os.environ if env is None else env
    d = Path(directory)
    found = []
    for key in KEYS:
        path = d / key
        if not path.is_file():
            continue
        if key in FILE_KEYS:
            env[key] = str(path)
        else:
            value = path.read_text().strip()
            if not value:
                continue
            env[key] = value
        found.append(key)
    return sorted(found)
