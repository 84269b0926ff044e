"""What the launch step creates beside each job it submits, owned by the job (``ownerReferences``: the garbage
collector deletes both with it): the job's Secret and its NetworkPolicy. That is this module's one concern.

- **Secret** ``<job>-peer-secret`` (`jobsecret.secret_name`): one key, `jobsecret.SECRET_KEY`, 48 random bytes made
  here, immutable. Every pod of the job mounts it read-only at `jobsecret.SECRET_FILE` (``TRAINER_JOB_SECRET_FILE``;
  `components.lib.pytorchjob`, `components.lib.trainjob`), and the trainer signs every exchange of its peer tier with
  it (``trainer/checkpoint/peerauth.py``): only the job's own ranks can read a snapshot from a replica server or
  write one into it. A pod waits for the volume until the Secret exists (created right after the job, whose uid it
  needs), so no rank ever starts without it.
- **NetworkPolicy** ``<job>-peers`` (`jobsecret.policy_name`): selects the job's pods (the label their operator puts
  on every pod of the job) and admits ingress to them only from pods with the same label: the rendezvous store,
  gloo/NCCL, the replica servers; no port is open to any other pod. Egress is not restricted (data, the base model's
  download, the API server).

`ensure` creates both, or adopts them when they exist and are the job's (a launcher that attached to its job);
one left by an earlier job of the same name (the garbage collector not done yet) is deleted and made again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from components.lib.jobsecret import SECRET_KEY, new_secret, policy_name, secret_name

log = logging.getLogger(__name__)

HTTP_NOT_FOUND, HTTP_CONFLICT = 404, 409
RECREATE_TRIES = 5


def owner_reference(job: Mapping[str, Any]) -> k8s.V1OwnerReference:
    """A reference to `job` (as the API server returned it: with its uid) that makes it the owner."""
    meta = job["metadata"]
    return k8s.V1OwnerReference(api_version=job["apiVersion"], kind=job["kind"], name=meta["name"], uid=meta["uid"])


def pod_labels(selector: str) -> dict[str, str]:
    """``a=b,c=d`` -> {a: b, c: d}."""
    return dict(kv.split("=", 1) for kv in selector.split(",") if kv)


def secret_manifest(job: Mapping[str, Any], labels: Mapping[str, str]) -> dict[str, Any]:
    """The job's Secret, with a new secret in it."""
    meta = job["metadata"]
    secret = k8s.V1Secret(
        api_version="v1", kind="Secret", type="Opaque", immutable=True, string_data={SECRET_KEY: new_secret()},
        metadata=k8s.V1ObjectMeta(name=secret_name(meta["name"]), namespace=meta["namespace"], labels=dict(labels),
                                  owner_references=[owner_reference(job)]))
    return k8s.ApiClient().sanitize_for_serialization(secret)


def policy_manifest(job: Mapping[str, Any], labels: Mapping[str, str], pods: Mapping[str, str]) -> dict[str, Any]:
    """The job's NetworkPolicy: ingress to the pods labelled `pods` only from pods labelled `pods`."""
    meta = job["metadata"]
    own = k8s.V1LabelSelector(match_labels=dict(pods))
    policy = k8s.V1NetworkPolicy(
        api_version="networking.k8s.io/v1", kind="NetworkPolicy",
        metadata=k8s.V1ObjectMeta(name=policy_name(meta["name"]), namespace=meta["namespace"], labels=dict(labels),
                                  owner_references=[owner_reference(job)]),
        spec=k8s.V1NetworkPolicySpec(pod_selector=own, policy_types=["Ingress"], ingress=[
            k8s.V1NetworkPolicyIngressRule(_from=[k8s.V1NetworkPolicyPeer(pod_selector=own)])]))
    return k8s.ApiClient().sanitize_for_serialization(policy)


def manifests(job: Mapping[str, Any], labels: Mapping[str, str], pods_selector: str) -> list[dict[str, Any]]:
    """The Secret and the NetworkPolicy for `job` (``pods_selector``: the label selector of all its pods)."""
    return [secret_manifest(job, labels), policy_manifest(job, labels, pod_labels(pods_selector))]


def ensure(core: k8s.CoreV1Api, networking: k8s.NetworkingV1Api, job: Mapping[str, Any], labels: Mapping[str, str],
           pods_selector: str, timeout_s: float, poll_s: float) -> None:
    """Create the job's Secret and NetworkPolicy, or adopt the ones the job owns already; ApiException when the API
    server refuses (the caller deletes the job: its pods would wait for the Secret)."""
    calls: dict[str, tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]] = {
        "Secret": (core.create_namespaced_secret, core.read_namespaced_secret, core.delete_namespaced_secret),
        "NetworkPolicy": (networking.create_namespaced_network_policy, networking.read_namespaced_network_policy,
                          networking.delete_namespaced_network_policy),
    }
    uid = job["metadata"]["uid"]
    for manifest in manifests(job, labels, pods_selector):
        kind, name, namespace = manifest["kind"], manifest["metadata"]["name"], manifest["metadata"]["namespace"]
        create, read, delete = calls[kind]
        for _ in range(RECREATE_TRIES):
            try:
                create(namespace, manifest, _request_timeout=timeout_s)
                log.info("created %s %s/%s, owned by %s %s", kind, namespace, name, job["kind"],
                         job["metadata"]["name"])
                break
            except ApiException as exc:
                if exc.status != HTTP_CONFLICT:
                    raise
            try:
                existing = read(name, namespace, _request_timeout=timeout_s)
            except ApiException as exc:
                if exc.status != HTTP_NOT_FOUND:
                    raise
                continue  # gone meanwhile: create it
            if any(ref.uid == uid for ref in existing.metadata.owner_references or []):
                log.info("%s %s/%s exists and is the job's; kept", kind, namespace, name)
                break
            log.warning("%s %s/%s is left from an earlier job of this name; replacing it", kind, namespace, name)
            try:
                delete(name, namespace, _request_timeout=timeout_s)
            except ApiException as exc:
                if exc.status != HTTP_NOT_FOUND:
                    raise
            time.sleep(poll_s)
        else:
            raise ApiException(status=HTTP_CONFLICT, reason=f"{kind} {namespace}/{name} could not be made the job's "
                                                            f"in {RECREATE_TRIES} tries")
