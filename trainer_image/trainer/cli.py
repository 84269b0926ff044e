"""``python -m trainer --config <toml|flavour> [--section.key=value ...]``: the image's contract.

The process exit code follows ``trainer.exitcodes`` (permanent 1-127, retryable >= 128); under
``entrypoint.sh`` it is also recorded for the entrypoint, which maps ft_launcher's outcome onto it.

Errors: an expected one (config, data, checkpoint, unhealthy node, preemption, lost launcher) is one line on
stderr, ``exit <code> (<NAME>): <reason>`` (``config error: <reason>`` for bad config), without a traceback;
an unexpected one (exit 1, a bug) keeps its traceback there. Every log line of this process, tracebacks
included, also goes to ``<run_dir>/logs/trainer-rank<RANK>.log`` (appended to by every attempt).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from trainer.startup import phases, warmup
from trainer.config import ConfigError, describe, parse_args
from trainer.exitcodes import ExitCode, TrainerExit, classify, code_name, is_retryable, on_exit, record_exit

log = logging.getLogger("trainer")

LOG_FORMAT = "%(asctime)s %(levelname)s [rank{rank}] %(name)s: %(message)s"
LOG_FILE = "logs/trainer-rank{rank}.log"
"""Relative to ``train.run_dir``: the full log of one rank, every attempt appended."""
CONSOLE_TRACEBACK = "console_traceback"
"""``extra={CONSOLE_TRACEBACK: True}`` on a log call: show its traceback on stderr too (code errors only)."""


def main(argv: list[str] | None = None) -> int:
    with contextlib.ExitStack() as cleanup:
        code, reason = _main(argv, cleanup)
        record_exit(code, reason)
    return int(code)


def _main(argv: list[str] | None, cleanup: contextlib.ExitStack) -> tuple[ExitCode, str]:
    # Logging first: NVRx's Wrapper logs nothing unless logging is configured before it starts.
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT.format(rank=rank))
    for handler in logging.getLogger().handlers:
        if getattr(handler, "stream", None) is sys.stderr:  # the console (not a host's own handlers)
            handler.setFormatter(_OneLineFormatter(LOG_FORMAT.format(rank=rank)))
    try:
        args, cfg = parse_args(argv)
    except ConfigError as exc:
        return _config_error(str(exc))
    except SystemExit as exc:  # argparse already printed its usage line and error
        return (ExitCode.OK, "") if exc.code in (0, None) else (ExitCode.CONFIG_ERROR, "invalid arguments")
    if args.help_config:
        print(describe())
        return ExitCode.OK, ""
    if args.print_config:
        print(cfg.to_json())
        return ExitCode.OK, ""
    log_path = Path(cfg.train.run_dir) / LOG_FILE.format(rank=rank)
    try:
        cleanup.enter_context(_log_to_file(log_path, rank))
    except OSError as exc:
        return _config_error(f"train.run_dir: cannot write the log {log_path} ({exc.strerror or exc}); set "
                             "--train.run_dir to a writable directory")
    # a new container's Triton kernels compiled in another process while this one starts (startup/warmup.py)
    warmup.spawn(sys.argv[1:] if argv is None else list(argv), cfg)
    # FT: a respawned worker's start: torch is imported, then its CUDA context is made while the rest is imported
    phases.warm_cuda(cfg.train.device, int(os.environ.get("LOCAL_RANK", "0")))
    from trainer import resiliency  # imports torch: after argument errors are reported
    from trainer.ledger import Ledger
    from trainer.train import Resources, train

    phases.CLOCK.mark("import")
    # one ledger for the process: its exit record names the step the training loop was in
    ledger = Ledger(cfg.train.run_dir, int(rank), int(os.environ.get("WORLD_SIZE", "1")))
    # FT: every way out records its exit in the ledger: the next attempt names it as its restart's cause
    cleanup.enter_context(on_exit(lambda code, reason: ledger.exit(code, code_name(code), reason)))
    res = None
    outcome: tuple[ExitCode, str] | None = None
    try:
        res = Resources.create(cfg)  # data, device and checkpoint-dir errors are classified like training's
        res.start_warmup()  # FT: a new GPU worker loads its first step's kernels while it starts (startup/warmup.py)
        phases.CLOCK.mark("resources")
        resiliency.run(res, train, ledger=ledger)
        outcome = ExitCode.OK, ""
    except (TrainerExit, Exception) as exc:
        outcome = report(exc)
    finally:
        if res is not None and hasattr(res, "close"):
            # FT: a finished run or a permanent error ends the job: its node-local snapshots go with it; after a
            # retryable exit they stay only for a worker a launcher restarts in place (entrypoint.sh removes them
            # when the job ends). A plain process, or torchrun's last attempt, leaves nothing in node memory.
            from trainer.checkpoint.reaper import restart_in_place_expected

            respawn = restart_in_place_expected() and (outcome is None or is_retryable(outcome[0]))
            res.close(job_over=not respawn)
    return outcome


def _config_error(reason: str) -> tuple[ExitCode, str]:
    sys.stderr.flush()  # FT: one write of the whole line: a node's workers fail at once, and their lines must not mix
    os.write(sys.stderr.fileno(), f"config error: {_one_line(reason)}\n".encode())
    return ExitCode.CONFIG_ERROR, _one_line(reason)


def report(exc: BaseException) -> tuple[ExitCode, str]:
    """Log the exception that ended this process as one line (a traceback too for a code error on stderr;
    always in the log file); return its contract code and the one-line reason."""
    code = classify(exc)
    if isinstance(exc, TrainerExit):
        reason = exc.reason
    elif code == ExitCode.CONFIG_ERROR:
        reason = str(exc)
    else:
        reason = f"{type(exc).__name__}: {exc}"
    line = f"config error: {_one_line(reason)}" if code == ExitCode.CONFIG_ERROR else \
        f"exit {int(code)} ({code.name}): {_one_line(reason)}"
    level = logging.WARNING if code == ExitCode.PREEMPTED else logging.ERROR
    log.log(level, "%s", line, exc_info=exc, extra={CONSOLE_TRACEBACK: code == ExitCode.CODE_ERROR})
    return code, _one_line(reason)


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in text.splitlines() if part.strip()) or "(no message)"


class _OneLineFormatter(logging.Formatter):
    """The console's formatter: a record's traceback only when it asks for it (``CONSOLE_TRACEBACK``)."""

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info and not getattr(record, CONSOLE_TRACEBACK, False):
            saved, record.exc_info, record.exc_text = record.exc_info, None, None
            try:
                return super().format(record)
            finally:
                record.exc_info = saved
        return super().format(record)


@contextlib.contextmanager
def _log_to_file(path: Path, rank: str) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(LOG_FORMAT.format(rank=rank)))
    logging.getLogger().addHandler(handler)
    try:
        yield
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
