"""``python -m pipelines.cli``: cron and parameter validation, and the kfp.Client calls (a fake client)."""

import http.server
import logging
import socket
import threading
from types import SimpleNamespace

import kfp
import kfp.client
import pytest

from pipelines import cli
from pipelines.compile import compile_pipeline

IMAGE = "registry.example.com/team/resilient-train:0.1.0"


def test_cron_needs_six_fields_seconds_first():
    assert cli.validate_cron("0 0 3 * * *") == "0 0 3 * * *"
    with pytest.raises(cli.CliError, match="did you mean '0 0 3 \\* \\* \\*'"):
        cli.validate_cron("0 3 * * *")
    with pytest.raises(cli.CliError, match="first field is the second"):
        cli.validate_cron("75 0 3 * * *")
    with pytest.raises(cli.CliError, match="six fields"):
        cli.validate_cron("* * *")


@pytest.mark.parametrize("cron, field", [
    ("0 61 3 * * *", "minute"), ("0 0 25 * * *", "hour"), ("0 0 3 32 * *", "day-of-month"),
    ("0 0 3 0 * *", "day-of-month"), ("0 0 3 * 13 *", "month"), ("0 0 3 * * 7", "day-of-week"),
    ("0 0-61 3 * * *", "minute"), ("0 */5,70 3 * * *", "minute"), ("60 0 3 * * *", "second"),
])
def test_cron_fields_are_range_checked(cron, field):
    with pytest.raises(cli.CliError, match=f"the {field} field.* must be in"):
        cli.validate_cron(cron)


@pytest.mark.parametrize("cron", ["0 */15 * * * *", "0 0 3 1-31 JAN-DEC MON-FRI", "30 59 23 31 12 6",
                                  "0 0 3 * * ?", "0 0,30 8-18/2 * * SUN"])
def test_valid_crons_pass(cron):
    assert cli.validate_cron(cron) == cron
    with pytest.raises(cli.CliError, match="neither a number"):
        cli.validate_cron("0 0 3 * * FUNDAY")


def test_params_are_typed_by_the_pipeline():
    values = cli.parse_params(["steps=2000", "inprocess_restart=false", "min_improvement=0.01",
                               'node_selector={"pool": "h100"}', "faults=0:5:sigkill"])
    assert values == {"steps": 2000, "inprocess_restart": False, "min_improvement": 0.01,
                      "node_selector": {"pool": "h100"}, "faults": "0:5:sigkill"}
    with pytest.raises(cli.CliError, match="unknown parameter 'stpes'"):
        cli.parse_params(["stpes=1"])
    with pytest.raises(cli.CliError, match="not a valid int"):
        cli.parse_params(["steps=many"])


class FakeClient:
    """Stands in for kfp.Client: records the constructor's arguments and the API calls; no network."""

    calls: list = []
    multi_user = False

    def __init__(self, **kwargs):
        self.calls.append(("init", kwargs))
        self._healthz_api = SimpleNamespace(healthz_service_get_healthz=self._healthz)

    def _healthz(self):
        self.calls.append(("healthz",))
        return SimpleNamespace(multi_user=self.multi_user)

    def create_experiment(self, name, namespace=None):
        self.calls.append(("experiment", name))
        return SimpleNamespace(experiment_id="exp-1")

    def create_run_from_pipeline_package(self, pipeline_file, **kw):
        self.calls.append(("run", pipeline_file, kw))
        return SimpleNamespace(run_id="run-1")

    def create_recurring_run(self, **kw):
        self.calls.append(("recurring", kw))
        return SimpleNamespace(recurring_run_id="rr-1")


@pytest.fixture(autouse=True)
def no_kfp_context(monkeypatch, tmp_path):
    """No test reads the machine's own kfp context (~/.config/kfp/context.json)."""
    monkeypatch.setattr(cli, "KFP_CONTEXT_FILE", str(tmp_path / "kfp-context.json"), raising=False)


@pytest.fixture
def fake_client(monkeypatch):
    FakeClient.calls = []
    FakeClient.multi_user = False
    monkeypatch.setattr(kfp, "Client", FakeClient)
    for name in ("KFP_HOST", cli.TOKEN_ENV, cli.COOKIES_ENV, cli.IN_CLUSTER_ENV, kfp.client.KF_PIPELINES_SA_TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)
    return FakeClient.calls


