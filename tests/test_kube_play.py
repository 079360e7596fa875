"""deploy/kubernetes played with ``podman kube play``, then rolled from one build of the image to the next.

The kustomization is rendered as ``kubectl kustomize`` renders it (``tests/kustomize_render.py``; compared
with kubectl's own rendering in ``tests/test_kustomize_render.py`` where kubectl is installed) from an
overlay of this test, as an operator's would be: the shipped ``deploy/kubernetes`` with its ConfigMap's
settings set in ``base/config.yaml`` (as docs/operations.md says), the Secret ``voice-tools-secrets`` beside
it, ``images:`` naming the image built here from the repository's Dockerfile (the stand-ins of
``tests/container_images.py`` for PostgreSQL and Redis run beside the pods, as the cluster's own would), and
a ``nameSuffix`` of this run so that two runs never share a pod, a secret or a volume.

What podman 4.3 (Debian bookworm's) does not do, the test does as the cluster would, and here is each:

- **Secret and Job are not kinds it plays** (it plays Pod, Deployment, PersistentVolumeClaim, ConfigMap).
  The Secret is made a podman secret whose content is the Secret's ``data`` as JSON, which is what 4.3's
  ``envFrom.secretRef`` reads (4.4 and later make it from the Secret itself). The migration Job's pod
  template is played as a Pod (``restartPolicy: OnFailure`` as written), and its container's exit 0 is
  the Job's completion, which the Deployments wait for as ``kubectl wait`` does.
- **A Deployment's replicas share their emptyDir volumes** (4.3 makes each a named volume of the volume's
  name, shared by every pod that names it) **and every containerPort is published on the host**. So the
  test is the ReplicaSet: each replica is played as the Pod its template makes, named after the
  Deployment, with its emptyDirs its own and no host ports; the pods are reached at their own addresses on
  this run's network, as a Service reaches them.
- **No probes, preStop or grace run here** (no systemd for its health checks; preStop and
  ``terminationGracePeriodSeconds`` are not read). The test is the kubelet: it runs each container's
  startup or readiness probe as written (``exec`` in the container, ``httpGet`` at the pod's address), puts
  a pod in the Service's endpoints only once it passes, and stops a pod by taking it out of the endpoints,
  running its preStop, then one SIGTERM to each container (``podman kill``), the pod's own grace, SIGKILL
  for any container still running, then ``podman pod stop``. Not ``podman stop``, whose 4.3 is no kubelet
  (each seen here): it sends the signal twice; given several containers it keeps to their own 10 s
  instead of ``-t``; and it can take the pod's network away while a container still stops (the worker's
  namespace left with ``lo`` alone, its close waiting on Redis until SIGKILL, and a message its last
  ``BRPOP`` took lost with it, as with a worker host gone dark). So a Deployment's ``restartPolicy:
  Always`` is played as ``Never``: 4.3 would start again a container ended by ``podman kill``, which the
  kubelet never does to a pod it terminates (a container that crashes here stays down, and the test fails).
- Services, HPA, PDBs, the NetworkPolicy and KEDA's ScaledObjects need a cluster: they are validated
  against their schemas in ``tests/test_kubernetes_manifests.py``, not played.

The pods played: the Deployments the relay's flow passes through (web, MCP, the send_email pool, the
callbacks pool) and beat, each with its replicas as written. Then the flow (a call over REST and over
MCP, a checkpoint and a resume, every callback verified with ``standardwebhooks``), and the upgrade of
docs/operations.md ("Upgrading", "Kubernetes"): the image built again with a label of its own (the same tree,
another image id), set by the overlay's ``images:``, the migration Job run with it, then web and MCP, then
the worker pools with a warm stop, then beat, one pod at a time (``maxSurge: 1``, ``maxUnavailable: 0``),
with relays' calls going on all along: every call COMPLETED, one outbox row each, every callback verified,
no 5xx and no refused connection seen by a relay, each old worker ended by its warm shutdown.

Marked ``slow`` and ``containers``: the README's quick run leaves it out, the full suite and CI run it.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml

from support.relay import Relay
from tests import container_images as images
from tests import kustomize_render

pytestmark = [pytest.mark.slow, pytest.mark.containers]

ROOT = Path(__file__).resolve().parents[1]
RUN = f"vtk{os.getpid()}"  # every pod, container, network, secret and volume of this run has it in its name
NETWORK = f"{RUN}-net"
NEXT = "localhost/voice-tools:test-next"
TOKEN = secrets.token_urlsafe(24)
CALLBACK_SECRET = secrets.token_hex(24)
WEBHOOK_SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
PLAYED = ("voice-tools-web", "voice-tools-mcp", "voice-tools-send-email", "voice-tools-callbacks", "voice-tools-beat")


def _overlay(folder: Path, image: str, gateway: str, password: str) -> Path:
    """The operator's overlay: the shipped manifests with the settings and image of this machine."""
    shutil.copytree(ROOT / "deploy" / "kubernetes", folder / "kubernetes", dirs_exist_ok=True)
    config_file = folder / "kubernetes" / "base" / "config.yaml"
    docs = [d for d in yaml.safe_load_all(config_file.read_text()) if d]
    docs[0]["data"].update(VOICE_TOOLS_CALLBACK_HOSTS=gateway, VOICE_TOOLS_PUBLIC_URL="http://voice-tools.test")
    config_file.write_text(yaml.safe_dump_all(docs))
    data = {
        "DATABASE_URL": f"postgresql://voice_tools:{password}@postgres:5432/voice_tools",
        "VOICE_TOOLS_API_TOKENS": f"relay:{TOKEN}",
        "VOICE_TOOLS_CALLBACK_SECRET": CALLBACK_SECRET,
        "VOICE_TOOLS_CALLBACK_SECRETS": WEBHOOK_SECRET,
        "FLOWER_BASIC_AUTH": f"admin:{secrets.token_hex(8)}",
    }
    (folder / "secret.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "voice-tools-secrets"}, "type": "Opaque",
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}))
    name, tag = image.rsplit(":", 1)
    (folder / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["kubernetes", "secret.yaml"], "nameSuffix": f"-{RUN}",
        "images": [{"name": "registry.example.com/voice-tools", "newName": name, "newTag": tag}]}))
    return folder


