"""``python -m pipelines.cli {compile,submit,schedule}``: the training pipeline on a Kubeflow cluster.

    python -m pipelines.cli compile --out pipeline.yaml
    python -m pipelines.cli submit --host "$KFP_HOST" --experiment resilient-train \\
        --param model=1b --param nodes=2 --param gpus_per_node=8 --param steps=20000
    python -m pipelines.cli schedule --host "$KFP_HOST" --experiment nightly-train \\
        --cron '0 0 3 * * *' --name nightly-train --param init_from=promoted

Parameters are validated here (``components.lib.params``) before anything is submitted. Runs use the
service account ``train-launcher`` (``deploy/base/rbac.yaml``) unless ``--service-account`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from components.lib.params import ParamError, PipelineParams
from pipelines.compile import compile_pipeline

SERVICE_ACCOUNT = "train-launcher"
_CRON_FIELD = re.compile(r"^[0-9A-Za-z*/,?#LW-]+$")


class CliError(ValueError):
    """Bad command-line input; the message says what to change."""


def validate_cron(expr: str) -> str:
    """A KFP (robfig/cron) expression: six fields, seconds first; CliError otherwise."""
    fields = expr.split()
    if len(fields) == 5:
        raise CliError(f"cron {expr!r} has five fields; KFP's cron has six, seconds first: did you mean "
                       f"'0 {expr}'? (e.g. '0 0 3 * * *' is daily at 03:00:00)")
    if len(fields) != 6:
        raise CliError(f"cron {expr!r} must have six fields (second minute hour day-of-month month day-of-week), "
                       f"got {len(fields)}")
    bad = [f for f in fields if not _CRON_FIELD.match(f)]
    if bad:
        raise CliError(f"cron {expr!r}: field(s) {bad} contain characters cron does not accept")
    second = fields[0]
    if second.isdigit() and int(second) > 59:
        raise CliError(f"cron {expr!r}: the first field is the second (0-59); got {second}")
    return expr


def parse_params(items: Sequence[str], params_file: str | None = None) -> dict[str, Any]:
    """``name=value`` items (values typed by the parameter: int, float, bool, JSON for dict/list)."""
    values: dict[str, Any] = json.loads(Path(params_file).read_text()) if params_file else {}
    hints = typing.get_type_hints(PipelineParams)
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep:
            raise CliError(f"--param {item!r} must look like name=value, e.g. --param steps=2000")
        if name not in hints:
            raise CliError(f"unknown parameter {name!r}; parameters are {sorted(hints)}")
        values[name] = _typed(name, hints[name], raw)
    return values


def _typed(name: str, kind: Any, raw: str) -> Any:
    try:
        if kind is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        if kind in (dict, list):
            value = json.loads(raw)
            if not isinstance(value, kind):
                raise ValueError(raw)
            return value
    except ValueError:
        raise CliError(f"--param {name}={raw!r} is not a valid {getattr(kind, '__name__', kind)}"
                       f"{' (JSON)' if kind in (dict, list) else ''}") from None
    return raw


def validated(values: dict[str, Any]) -> dict[str, Any]:
    """The arguments to submit (only those given: the pipeline's defaults fill in the rest), validated."""
    PipelineParams.from_mapping(values).validate()
    return values


def _client(args: argparse.Namespace) -> Any:
    import kfp

    return kfp.Client(host=args.host, namespace=args.namespace)


def _experiment_id(client: Any, args: argparse.Namespace) -> str:
    if args.experiment_id:
        return args.experiment_id
    return client.create_experiment(args.experiment, namespace=args.namespace).experiment_id


def _package(args: argparse.Namespace, tmp: str) -> str:
    return args.package or str(compile_pipeline(Path(tmp) / "pipeline.yaml"))


def cmd_compile(args: argparse.Namespace) -> int:
    print(f"wrote {compile_pipeline(args.out)}")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    arguments = validated(parse_params(args.param, args.params_file))
    client = _client(args)
    with tempfile.TemporaryDirectory() as tmp:
        run = client.create_run_from_pipeline_package(
            _package(args, tmp), arguments=arguments, run_name=args.run_name, experiment_id=_experiment_id(client, args),
            namespace=args.namespace, enable_caching=None, service_account=args.service_account)
    print(f"submitted run {run.run_id}: {args.host.rstrip('/')}/#/runs/details/{run.run_id}")
    return 0


def cmd_schedule(args: argparse.Namespace) -> int:
    cron = validate_cron(args.cron)
    arguments = validated(parse_params(args.param, args.params_file))
    client = _client(args)
    with tempfile.TemporaryDirectory() as tmp:
        job = client.create_recurring_run(
            experiment_id=_experiment_id(client, args), job_name=args.name, cron_expression=cron,
            max_concurrency=args.max_concurrency, no_catchup=not args.catchup, params=arguments,
            pipeline_package_path=_package(args, tmp), service_account=args.service_account)
    print(f"scheduled recurring run {job.recurring_run_id} ({args.name}) with cron {cron!r}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipelines.cli", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_compile = sub.add_parser("compile", help="write the pipeline YAML")
    p_compile.add_argument("--out", default="pipeline.yaml")
    p_compile.set_defaults(func=cmd_compile)
    for name, func, help_text in (("submit", cmd_submit, "start one run"),
                                  ("schedule", cmd_schedule, "create a recurring run")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--host", required=True, help="KFP API endpoint, e.g. https://kubeflow.example.com/pipeline")
        p.add_argument("--namespace", default=None, help="Kubeflow profile namespace (multi-user installs)")
        group = p.add_mutually_exclusive_group()
        group.add_argument("--experiment", default="resilient-train", help="experiment name (created if missing)")
        group.add_argument("--experiment-id", default=None, help="an existing experiment's id")
        p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="a pipeline parameter")
        p.add_argument("--params-file", default=None, help="JSON object of pipeline parameters")
        p.add_argument("--package", default=None, help="a compiled pipeline.yaml (default: compile now)")
        p.add_argument("--service-account", default=SERVICE_ACCOUNT)
        p.set_defaults(func=func)
        if name == "submit":
            p.add_argument("--run-name", default=None)
        else:
            p.add_argument("--cron", required=True, help="six fields, seconds first: '0 0 3 * * *' = daily 03:00")
            p.add_argument("--name", required=True, help="the recurring run's name")
            p.add_argument("--max-concurrency", type=int, default=1,
                           help="runs at once (default 1: two runs must not share promotions mid-flight)")
            p.add_argument("--catchup", action="store_true", help="replay runs missed while paused")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CliError, ParamError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
