"""The launcher's Role grants exactly the API calls the launcher makes: no more, no wildcards, one namespace.

The required permissions are not typed here: the stub API server (tests/launcher/k8s_stub.py) records
every request the launcher makes across its representative scenarios and `launcher_permissions()`
returns them as (apiGroup, resource, verb) triples.
"""
from __future__ import annotations

import importlib
import itertools
import sys

import pytest
from deploy_checks import BACKEND_OF, DEPLOY, OVERLAYS, REPO, render, the

STUB = REPO / "tests" / "launcher" / "k8s_stub.py"
CLUSTER_WIDE = {"ClusterRole", "ClusterRoleBinding"}
RUNS_AS = "default-editor"  # the Kubeflow profile's ServiceAccount that pipeline steps run as
#: What a Kubeflow profile owner holds in the namespace (ClusterRole kubeflow-admin, which aggregates
#: kubeflow-edit: Kubernetes' pods, pods/log, secrets and networkpolicies through kubeflow-kubernetes-edit/view
#: (kubeflow/manifests common/kubeflow-roles), the training-operator's pytorchjobs, Trainer v2's trainjobs), for the
#: resources the launcher touches. Kubernetes lets a user create a
#: Role only with permissions they hold themselves (RBAC escalation check), so the Role must stay inside this.
#: JobSets are not in it: Trainer v2 aggregates no jobsets rule into kubeflow-edit/admin.
PROFILE_OWNER_HOLDS = {
    ("", "pods"): {"get", "list", "watch", "create", "delete", "deletecollection", "patch", "update"},
    ("", "pods/log"): {"get", "list", "watch"},
    ("", "secrets"): {"get", "list", "watch", "create", "delete", "deletecollection", "patch", "update"},
    ("networking.k8s.io", "networkpolicies"): {"get", "list", "watch", "create", "delete", "deletecollection",
                                               "patch", "update"},
    ("kubeflow.org", "pytorchjobs"): {"get", "list", "watch", "create", "delete", "deletecollection", "patch",
                                      "update"},
    ("trainer.kubeflow.org", "trainjobs"): {"get", "list", "watch", "create", "delete", "deletecollection",
                                            "patch", "update"},
}


def derived_permissions(backend: str) -> set[tuple[str, str, str]]:
    if not STUB.is_file():
        pytest.fail(f"{STUB.relative_to(REPO)} is missing: the Role cannot be checked against the launcher",
                    pytrace=False)
    sys.path.insert(0, str(STUB.parent))
    try:
        stub = importlib.import_module(STUB.stem)
    finally:
        sys.path.remove(str(STUB.parent))
    return {tuple(p) for p in stub.launcher_permissions(backend)}


def granted(role: dict) -> list[tuple[str, str, str]]:
    """Every (apiGroup, resource, verb) the Role's rules grant, duplicates kept."""
    triples = []
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, (
            f"rule uses {sorted(set(rule) - {'apiGroups', 'resources', 'verbs'})}: "
            "resourceNames/nonResourceURLs are not expected for the launcher"
        )
        for field in ("apiGroups", "resources", "verbs"):
            assert rule[field], f"rule with empty {field}: {rule}"
            assert not any("*" in value for value in rule[field]), f"wildcard in {field}: {rule}"
        triples += itertools.product(rule["apiGroups"], rule["resources"], rule["verbs"])
    return triples


@pytest.fixture(scope="module")
def launcher_needs() -> dict[str, set[tuple[str, str, str]]]:
    needs = {backend: derived_permissions(backend) for backend in sorted(set(BACKEND_OF.values()))}
    for backend, created in (("pytorchjob", ("kubeflow.org", "pytorchjobs", "create")),
                             ("trainjob", ("trainer.kubeflow.org", "trainjobs", "create"))):
        assert created in needs[backend], f"stub scenarios never created a job: {needs[backend]}"
    return needs


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_role_grants_exactly_what_the_launcher_uses(overlay, launcher_needs):
    launcher_needs = launcher_needs[BACKEND_OF[overlay]]
    objects = render(DEPLOY / "overlays" / overlay)
    assert not [o for o in objects if o["kind"] in CLUSTER_WIDE], "no cluster-wide RBAC may be shipped"
    role = the(objects, "Role", "train-launcher")
    assert role["metadata"].get("namespace"), "the Role must be namespaced"
    triples = granted(role)
    assert len(triples) == len(set(triples)), f"a permission is granted twice: {sorted(triples)}"
    missing = launcher_needs - set(triples)
    extra = set(triples) - launcher_needs
    assert not missing and not extra, (
        f"Role train-launcher differs from the launcher's API calls:\n"
        f"  missing (the launcher would get 403): {sorted(missing)}\n"
        f"  extra (not least privilege): {sorted(extra)}"
    )
    # Only the ServiceAccount the pipeline's steps run as gets it: the profile's default-editor.
    assert [b["subjects"] for b in objects if b["kind"] == "RoleBinding"] == [
        [{"kind": "ServiceAccount", "name": RUNS_AS, "namespace": role["metadata"]["namespace"]}]
    ]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_profile_owner_can_apply_the_role(overlay):
    """Everything under overlays/ is for a namespace admin (a Kubeflow profile owner): the Role may grant only
    what that owner holds, or `kubectl apply` is refused (forbidden: attempting to grant RBAC permissions not
    currently held). What needs more goes under deploy/cluster/ for a cluster admin."""
    role = the(render(DEPLOY / "overlays" / overlay), "Role", "train-launcher")
    beyond = sorted(t for t in granted(role) if t[2] not in PROFILE_OWNER_HOLDS.get(t[:2], set()))
    assert not beyond, f"a profile owner cannot grant {beyond}: read it another way or move it to deploy/cluster/"


def test_runs_are_submitted_as_the_account_the_role_is_bound_to():
    """The CLI, the notebook and the examples submit runs as the ServiceAccount that gets the launcher's
    rights; the kustomization does not create it (the Kubeflow Profile owns default-editor, which already
    has what a KFP v2 step needs)."""
    from pipelines import cli

    assert cli.SERVICE_ACCOUNT == RUNS_AS
    objects = render(DEPLOY / "overlays" / "gpu-cluster")
    assert not [o for o in objects if o["kind"] == "ServiceAccount"], "the profile owns default-editor"
    docs = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "notebooks" / "run_pipeline.ipynb",
            DEPLOY / "examples" / "recurring-run.md")
    for doc in docs:
        text = doc.read_text()
        assert "train-launcher'" not in text and "--service-account train-launcher" not in text, doc


def test_rule_expansion_catches_wildcards_and_extras():
    role = {"rules": [{"apiGroups": [""], "resources": ["pods", "pods/log"], "verbs": ["get", "list"]}]}
    assert sorted(granted(role)) == [("", "pods", "get"), ("", "pods", "list"),
                                     ("", "pods/log", "get"), ("", "pods/log", "list")]
    with pytest.raises(AssertionError, match="wildcard"):
        granted({"rules": [{"apiGroups": ["kubeflow.org"], "resources": ["*"], "verbs": ["get"]}]})
    with pytest.raises(AssertionError, match="resourceNames"):
        granted({"rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"], "resourceNames": ["x"]}]})
