"""The one error of this package that is not a ``ConfigError``."""

from __future__ import annotations

from trainer.checkpoint.errors import CheckpointError


class BaseModelFilesError(CheckpointError):
    """A base model's files are missing, unreadable or do not hold what its ``config.json`` describes (exit 4,
    CHECKPOINT_ERROR: permanent until someone repairs the files). What the user must change in the config
    (another architecture, a vocabulary that disagrees with the data) is a ``ConfigError`` instead (exit 2)."""