def _named(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == f"{name}-{RUN}"]
    assert len(found) == 1, (kind, name, [o["metadata"]["name"] for o in objects if o["kind"] == kind])
    return found[0]


class Pod:
    """A pod played from a template, as a ReplicaSet's (or a Job's) pod is made from it."""

    def __init__(self, name: str, template: dict, restart: str | None = None):
        spec = json.loads(json.dumps(template["spec"]))
        self.name, self.grace = name, int(spec.get("terminationGracePeriodSeconds", 30))
        self.probes: list[tuple[str, dict]] = []
        self.pre_stop: list[tuple[str, list[str]]] = []
        self.volumes = []
        for volume in spec.get("volumes") or []:  # this pod's own, as a cluster's emptyDir is
            own = f"{name}-{volume['name']}"
            self.volumes.append(own)
            for container in spec["containers"]:
                for mount in container.get("volumeMounts") or []:
                    if mount["name"] == volume["name"]:
                        mount["name"] = own
            volume["name"] = own
        for container in spec["containers"]:
            ports = {p["name"]: p["containerPort"] for p in container.pop("ports", []) if "name" in p}
            probe = container.pop("readinessProbe", None) or container.get("startupProbe")
            container.pop("startupProbe", None)
            container.pop("livenessProbe", None)
            if probe:
                if "httpGet" in probe:
                    port = probe["httpGet"]["port"]
                    probe = {"httpGet": {**probe["httpGet"], "port": ports.get(port, port)}}
                self.probes.append((container["name"], probe))
            hook = container.pop("lifecycle", {}).get("preStop")
            if hook:
                self.pre_stop.append((container["name"], hook["exec"]["command"]))
        # a Deployment's Always is played as Never: podman 4.3 starts again a container its ``podman kill``
        # ended (any, with Always; one that ends other than 0, as uvicorn re-raising SIGTERM does, with
        # OnFailure), which the kubelet never does to a pod it terminates; a container that crashes here
        # stays down, and the test fails
        spec["restartPolicy"] = restart or ("Never" if spec.get("restartPolicy", "Always") == "Always"
                                            else spec["restartPolicy"])
        self.manifest = {"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": name, "labels": template["metadata"].get("labels", {})}, "spec": spec}
        self.ip = ""

    def container(self, name: str) -> str:
        return f"{self.name}-{name}"

    def play(self, folder: Path, config_map: dict) -> "Pod":
        path = folder / f"{self.name}.yaml"
        path.write_text(yaml.safe_dump_all([config_map, self.manifest]))
        images.podman("kube", "play", "--network", NETWORK, str(path), timeout=300)
        infra = images.podman("pod", "inspect", "--format", "{{.InfraContainerID}}", self.name).stdout.strip()
        self.ip = images.podman("inspect", "--format", f'{{{{(index .NetworkSettings.Networks "{NETWORK}").IPAddress}}}}',
                                infra).stdout.strip()
        assert ipaddress.ip_address(self.ip), self.ip
        return self

    def probe_once(self) -> bool:
        for container, probe in self.probes:
            if "exec" in probe:
                # the kubelet's exec probe sees the container's environment, HOSTNAME (the pod's name) with it;
                # podman exec leaves HOSTNAME out
                done = images.podman("exec", "--env", f"HOSTNAME={self.name}", self.container(container),
                                     *probe["exec"]["command"], check=False, timeout=120)
                if done.returncode != 0:
                    return False
            else:
                get = probe["httpGet"]
                try:
                    if requests.get(f"http://{self.ip}:{get['port']}{get['path']}", timeout=10).status_code >= 400:
                        return False
                except requests.RequestException:
                    return False
        return True

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not self.probe_once():
            assert time.monotonic() < deadline, f"{self.name} never passed its probes:\n{self.logs()}"
            time.sleep(1)

    def logs(self) -> str:
        out = []
        for container in self.manifest["spec"]["containers"]:
            done = images.podman("logs", self.container(container["name"]), check=False)
            out.append(f"--- {container['name']}\n{(done.stdout + done.stderr)[-4000:]}")
        return "\n".join(out)

    def state(self, container: str) -> str:
        return images.podman("inspect", "--format", "exit {{.State.ExitCode}}, restarts {{.RestartCount}}, "
                             "started {{.State.StartedAt}}, finished {{.State.FinishedAt}}",
                             self.container(container), check=False).stdout.strip()

    def stop(self, kept: Path) -> dict[str, int]:
        """As the kubelet stops a pod: each preStop, then one SIGTERM to each container, the pod's grace for
        them all to exit, SIGKILL for any still running, then the sandbox. The exit code of each container.

        Each container's state and whole log are kept in ``kept``, for a failure's report."""
        names = [c["name"] for c in self.manifest["spec"]["containers"]]
        for container, command in self.pre_stop:
            done = images.podman("exec", "--env", f"HOSTNAME={self.name}", self.container(container), *command,
                                 check=False, timeout=60)
            (kept / f"{self.name}-{container}.prestop").write_text(f"exit {done.returncode}\n{done.stdout}{done.stderr}")
        # not ``podman stop`` (the module's docstring: two SIGTERMs, 10 s, the pod's network taken away)
        for name in names:
            images.podman("kill", "--signal", "TERM", self.container(name))
        deadline = time.monotonic() + self.grace
        exits: dict[str, int] = {}
        for name in names:
            left = max(1.0, deadline - time.monotonic())
            try:
                exits[name] = int(images.podman("wait", self.container(name), timeout=left).stdout.split()[0])
            except subprocess.TimeoutExpired:
                images.podman("kill", "--signal", "KILL", self.container(name), check=False)
                exits[name] = int(images.podman("wait", self.container(name), timeout=60).stdout.split()[0])
        states = {name: self.state(name) for name in names}
        images.podman("pod", "stop", "-t", "10", self.name, timeout=120)
        for name in names:
            done = images.podman("logs", "-t", self.container(name), check=False)
            (kept / f"{self.name}-{name}.log").write_text(
                f"exit {exits[name]}; as it exited: {states[name]}\n{done.stdout}{done.stderr}")
        return exits

    def remove(self) -> None:
        images.podman("pod", "rm", "-f", "-t", "0", self.name, check=False, timeout=120)
        for volume in self.volumes:
            images.podman("volume", "rm", "-f", volume, check=False)


