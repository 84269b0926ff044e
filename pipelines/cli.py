"""``python -m pipelines.cli {compile,submit,schedule,plan}``: the training pipeline on a Kubeflow cluster.

    python -m pipelines.cli compile --image "$IMAGE" --out pipeline.yaml
    python -m pipelines.cli submit --host "$KFP_HOST" --namespace "$NAMESPACE" --package pipeline.yaml \\
        --param model=1b --param nodes=2 --param gpus_per_node=8 --param steps=20000
    python -m pipelines.cli schedule --host "$KFP_HOST" --namespace "$NAMESPACE" --package pipeline.yaml \\
        --cron '0 0 3 * * *' --name nightly-train --param init_from=promoted
    python -m pipelines.cli plan --run RUN_DIR --gpus 16384 --spares 4 --recommend --chart goodput.png
    python -m pipelines.cli plan --run RUN_DIR --measured NODE_LOSS_RUN --gpus 16384   # another run's ledger too

Parameters are validated here (``components.lib.params``) before anything is submitted. Runs use the
profile's service account ``default-editor``, to which ``deploy/base/rbac.yaml`` binds the launcher's
extra rights, unless ``--service-account`` says otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import typing
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from components.lib.params import ParamError, PipelineParams, step_pull_secret_errors
from components.lib.planning import PLAN_MODULE
from pipelines.compile import compile_pipeline

SERVICE_ACCOUNT = "default-editor"  # the Kubeflow profile's editor; deploy/base/rbac.yaml binds the launcher Role to it
TOKEN_ENV = "KFP_TOKEN"
COOKIES_ENV = "KFP_COOKIES"
#: The KFP API server seen from a pod (Kubeflow installs it in namespace "kubeflow").
IN_CLUSTER_HOST = "http://ml-pipeline.{namespace}.svc.cluster.local:8888"
KFP_SYSTEM_NAMESPACE = "kubeflow"
IN_CLUSTER_ENV = "KUBERNETES_SERVICE_HOST"
#: Where a pod finds its own namespace, and where kfp keeps its context (the default namespace of ``kfp``).
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
KFP_CONTEXT_FILE = "~/.config/kfp/context.json"
_CRON_FIELD = re.compile(r"^[0-9A-Za-z*/,?#LW-]+$")
# (name, low, high, names allowed) of each KFP (robfig/cron) field, seconds first.
_CRON_RANGES = (("second", 0, 59, ()), ("minute", 0, 59, ()), ("hour", 0, 23, ()), ("day-of-month", 1, 31, ()),
                ("month", 1, 12, ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV",
                                  "DEC")),
                ("day-of-week", 0, 6, ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")))

AUTH_HELP = f"""\
authentication (Kubeflow with multi-user isolation needs one of these):
  in the cluster (a Kubeflow notebook, a pod):
      omit --host. The client calls {IN_CLUSTER_HOST.format(namespace=KFP_SYSTEM_NAMESPACE)} with the
      pod's projected ServiceAccount token (kfp.client.ServiceAccountTokenVolumeCredentials), read from
      $KF_PIPELINES_SA_TOKEN_PATH or /var/run/secrets/kubeflow/pipelines/token. In a Kubeflow notebook,
      tick the configuration "Allow access to Kubeflow Pipelines" (PodDefault access-ml-pipeline) so the
      token is mounted. --token-path names another file, --kfp-namespace another KFP install namespace.
  from a laptop, with a token:
      --host https://KUBEFLOW/pipeline and $KFP_TOKEN (or --existing-token), e.g.
      export KFP_TOKEN=$(kubectl -n "$NAMESPACE" create token default-editor)
      (Kubeflow >= 1.9 accepts ServiceAccount tokens at its gateway; or use your OIDC id token). Against a
      port-forward of svc/ml-pipeline, create it with --audience=pipelines.kubeflow.org.
  from a laptop, with a browser session:
      --host https://KUBEFLOW/pipeline and $KFP_COOKIES (or --cookies), e.g.
      export KFP_COOKIES="authservice_session=..." (or oauth2_proxy_kubeflow=...), copied from the
      browser's cookies for the Kubeflow site after logging in.
  a single-user (standalone) KFP:
      --host http://localhost:8888 (kubectl -n kubeflow port-forward svc/ml-pipeline 8888), no credentials.
