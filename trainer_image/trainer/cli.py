"""``python -m trainer --config <toml|flavour> [--section.key=value ...]``: the image's contract."""

from __future__ import annotations

import logging
import os
import sys

from trainer.config import ConfigError, describe, parse_args
from trainer.exitcodes import ExitCode


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s [rank{os.environ.get('RANK', '0')}] %(name)s: %(message)s"
    )
    try:
        args, cfg = parse_args(argv)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    if args.help_config:
        print(describe())
        return ExitCode.OK
    if args.print_config:
        print(cfg.to_json())
        return ExitCode.OK
    from trainer.train import Resources, train  # imports torch: after argument errors are reported

    try:
        train(Resources.create(cfg))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    return ExitCode.OK