class Service:
    """A Service's endpoints: the ready pods of a Deployment, each request to the next of them."""

    def __init__(self, port: int):
        self.port, self.pods, self._turn, self._lock = port, [], 0, threading.Lock()

    def url(self) -> str:
        with self._lock:
            assert self.pods, "no endpoint"
            self._turn += 1
            return f"http://{self.pods[self._turn % len(self.pods)].ip}:{self.port}"

    def add(self, pod: Pod) -> None:
        with self._lock:
            self.pods.append(pod)

    def take_out(self, pod: Pod) -> None:
        with self._lock:
            self.pods.remove(pod)


class Cluster:
    def __init__(self, folder: Path, gateway: str, password: str):
        self.folder, self.gateway, self.password = folder, gateway, password
        self.pods: dict[str, list[Pod]] = {}
        self.everything: list[Pod] = []
        self.secret_names: list[str] = []
        self.services = {"voice-tools-web": Service(8000), "voice-tools-mcp": Service(8001)}
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"Bearer {TOKEN}"
        self.http.trust_env = False
        self.statuses: list[int] = []  # every answer the relays saw
        self.refused: list[str] = []
        self.relay: Relay | None = None
        self.revision = 0
        self.kept = folder / "logs"  # each pod's containers: their logs (and, stopped, their states)
        self.kept.mkdir(parents=True, exist_ok=True)

    def render(self, image: str) -> list[dict]:
        overlay = _overlay(self.folder / f"overlay-{self.revision}", image, self.gateway, self.password)
        return kustomize_render.render(overlay)

    def apply_secret(self, objects: list[dict]) -> None:
        secret = _named(objects, "Secret", "voice-tools-secrets")
        name = secret["metadata"]["name"]
        if name in self.secret_names:
            return
        path = self.folder / f"{name}.json"
        path.write_text(json.dumps(secret["data"]))
        images.podman("secret", "create", name, str(path))
        path.unlink()
        self.secret_names.append(name)

    def migrate(self, objects: list[dict]) -> None:
        job = _named(objects, "Job", "voice-tools-migrate")
        pod = Pod(f"{job['metadata']['name']}-r{self.revision}", job["spec"]["template"])
        self.everything.append(pod)
        pod.play(self.folder, _named(objects, "ConfigMap", "voice-tools-config"))
        exited = images.podman("wait", pod.container("migrate"), timeout=600).stdout.strip()
        assert exited == "0", pod.logs()
        pod.remove()

    def start(self, objects: list[dict], deployment: str, index: int) -> Pod:
        found = _named(objects, "Deployment", deployment)
        pod = Pod(f"{found['metadata']['name']}-r{self.revision}-{index}", found["spec"]["template"])
        self.everything.append(pod)
        return pod.play(self.folder, _named(objects, "ConfigMap", "voice-tools-config"))

    def bring_up(self, objects: list[dict]) -> None:
        started = []
        for deployment in PLAYED:
            replicas = _named(objects, "Deployment", deployment)["spec"].get("replicas", 1)
            for index in range(replicas):
                started.append((deployment, self.start(objects, deployment, index)))
        for deployment, pod in started:
            pod.wait_ready()
            self.pods.setdefault(deployment, []).append(pod)
            if deployment in self.services:
                self.services[deployment].add(pod)

    def roll(self, objects: list[dict], deployment: str) -> list[tuple[str, dict[str, int]]]:
        """maxSurge 1, maxUnavailable 0: a new pod ready, then an old one out of the endpoints and stopped."""
        print(f"{time.strftime('%H:%M:%S')} rolling {deployment}", file=sys.stderr, flush=True)
        strategy = _named(objects, "Deployment", deployment)["spec"]["strategy"]["rollingUpdate"]
        assert (strategy["maxSurge"], strategy["maxUnavailable"]) == (1, 0), strategy
        exits, old = [], list(self.pods[deployment])
        for index, previous in enumerate(old):
            pod = self.start(objects, deployment, index)
            pod.wait_ready()
            self.pods[deployment].append(pod)
            service = self.services.get(deployment)
            if service:
                service.add(pod)
                service.take_out(previous)
            print(f"{time.strftime('%H:%M:%S')} {pod.name} ready; stopping {previous.name}", file=sys.stderr, flush=True)
            exits.append((previous.name, previous.stop(self.kept)))
            self.pods[deployment].remove(previous)
            previous.remove()
        return exits

    def request(self, service: str, method: str, path: str, **kw) -> requests.Response:
        url = self.services[service].url()
        try:
            answer = self.http.request(method, f"{url}{path}", timeout=90, **kw)
        except requests.ConnectionError as exc:
            self.refused.append(f"{method} {url}{path}: {exc!r}"[:500])
            raise
        self.statuses.append(answer.status_code)
        return answer

    def call(self, method: str, path: str, expect: tuple[int, ...] = (200,), **kw) -> dict:
        answer = self.request("voice-tools-web", method, path, **kw)
        assert answer.status_code in expect, (method, path, answer.status_code, answer.text[:2000])
        return answer.json()

    def mcp(self, name: str, arguments: dict) -> dict:
        asked = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name, "arguments": arguments}}
        answer = self.request("voice-tools-mcp", "POST", "/mcp", json=asked,
                              headers={"Accept": "application/json, text/event-stream"})
        assert answer.status_code == 200, answer.text[:2000]
        result = answer.json()["result"]
        assert not result.get("isError"), result
        return result.get("structuredContent") or json.loads(result["content"][0]["text"])

    def broker_state(self) -> str:
        """The Redis transport's queues and unacknowledged messages, for a failure's report."""
        script = "for q in tools.send_email callbacks maintenance; do echo \"$q $(redis-cli llen $q)\"; done; " \
                 "echo \"unacked $(redis-cli hlen unacked)\""
        return images.podman("exec", f"{RUN}-redis", "sh", "-c", script, check=False).stdout.replace("\n", "; ")

    def psql(self, sql: str) -> str:
        return images.podman("exec", f"{RUN}-postgres", "psql", "-U", "voice_tools", "-d", "voice_tools", "-At",
                             "-c", sql).stdout.strip()

    def teardown(self) -> None:
        for pod in self.everything:
            for container in pod.manifest["spec"]["containers"]:  # the pods still there: their logs kept too
                done = images.podman("logs", "-t", pod.container(container["name"]), check=False)
                if done.returncode == 0:
                    (self.kept / f"{pod.name}-{container['name']}.log").write_text(done.stdout + done.stderr)
            pod.remove()
        for name in self.secret_names:
            images.podman("secret", "rm", name, check=False)
        for name in ("postgres", "redis"):
            images.podman("rm", "-f", "-t", "0", f"{RUN}-{name}", check=False, timeout=120)
        images.podman("network", "rm", "-f", NETWORK, check=False)