Prefer the environment variables: a token on the command line is visible to other users of the machine.
"""


class CliError(ValueError):
    """Bad command-line input; the message says what to change (exit 2)."""


class KfpUnreachable(CliError):
    """The KFP API could not be reached or refused the request; the message names the host and what to check
    (exit 1)."""


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
    for value, (name, low, high, names) in zip(fields, _CRON_RANGES):
        for number in _cron_numbers(value, names):
            if not low <= number <= high:
                hint = " (the first field is the second)" if name == "second" else ""
                raise CliError(f"cron {expr!r}: the {name} field{hint} must be in {low}-{high}; got {value!r}")
    return expr


def _cron_numbers(field: str, names: Sequence[str]) -> list[int]:
    """The numbers a cron field names (range ends and single values; step sizes excluded); names skipped."""
    numbers = []
    for part in field.split(","):
        base = part.split("/", 1)[0]
        for end in base.split("-"):
            if end.isdigit():
                numbers.append(int(end))
            elif end not in ("*", "?", "") and end.upper() not in names:
                raise CliError(f"cron field {field!r}: {end!r} is neither a number nor one of {list(names) or '*'}")
    return numbers


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


def package_defaults(package: str) -> dict[str, Any]:
    """The parameter defaults compiled into a pipeline YAML (e.g. its image), typed like `PipelineParams`."""
    from kfp import components

    try:
        inputs = components.load_component_from_file(package).component_spec.inputs or {}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CliError(f"--package {package}: not a compiled pipeline YAML ({exc}); write one with "
                       "`python -m pipelines.compile --image ...`") from None
    hints = typing.get_type_hints(PipelineParams)
    return {name: int(spec.default) if hints.get(name) is int else spec.default
            for name, spec in inputs.items() if name in hints and spec.default is not None}


def validated(values: dict[str, Any], defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The arguments to submit (only those given: the pipeline's defaults fill in the rest), validated
    together with the defaults they are combined with."""
    params = PipelineParams.from_mapping({**(defaults or {}), **values}).validate()
    if defaults is not None:  # a compiled package: its pull secrets are the image_pull_secrets default
        errors = step_pull_secret_errors(params.step_image_pull_secret, defaults.get("image_pull_secrets") or [])
        if errors:
            raise ParamError(errors)
    return values