def client_kwargs(calls) -> dict:
    (kwargs,) = [c[1] for c in calls if c[0] == "init"]
    return kwargs


def test_submit_validates_then_submits(fake_client, capsys):
    assert cli.main(["submit", "--host", "http://kfp", "--param", "steps=10", "--param",
                     "checkpoint_interval=20", "--param", f"image={IMAGE}"]) == 2
    assert "steps (10) must be greater than checkpoint_interval (20)" in capsys.readouterr().err
    assert fake_client == []  # nothing reached the cluster
    assert cli.main(["submit", "--host", "http://kfp", "--experiment", "e", "--param", "steps=100",
                     "--param", f"image={IMAGE}"]) == 0
    (_, pkg, kw) = next(c for c in fake_client if c[0] == "run")
    assert pkg.endswith("pipeline.yaml") and kw["arguments"] == {"steps": 100, "image": IMAGE}
    assert kw["experiment_id"] == "exp-1" and kw["service_account"] == "default-editor"


def test_submit_without_an_image_says_how_to_give_one(fake_client, capsys):
    assert cli.main(["submit", "--host", "http://kfp"]) == 2
    assert "image must name the trainer image" in capsys.readouterr().err and fake_client == []


def test_a_compiled_package_supplies_its_image(fake_client, tmp_path):
    package = compile_pipeline(tmp_path / "p.yaml", image=IMAGE, version="0.0.0+test")
    assert cli.package_defaults(str(package))["image"] == IMAGE
    assert cli.main(["submit", "--host", "http://kfp", "--package", str(package), "--param", "steps=100"]) == 0
    (_, pkg, kw) = next(c for c in fake_client if c[0] == "run")
    assert pkg == str(package) and kw["arguments"] == {"steps": 100}


def test_schedule_creates_a_recurring_run(fake_client):
    assert cli.main(["schedule", "--host", "http://kfp", "--experiment", "nightly", "--cron", "0 0 3 * * *",
                     "--name", "nightly-train", "--param", "init_from=promoted", "--param", f"image={IMAGE}"]) == 0
    (_, kw) = next(c for c in fake_client if c[0] == "recurring")
    assert kw["cron_expression"] == "0 0 3 * * *" and kw["job_name"] == "nightly-train"
    assert kw["max_concurrency"] == 1 and kw["no_catchup"] is True
    assert kw["params"] == {"init_from": "promoted", "image": IMAGE}
    assert kw["experiment_id"] == "exp-1"


# --- authentication: the arguments kfp.Client gets, checked with KFP's own credential classes -------------

def bearer(kwargs: dict) -> str:
    """The Authorization header the real kfp.Client sends with these arguments (built offline: a namespace
    is given, so the constructor makes no request; the header is computed as before every request)."""
    with pytest.warns(FutureWarning):
        client = kfp.client.Client(**kwargs)
    return client._existing_config.get_api_key_with_prefix("authorization")


def submit(*extra: str) -> int:
    return cli.main(["submit", "--namespace", "team-a", "--param", f"image={IMAGE}", *extra])


def test_in_cluster_without_host_uses_the_pods_pipelines_token(fake_client, monkeypatch, tmp_path):
    token = tmp_path / "token"
    token.write_text("projected-sa-token\n")
    monkeypatch.setenv(cli.IN_CLUSTER_ENV, "10.0.0.1")
    monkeypatch.setenv(kfp.client.KF_PIPELINES_SA_TOKEN_ENV, str(token))
    assert submit() == 0
    kwargs = client_kwargs(fake_client)
    assert kwargs["host"] == "http://ml-pipeline.kubeflow.svc.cluster.local:8888"
    assert kwargs["namespace"] == "team-a" and "existing_token" not in kwargs
    credentials = kwargs["credentials"]
    assert isinstance(credentials, kfp.client.ServiceAccountTokenVolumeCredentials)
    assert bearer(kwargs) == "Bearer projected-sa-token"
    # another token file and another KFP namespace
    other = tmp_path / "other"
    other.write_text("t2")
    fake_client.clear()
    assert submit("--token-path", str(other), "--kfp-namespace", "kfp") == 0
    kwargs = client_kwargs(fake_client)
    assert kwargs["host"] == "http://ml-pipeline.kfp.svc.cluster.local:8888"
    assert bearer(kwargs) == "Bearer t2"


