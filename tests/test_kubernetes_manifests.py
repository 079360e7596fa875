"""deploy/kubernetes/: every manifest is valid for Kubernetes and KEDA, and says what the code says.

The Kubernetes objects are checked against the API's own schemas as ``kubernetes-validate`` ships them,
strictly (an unknown field is an error); the KEDA objects against the schemas of KEDA's CRDs as
``@kubernetes-models/keda`` ships them (``tests/keda``, its lock installed with ``npm ci``). Nothing is
fetched from a cluster. Then what the schemas cannot know: a pool and a ScaledObject for each tool's queue
(Redis and RabbitMQ), each pool's grace outlasting the longest task's hard time limit, every role one the
image's command has, every file in its kustomization.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import celeryconfig
from tasks import tools

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
KEDA = Path(__file__).parent / "keda"
KUBERNETES_VERSION = "1.30.0"  # the oldest minor release the manifests are held to (autoscaling/v2, policy/v1)


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifests() -> dict[str, list[dict]]:
    return {str(p.relative_to(KUBE)): documents(p) for p in sorted(KUBE.rglob("*.yaml")) if p.name != "kustomization.yaml"}


def every_object() -> list[tuple[str, dict]]:
    return [(name, doc) for name, docs in manifests().items() for doc in docs]


def kinds(kind: str, under: str = "") -> list[dict]:
    return [doc for name, doc in every_object() if doc["kind"] == kind and name.startswith(under)]


def test_every_kubernetes_object_is_valid_for_the_api_schemas():
    import kubernetes_validate

    checked = 0
    for name, doc in every_object():
        if doc["apiVersion"].startswith("keda.sh/"):
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")
        checked += 1
    assert checked >= 20


def test_the_strict_check_refuses_an_unknown_field():
    """The check above can fail: a misspelt field of a Deployment is refused."""
    import kubernetes_validate

    deployment = json.loads(json.dumps(kinds("Deployment")[0]))
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 30
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.fixture(scope="module")
def keda_check() -> Path:
    """``tests/keda`` with its locked packages installed (``npm ci`` once)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("Node and npm are not installed")
    if not (KEDA / "node_modules" / "@kubernetes-models" / "keda").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=KEDA, check=True, capture_output=True, timeout=300)
    return KEDA / "check.mjs"


def keda_problems(check: Path, objects: list[dict]) -> dict:
    done = subprocess.run(["node", str(check)], input=json.dumps(objects), capture_output=True, text=True, timeout=60)
    assert done.returncode in (0, 1) and done.stdout, done.stderr
    return json.loads(done.stdout)


def test_every_keda_object_is_valid_for_kedas_crd_schemas(keda_check):
    objects = [doc for _, doc in every_object() if doc["apiVersion"].startswith("keda.sh/")]
    assert len(objects) == 2 * (len(tools.names()) + 1)
    assert keda_problems(keda_check, objects) == {}
    wrong = json.loads(json.dumps(objects[0]))
    wrong["spec"]["minReplicaCount"] = "one"
    del wrong["spec"]["scaleTargetRef"]
    assert len(keda_problems(keda_check, [wrong])) == 1  # the check can fail


def _queues_of_registry() -> dict[str, str]:
    return {queue: group for group, queues in tools.worker_groups().items() for queue in queues}


def _worker(deployment: dict) -> dict:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "worker")


def test_each_tool_queue_has_its_own_pool_scaled_alone_on_its_own_queue():
    registry = _queues_of_registry()
    pools = {}
    for deployment in kinds("Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        if labels.get("app.kubernetes.io/component") == "worker":
            args = _worker(deployment)["args"]
            queue = f"tools.{args[1]}" if args[0] == "tool" else args[0]
            pools[deployment["metadata"]["name"]] = queue
            if queue in registry:
                assert labels["voice-tools/group"] == registry[queue], deployment["metadata"]["name"]
    assert sorted(pools.values()) == sorted([*registry, "callbacks"])
    for under, trigger_type, queue_key in (("keda-redis", "redis", "listName"), ("rabbitmq/", "rabbitmq", "queueName")):
        scaled = kinds("ScaledObject", under)
        targets = {s["spec"]["scaleTargetRef"]["name"]: s for s in scaled}
        assert sorted(targets) == sorted(pools), under  # one per pool, none shared
        for target, s in targets.items():
            (trigger,) = s["spec"]["triggers"]
            assert trigger["type"] == trigger_type and trigger["metadata"][queue_key] == pools[target]
            assert 0 <= s["spec"]["minReplicaCount"] <= s["spec"]["maxReplicaCount"], target


def test_a_worker_pods_grace_outlasts_the_longest_tasks_hard_time_limit():
    longest = max([celeryconfig.task_time_limit, *(tools.get(name).time_limit + 10 for name in tools.names())])
    for deployment in kinds("Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        if deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "worker":
            assert spec["terminationGracePeriodSeconds"] >= longest, deployment["metadata"]["name"]


def test_every_role_is_one_the_images_command_runs():
    procfile = dict(line.split(":", 1) for line in (ROOT / "Procfile").read_text().splitlines() if ":" in line)
    script = (ROOT / "deploy" / "image" / "voice-tools-role").read_text()
    own = set(re.findall(r"^    ([a-z-]+)\)$", script, re.M))
    assert {"migrate", "tool", "probe"} <= own
    for kind in ("Deployment", "Job"):
        for workload in kinds(kind):
            for container in workload["spec"]["template"]["spec"]["containers"]:
                role = container["args"][0]
                assert role in procfile or role in own, (workload["metadata"]["name"], role)
                if role == "tool":
                    assert container["args"][1] in tools.names()


def test_every_file_is_in_a_kustomization_and_every_named_file_exists():
    named: set[Path] = set()
    for kustomization in KUBE.rglob("kustomization.yaml"):
        for resource in yaml.safe_load(kustomization.read_text())["resources"]:
            target = (kustomization.parent / resource).resolve()
            assert target.exists(), f"{kustomization}: {resource}"
            named.add(target / "kustomization.yaml" if target.is_dir() else target)
    entries = {(KUBE / "kustomization.yaml").resolve(), (KUBE / "rabbitmq" / "kustomization.yaml").resolve()}  # what kubectl -k takes
    files = {p.resolve() for p in KUBE.rglob("*.yaml")} - entries
    assert files <= named, sorted(str(p) for p in files - named)