def client_arguments(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``kfp.Client`` keyword arguments for the authentication mode the flags and environment choose (`AUTH_HELP`)."""
    import kfp.client

    environ = os.environ if environ is None else environ
    token = args.existing_token or environ.get(TOKEN_ENV, "")
    cookies = args.cookies or environ.get(COOKIES_ENV, "")
    namespace = {"namespace": args.namespace} if args.namespace else {}
    if token and cookies:
        raise CliError(f"give a token (--existing-token / ${TOKEN_ENV}) or cookies (--cookies / ${COOKIES_ENV}), "
                       "not both")
    if args.host:
        if token:
            return {"host": args.host, "existing_token": token, **namespace}
        if cookies:
            return {"host": args.host, "cookies": cookies, **namespace}
        return {"host": args.host, **namespace}
    if token or cookies:
        raise CliError("a token or cookies need --host (the Kubeflow Pipelines URL): in the cluster, omit them "
                       "and the pod's ServiceAccount token is used")
    if IN_CLUSTER_ENV not in environ:
        raise CliError("no --host and not running in a Kubernetes pod: from a laptop pass --host "
                       "https://KUBEFLOW/pipeline with $KFP_TOKEN or $KFP_COOKIES (see --help)")
    # The same lookup as ServiceAccountTokenVolumeCredentials(path=None), done here to check the file first.
    token_path = Path(args.token_path or environ.get(kfp.client.KF_PIPELINES_SA_TOKEN_ENV)
                      or kfp.client.KF_PIPELINES_SA_TOKEN_PATH)
    if not token_path.is_file():
        raise CliError(f"in-cluster mode reads the Pipelines token at {token_path}, which does not exist: in a "
                       "Kubeflow notebook enable 'Allow access to Kubeflow Pipelines' (PodDefault "
                       "access-ml-pipeline), or pass --token-path, or --host with $KFP_TOKEN")
    credentials = kfp.client.ServiceAccountTokenVolumeCredentials(path=str(token_path))
    return {"host": IN_CLUSTER_HOST.format(namespace=args.kfp_namespace), "credentials": credentials, **namespace}


def default_namespace(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The namespace to use when ``--namespace`` is not given, and where it came from: in a pod, its
    ServiceAccount's namespace (a Kubeflow notebook's is its profile's); else the ``namespace`` of kfp's
    context file (``kfp`` writes it, e.g. ``Client.set_user_namespace``); ``("", "")`` when neither says."""
    environ = os.environ if environ is None else environ
    if IN_CLUSTER_ENV in environ:
        with contextlib.suppress(OSError):
            namespace = SA_NAMESPACE_FILE.read_text().strip()
            if namespace:
                return namespace, f"the pod's ServiceAccount namespace, {SA_NAMESPACE_FILE}"
    context = Path(os.path.expanduser(KFP_CONTEXT_FILE))
    with contextlib.suppress(OSError, ValueError, AttributeError):
        namespace = str(json.loads(context.read_text()).get("namespace") or "").strip()
        if namespace:
            return namespace, f"kfp's context, {context}"
    return "", ""


@contextlib.contextmanager
def quiet_kfp() -> Iterator[None]:
    """Silence what kfp and its HTTP stack log through the ``logging`` module (kfp logs a traceback per failed
    health check on the root logger); `reaching` turns their errors into one line instead."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(previous)


def _client(args: argparse.Namespace) -> Any:
    """A ``kfp.Client`` that has made exactly one request, a health check with the credentials, so refused
    credentials or a wrong host fail here with one line (kfp's own check retries five times, 5 s apart,
    and logs a traceback for each)."""
    import kfp

    if not args.namespace:
        args.namespace, source = default_namespace()
        if args.namespace:
            print(f"namespace {args.namespace} (from {source}; --namespace chooses another)")
    kwargs = client_arguments(args)
    args.host = kwargs["host"]

    class OneProbeClient(kfp.Client):
        health: Any = None

        def get_kfp_healthz(self, sleep_duration: int = 0) -> Any:  # noqa: ARG002 - kfp's signature
            # The constructor calls this when it has no namespace; once, not kfp's five attempts.
            self.health = self._healthz_api.healthz_service_get_healthz()
            return self.health

    with warnings.catch_warnings():  # "This client only works with Kubeflow Pipeline v2.0.0-beta.2 and later"
        warnings.simplefilter("ignore", FutureWarning)
        client = OneProbeClient(**kwargs)
        health = client.health or client.get_kfp_healthz()
    if not args.namespace and getattr(health, "multi_user", False):
        raise CliError(f"{args.host} is a multi-user Kubeflow Pipelines: pass --namespace with your Kubeflow profile's "
                       "namespace (the one in the Kubeflow dashboard's namespace menu)")
    return client


def _experiment_id(client: Any, args: argparse.Namespace) -> str:
    if args.experiment_id:
        return args.experiment_id
    return client.create_experiment(args.experiment, namespace=args.namespace).experiment_id


def _package(args: argparse.Namespace, arguments: dict[str, Any], tmp: str) -> str:
    """The given package, or one compiled now for the image in ``--param image=...``."""
    return args.package or str(compile_pipeline(Path(tmp) / "pipeline.yaml", image=arguments.get("image", "")))


def _arguments(args: argparse.Namespace) -> dict[str, Any]:
    values = parse_params(args.param, args.params_file)
    return validated(values, package_defaults(args.package) if args.package else None)


def cmd_compile(args: argparse.Namespace) -> int:
    print(f"wrote {compile_pipeline(args.out, image=args.image, image_pull_secrets=args.image_pull_secret)}")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    arguments = _arguments(args)
    with tempfile.TemporaryDirectory() as tmp, reaching(args):
        package = _package(args, arguments, tmp)
        client = _client(args)
        run = client.create_run_from_pipeline_package(
            package, arguments=arguments, run_name=args.run_name, experiment_id=_experiment_id(client, args),
            namespace=args.namespace, enable_caching=None, service_account=args.service_account)
    print(f"submitted run {run.run_id}: {args.host.rstrip('/')}/#/runs/details/{run.run_id}")
    return 0


def cmd_schedule(args: argparse.Namespace) -> int:
    cron = validate_cron(args.cron)
    arguments = _arguments(args)
    with tempfile.TemporaryDirectory() as tmp, reaching(args):
        package = _package(args, arguments, tmp)
        client = _client(args)
        job = client.create_recurring_run(
            experiment_id=_experiment_id(client, args), job_name=args.name, cron_expression=cron,
            max_concurrency=args.max_concurrency, no_catchup=not args.catchup, params=arguments,
            pipeline_package_path=package, service_account=args.service_account)
    print(f"scheduled recurring run {job.recurring_run_id} ({args.name}) with cron {cron!r}")
    return 0


@contextlib.contextmanager
def reaching(args: argparse.Namespace) -> Iterator[None]:
    """Turn the KFP client's transport and HTTP errors into one `CliError` line naming the host and what to check.

    The client raises urllib3 errors for an unreachable host and kfp_server_api's ApiException for HTTP
    errors; ``pipelines/`` imports neither package, so they are recognized by their module and fields."""
    try:
        with quiet_kfp():
            yield
    except CliError:
        raise
    except Exception as exc:
        host = args.host or "the in-cluster KFP API"
        status = getattr(exc, "status", None)
        if type(exc).__name__ == "ApiException" and status == 401:
            raise KfpUnreachable(f"401: {_refused(args)} (host {host})") from None
        if type(exc).__name__ == "ApiException" and status == 403:
            raise KfpUnreachable(f"403: {host} accepted the credentials but refused the request: the account may not "
                                 f"use namespace {args.namespace or '(none: pass --namespace)'}; check that it is "
                                 "your Kubeflow profile's, or that the profile's owner shared it with you") from None
        if type(exc).__name__ == "ApiException":
            raise KfpUnreachable(f"{host} answered HTTP {status} {getattr(exc, 'reason', '')}: check that --host is the "
                           "Pipelines API (often https://KUBEFLOW/pipeline) and the KFP backend is >= 2.4") from None
        if any(c.__module__.split(".")[0] == "urllib3" for c in type(exc).__mro__) or isinstance(exc, OSError):
            reason = getattr(exc, "reason", None) or exc
            raise KfpUnreachable(f"cannot reach Kubeflow Pipelines at {host} ({type(reason).__name__}): check the URL "
                           "(scheme, port, the /pipeline path), VPN or port-forward, and proxy settings") from None
        raise


def _refused(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> str:
    """What a 401 means for the credentials the CLI sent, and what to do about it."""
    environ = os.environ if environ is None else environ
    if args.existing_token or environ.get(TOKEN_ENV):
        return (f"the token was refused (--existing-token / ${TOKEN_ENV}): it has expired or is for another "
                f"cluster; make a new one, e.g. export {TOKEN_ENV}=$(kubectl -n NAMESPACE create token default-editor)")
    if args.cookies or environ.get(COOKIES_ENV):
        return (f"the session cookies were refused (--cookies / ${COOKIES_ENV}): log in to the Kubeflow dashboard "
                "again and copy the new session cookie")
    if args.host and args.host.startswith(IN_CLUSTER_HOST.split("{", 1)[0]):
        return ("the pod's Pipelines token was refused: check that the notebook has 'Allow access to Kubeflow "
                "Pipelines' (PodDefault access-ml-pipeline)")
    return f"no credentials were sent and the server wants some: set ${TOKEN_ENV} or ${COOKIES_ENV} (see --help)"


def cmd_plan(args: argparse.Namespace) -> int:
    """The goodput planner on a finished run (``python -m trainer.plan``, run as a process: no torch here); its own
    exit code (2: bad input, with one line saying what to change)."""
    return subprocess.run([sys.executable, "-m", PLAN_MODULE, *(args.planner_args or ["--help"])]).returncode  # noqa: S603


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipelines.cli", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_compile = sub.add_parser("compile", help="write the pipeline YAML")
    p_compile.add_argument("--out", default="pipeline.yaml")
    p_compile.add_argument("--image", required=True, help="the trainer image you built and pushed")
    p_compile.add_argument("--image-pull-secret", action="append", default=[], metavar="SECRET",
                           help="a docker-registry Secret to pull the image with (repeatable)")
    p_compile.set_defaults(func=cmd_compile)
    p_plan = sub.add_parser("plan", help="project a finished run's goodput at N GPUs (trainer/PLANNING.md)",
                            description="The goodput planner: python -m trainer.plan with these arguments, e.g. "
                                        "plan --run RUN_DIR --gpus 16384 --spares 4 --recommend --chart goodput.png")
    p_plan.add_argument("planner_args", nargs=argparse.REMAINDER, help="the planner's arguments (plan --help)")
    p_plan.set_defaults(func=cmd_plan)
    for name, func, help_text in (("submit", cmd_submit, "start one run"),
                                  ("schedule", cmd_schedule, "create a recurring run")):
        p = sub.add_parser(name, help=help_text, description=f"{help_text.capitalize()} on Kubeflow Pipelines.",
                           epilog=AUTH_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--host", default=os.environ.get("KFP_HOST"),
                       help="KFP API endpoint, e.g. https://kubeflow.example.com/pipeline (default: $KFP_HOST); "
                            "omit it in the cluster")
        p.add_argument("--namespace", default=None,
                       help="Kubeflow profile namespace (multi-user installs; default: in a pod its own "
                            f"namespace, else the one in {KFP_CONTEXT_FILE})")
        p.add_argument("--existing-token", default=None, metavar="TOKEN",
                       help=f"bearer token for --host (default: ${TOKEN_ENV}; prefer the variable)")
        p.add_argument("--cookies", default=None, metavar="COOKIES",
                       help=f"session cookie header for --host, e.g. 'authservice_session=...' (default: ${COOKIES_ENV})")
        p.add_argument("--token-path", default=None,
                       help="in-cluster: the projected Pipelines token file (default: $KF_PIPELINES_SA_TOKEN_PATH "
                            "or /var/run/secrets/kubeflow/pipelines/token)")
        p.add_argument("--kfp-namespace", default=KFP_SYSTEM_NAMESPACE,
                       help="in-cluster: the namespace KFP is installed in (default: kubeflow)")
        group = p.add_mutually_exclusive_group()
        group.add_argument("--experiment", default="resilient-train", help="experiment name (created if missing)")
        group.add_argument("--experiment-id", default=None, help="an existing experiment's id")
        p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="a pipeline parameter")
        p.add_argument("--params-file", default=None, help="JSON object of pipeline parameters")
        p.add_argument("--package", default=None,
                       help="a compiled pipeline.yaml (default: compile now for --param image=...)")
        p.add_argument("--service-account", default=SERVICE_ACCOUNT,
                       help=f"the runs' ServiceAccount (default: {SERVICE_ACCOUNT}, see deploy/README.md)")
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
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:  # every argument goes to the planner (argparse would take its options for ours)
        return cmd_plan(argparse.Namespace(planner_args=argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CliError, ParamError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, KfpUnreachable) else 2


if __name__ == "__main__":
    sys.exit(main())