def test_in_cluster_without_a_mounted_token_says_what_to_enable(fake_client, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(cli.IN_CLUSTER_ENV, "10.0.0.1")
    assert submit("--token-path", str(tmp_path / "missing")) == 2
    err = capsys.readouterr().err
    assert "Allow access to Kubeflow Pipelines" in err and str(tmp_path / "missing") in err
    assert fake_client == []


def test_laptop_token_and_cookies(fake_client, monkeypatch, capsys):
    monkeypatch.setenv(cli.TOKEN_ENV, "tok-from-env")
    assert submit("--host", "https://kf.example.com/pipeline") == 0
    kwargs = client_kwargs(fake_client)
    assert kwargs == {"host": "https://kf.example.com/pipeline", "existing_token": "tok-from-env",
                      "namespace": "team-a"}
    assert bearer(kwargs) == "Bearer tok-from-env"
    monkeypatch.delenv(cli.TOKEN_ENV)
    fake_client.clear()
    assert submit("--host", "https://kf.example.com/pipeline", "--cookies", "authservice_session=abc") == 0
    assert client_kwargs(fake_client)["cookies"] == "authservice_session=abc"
    fake_client.clear()
    assert submit("--host", "https://kf", "--cookies", "a=b", "--existing-token", "t") == 2
    assert "not both" in capsys.readouterr().err


def test_no_host_outside_a_cluster_asks_for_one(fake_client, capsys):
    assert submit() == 2
    assert "pass --host" in capsys.readouterr().err
    assert submit("--existing-token", "t") == 2
    assert "need --host" in capsys.readouterr().err
    assert fake_client == []


def test_help_explains_both_ways_to_authenticate(capsys):
    with pytest.raises(SystemExit):
        cli.main(["submit", "--help"])
    out = capsys.readouterr().out
    for needle in ("in the cluster", "ServiceAccountTokenVolumeCredentials", "Allow access to Kubeflow Pipelines",
                   "from a laptop", "KFP_TOKEN", "--existing-token", "KFP_COOKIES", "create token default-editor"):
        assert needle in out, needle


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_host_is_one_clear_line(monkeypatch, capsys):
    for name in ("KFP_HOST", cli.TOKEN_ENV, cli.COOKIES_ENV):
        monkeypatch.delenv(name, raising=False)
    host = f"http://127.0.0.1:{closed_port()}"
    assert cli.main(["schedule", "--host", host, "--namespace", "team-a", "--cron", "0 0 3 * * *",
                     "--name", "n", "--param", f"image={IMAGE}"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"cannot reach Kubeflow Pipelines at {host}" in err and "check the URL" in err


def test_schedule_rejects_a_unix_cron_before_connecting(fake_client, capsys):
    assert cli.main(["schedule", "--host", "http://kfp", "--cron", "0 3 * * *", "--name", "n"]) == 2
    assert fake_client == [] and "six" in capsys.readouterr().err


class Refusing(http.server.BaseHTTPRequestHandler):
    """A KFP API that answers every request 401, as Kubeflow's gateway does without valid credentials."""

    def _refuse(self):
        self.send_response(401, "Unauthorized")
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "unauthorized"}')

    do_GET = do_POST = _refuse

    def log_message(self, *args):
        pass


def test_refused_credentials_are_one_clear_line(monkeypatch, capsys):
    for name in ("KFP_HOST", cli.COOKIES_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(cli.TOKEN_ENV, "expired-token")
    server = http.server.HTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host = f"http://127.0.0.1:{server.server_port}"
    try:
        assert cli.main(["submit", "--host", host, "--namespace", "team-a", "--param", f"image={IMAGE}"]) == 1
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "401: the token was refused" in err and host in err and "KFP_TOKEN" in err


class CountingRefuser(Refusing):
    requests: list = []

    def _refuse(self):
        self.requests.append(self.path)
        super()._refuse()

    do_GET = do_POST = _refuse


def test_a_refused_token_without_a_namespace_is_one_probe_and_one_line(monkeypatch, capsys, caplog):
    """No --namespace, nothing says which: kfp.Client would check the server's health 5 times, 5 s apart,
    logging a traceback each, then report a TimeoutError as 'cannot reach'. One probe, one line, kfp quiet."""
    for name in ("KFP_HOST", cli.COOKIES_ENV, cli.IN_CLUSTER_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(cli.TOKEN_ENV, "expired-token")
    CountingRefuser.requests = []
    server = http.server.HTTPServer(("127.0.0.1", 0), CountingRefuser)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host = f"http://127.0.0.1:{server.server_port}"
    caplog.set_level(logging.DEBUG)
    try:
        assert cli.main(["submit", "--host", host, "--param", f"image={IMAGE}"]) == 1
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: 401: the token was refused") and "cannot reach" not in err, err
    assert CountingRefuser.requests == ["/apis/v2beta1/healthz"]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_namespace_comes_from_the_pod_then_the_kfp_context(fake_client, monkeypatch, tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text("t")
    monkeypatch.setenv(kfp.client.KF_PIPELINES_SA_TOKEN_ENV, str(token))
    monkeypatch.setenv(cli.IN_CLUSTER_ENV, "10.0.0.1")
    sa_namespace = tmp_path / "namespace"
    sa_namespace.write_text("team-pod\n")
    monkeypatch.setattr(cli, "SA_NAMESPACE_FILE", sa_namespace)
    context = tmp_path / "kfp-context.json"
    context.write_text('{"namespace": "team-context"}')
    assert cli.main(["submit", "--param", f"image={IMAGE}"]) == 0
    assert client_kwargs(fake_client)["namespace"] == "team-pod"
    assert next(c for c in fake_client if c[0] == "run")[2]["namespace"] == "team-pod"
    assert "namespace team-pod (from the pod's ServiceAccount namespace" in capsys.readouterr().out
    fake_client.clear()
    monkeypatch.delenv(cli.IN_CLUSTER_ENV)
    assert cli.main(["submit", "--host", "http://kfp", "--param", f"image={IMAGE}"]) == 0
    assert client_kwargs(fake_client)["namespace"] == "team-context"
    fake_client.clear()
    assert cli.main(["submit", "--host", "http://kfp", "--namespace", "mine", "--param", f"image={IMAGE}"]) == 0
    assert client_kwargs(fake_client)["namespace"] == "mine"
    assert [c for c in fake_client if c[0] == "healthz"] == [("healthz",)]  # one probe, with the credentials


def test_multi_user_kfp_without_any_namespace_asks_for_one(fake_client, capsys):
    FakeClient.multi_user = True
    assert cli.main(["submit", "--host", "http://kfp", "--param", f"image={IMAGE}"]) == 2
    err = capsys.readouterr().err
    assert "multi-user" in err and "pass --namespace" in err, err
    assert not [c for c in fake_client if c[0] == "run"]
    FakeClient.multi_user = False  # a standalone KFP: no namespace needed
    assert cli.main(["submit", "--host", "http://kfp", "--param", f"image={IMAGE}"]) == 0


def test_a_step_pull_secret_for_a_package_compiled_without_one_is_refused_before_submitting(fake_client, tmp_path,
                                                                                             capsys):
    package = compile_pipeline(tmp_path / "p.yaml", image=IMAGE, version="0.0.0+test")
    assert cli.main(["submit", "--host", "http://kfp", "--package", str(package),
                     "--param", "step_image_pull_secret=ghcr-cred"]) == 2
    assert "compiled without --image-pull-secret" in capsys.readouterr().err and fake_client == []
    package = compile_pipeline(tmp_path / "q.yaml", image=IMAGE, image_pull_secrets=["regcred"], version="0.0.0+t")
    assert cli.main(["submit", "--host", "http://kfp", "--package", str(package),
                     "--param", "step_image_pull_secret=ghcr-cred"]) == 0