def _gateway() -> str:
    images.podman("network", "create", NETWORK)
    found = json.loads(images.podman("network", "inspect", NETWORK).stdout)[0]
    ranges = [r for plugin in found.get("plugins", []) for rs in plugin.get("ipam", {}).get("ranges", []) for r in rs]
    gateway = found.get("subnets", [{}])[0].get("gateway") if found.get("subnets") else ranges[0]["gateway"]
    assert ipaddress.ip_address(gateway).is_private, gateway
    return gateway


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = images.usable()
    if why:
        pytest.skip(why)
    if shutil.which("catatonit") is None:
        pytest.skip("catatonit is not installed (podman's pods need it for their infra container: apt-get install catatonit)")
    images.base()
    built = {"postgres": images.postgres(), "redis": images.redis(), "project": images.project()}
    folder = tmp_path_factory.mktemp("kube")
    password = secrets.token_hex(16)
    started = time.monotonic()
    c = Cluster(folder, "", password)
    try:
        c.gateway = _gateway()
        images.podman("run", "-d", "--name", f"{RUN}-postgres", "--network", NETWORK, "--network-alias", "postgres",
                      "-e", f"POSTGRES_PASSWORD={password}", "-e", "POSTGRES_USER=voice_tools", "-e",
                      "POSTGRES_DB=voice_tools", built["postgres"])
        images.podman("run", "-d", "--name", f"{RUN}-redis", "--network", NETWORK, "--network-alias", "redis",
                      built["redis"])
        objects = c.render(built["project"])
        c.apply_secret(objects)
        images.timings["kube images"] = time.monotonic() - started
        c.migrate(objects)  # its role waits for the database to come up
        images.timings["kube migrated"] = time.monotonic() - started
        c.bring_up(objects)
        images.timings["kube pods ready"] = time.monotonic() - started
        # the network's bridge has its gateway address once a container is on it: the relay listens there
        with Relay(CALLBACK_SECRET, webhook_secrets=[WEBHOOK_SECRET], host=c.gateway) as relay:
            c.relay = relay
            yield c
    finally:
        print("kube play timings (s):", {k: round(v, 1) for k, v in images.timings.items()})
        c.teardown()


