"""``python -m trainer --config <toml|flavour> [--section.key=value ...]``: the image's contract.

The process exit code follows ``trainer.exitcodes`` (permanent 1-127, retryable >= 128); under
``entrypoint.sh`` it is also recorded for the entrypoint, which maps ft_launcher's outcome onto it.
"""

from __future__ import annotations

import logging
import os
import sys

from trainer.config import ConfigError, describe, parse_args
from trainer.exitcodes import ExitCode, TrainerExit, classify, record_exit

log = logging.getLogger("trainer")


def main(argv: list[str] | None = None) -> int:
    code = _main(argv)
    record_exit(code)
    return int(code)


def _main(argv: list[str] | None) -> int:
    # Logging first: NVRx's Wrapper logs nothing unless logging is configured before it starts.
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
    from trainer import resiliency  # imports torch: after argument errors are reported
    from trainer.train import Resources, train

    res = None
    try:
        res = Resources.create(cfg)
        resiliency.run(res, train)
        return ExitCode.OK
    except TrainerExit as exc:
        log.warning("exit %d (%s): %s", exc.exit_code, exc.exit_code.name, exc.reason)
        return exc.exit_code
    except Exception as exc:
        code = classify(exc)
        if code == ExitCode.CONFIG_ERROR:
            print(f"config error: {exc}", file=sys.stderr)
        else:
            log.exception("exit %d (%s): %s: %s", code, code.name, type(exc).__name__, exc)
        return code
    finally:
        if res is not None and hasattr(res, "close"):
            res.close()