def _verified(relay: Relay, *tool_call_ids: str) -> dict[str, list[str]]:
    """Every event of the calls verified with the standardwebhooks library itself; their names in order."""
    from standardwebhooks import Webhook

    hook = Webhook(WEBHOOK_SECRET)
    names: dict[str, list[str]] = {call_id: [] for call_id in tool_call_ids}
    with relay._lock:
        triples = list(zip(relay.events, relay.headers, relay.bodies))
    for event, headers, body in triples:
        if event["tool_call_id"] in names:
            assert hook.verify(body, {k.lower(): v for k, v in headers.items()}) == event
            names[event["tool_call_id"]].append(event["event"])
    assert relay.bad_signatures == 0
    return names


def _email_flow(c: Cluster, session: str) -> str:
    """A relay's call through a checkpoint: pending, confirm, the checkpoint's callback, resume to the end."""
    created = c.call("POST", "/voice-tools/pending", (201,), json={
        "session_id": session, "function": "send_email", "callback_url": c.relay.url,
        "parameters": {"to": "john.smith@example.com", "subject": "Kubernetes", "body": "Sent from a pod."}})
    call_id = created["tool_call_id"]
    c.call("POST", f"/voice-tools/confirm/{call_id}", (202,), json={"callback_url": c.relay.url})
    try:
        assert c.relay.wait_for(call_id, "checkpoint", timeout=120)["preview"]
    except AssertionError as exc:
        raise AssertionError(f"{exc} at {time.strftime('%H:%M:%S')}; the call: {c.call('GET', f'/voice-tools/status/{call_id}')}; "
                             f"the broker: {c.broker_state()}") from None
    # 200 with the call's end, or 202 when the wait ran out first: then its status is read until it ends
    resumed = c.call("POST", f"/voice-tools/resume/{call_id}?wait=30", (200, 202), json={"action": "proceed"})
    deadline = time.monotonic() + 180
    while resumed["status"] not in ("COMPLETED", "FAILED", "CANCELLED"):
        assert time.monotonic() < deadline, resumed
        time.sleep(1)
        resumed = c.call("GET", f"/voice-tools/status/{call_id}")
    assert resumed["status"] == "COMPLETED", resumed
    c.relay.wait_for(call_id, "completed", timeout=120)
    return call_id


def _done_right(c: Cluster, *call_ids: str) -> None:
    """Each call's callbacks verified, ending in one ``completed``; one outbox row each (its email sent once)."""
    for call_id, events in _verified(c.relay, *call_ids).items():
        assert "checkpoint" in events and events[-1] == "completed" and events.count("completed") == 1, (call_id, events)
    listed = ",".join(f"'{call_id}'" for call_id in call_ids)
    rows = c.psql(f"SELECT tool_call_id, count(*) FROM email_outbox WHERE tool_call_id IN ({listed}) GROUP BY 1")
    sent = dict(line.split("|") for line in rows.splitlines())
    assert sent == {call_id: "1" for call_id in call_ids}, {k: v for k, v in sent.items() if v != "1"} or len(sent)


def test_the_manifests_played_serve_a_relays_flow_rest_and_mcp(cluster):
    call_id = _email_flow(cluster, "sess_kube_flow")
    _done_right(cluster, call_id)
    assert cluster.mcp("get_status", {"tool_call_id": call_id})["status"] == "COMPLETED"
    # each replica as written: two web pods answering, behind one Service
    assert len(cluster.pods["voice-tools-web"]) == 2 and len(cluster.pods["voice-tools-mcp"]) == 2
    assert [s for s in cluster.statuses if s >= 500] == [] and cluster.refused == []


def test_a_rolling_upgrade_to_the_next_build_loses_nothing(cluster):
    started = time.monotonic()
    first = images.podman("image", "inspect", "--format", "{{.Id}}", images.PROJECT).stdout.strip()
    images.project(NEXT, labels={"org.opencontainers.image.revision": f"next-{RUN}"})
    second = images.podman("image", "inspect", "--format", "{{.Id}}", NEXT).stdout.strip()
    assert first != second
    images.timings["next build"] = time.monotonic() - started
    cluster.revision = 1
    objects = cluster.render(NEXT)
    assert {c["image"] for o in objects if o["kind"] in ("Deployment", "Job")
            for c in o["spec"]["template"]["spec"]["containers"]} == {NEXT}

    stop, calls, failures = threading.Event(), [], []
    statuses_before = len(cluster.statuses)

    def relay_calls(lane: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                calls.append(_email_flow(cluster, f"sess_kube_roll_{lane}_{n}"))
            except Exception as exc:  # noqa: BLE001 - every failure is reported below
                failures.append(repr(exc)[:6000])

    lanes = [threading.Thread(target=relay_calls, args=(lane,), daemon=True) for lane in range(2)]
    for lane in lanes:
        lane.start()
    try:
        # the documented order: the migration Job with the new image, then web and MCP, the workers, beat
        cluster.migrate(objects)
        faces = [threading.Thread(target=cluster.roll, args=(objects, face), daemon=True)
                 for face in ("voice-tools-web", "voice-tools-mcp")]  # each Deployment rolls on its own
        for face in faces:
            face.start()
        for face in faces:
            face.join(timeout=600)
        assert all(p.manifest["spec"]["containers"][0]["image"] == NEXT for face in ("voice-tools-web", "voice-tools-mcp")
                   for p in cluster.pods[face]), "a face's roll did not finish"
        worker_exits = []
        for pool in ("voice-tools-send-email", "voice-tools-callbacks"):
            worker_exits += cluster.roll(objects, pool)
        cluster.roll(objects, "voice-tools-beat")
        time.sleep(2)  # a call or two more, all on the new build
    finally:
        stop.set()
        for lane in lanes:
            lane.join(timeout=300)
    images.timings["roll"] = time.monotonic() - started

    (cluster.kept / "failures.txt").write_text("\n\n".join(failures))
    assert failures == [], (f"every failure whole, and each pod's log: {cluster.kept}", failures)
    assert len(calls) >= 4, calls
    # a warm shutdown: each old worker ended by SIGTERM within its grace (Celery's exit 0), not SIGKILL (137)
    unwarm = [(pod, exits) for pod, exits in worker_exits if exits["worker"] != 0]
    assert not unwarm, (unwarm, {pod: (cluster.kept / f"{pod}-worker.log").read_text()[-6000:] for pod, _ in unwarm})
    _done_right(cluster, *calls)
    seen = cluster.statuses[statuses_before:]
    assert [s for s in seen if s >= 500] == [] and cluster.refused == [], (len(seen), cluster.refused)
    # every pod now runs the new build, and calls still go through
    for pods in cluster.pods.values():
        for pod in pods:
            image = images.podman("inspect", "--format", "{{.ImageName}}", pod.container(
                pod.manifest["spec"]["containers"][0]["name"])).stdout.strip()
            assert image == NEXT, (pod.name, image)
    _done_right(cluster, _email_flow(cluster, "sess_kube_after_roll"))
