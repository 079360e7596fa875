"""``kubectl kustomize`` for the features deploy/kubernetes uses, and no others, in Python.

No kustomize binary comes from the package registries these machines reach for the Python this project
runs on, so the tests that start the manifests render them here, as kubectl would: ``resources`` (files
and kustomization folders, depth first), ``labels`` (``pairs`` on every object's ``metadata.labels``,
neither selectors nor templates), ``images`` (``name`` with ``newName``, ``newTag`` or ``digest``, on every
container and init container of a pod template), ``namePrefix``/``nameSuffix`` (every object renamed, and the
references kustomize follows by default to a ConfigMap or Secret of the kustomization from a pod template,
and to a Deployment from an HPA's ``scaleTargetRef``; a custom resource's references stay as written, as
kustomize leaves them). A kustomization that uses anything else is refused
(:class:`Unsupported`), so a feature added to the manifests fails the tests until it is rendered here too;
where kubectl is installed, ``tests/test_kube_play.py`` compares the two renderings object by object.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import json

import yaml

KUSTOMIZATION = ("kustomization.yaml", "kustomization.yml", "Kustomization")
HANDLED = {"apiVersion", "kind", "resources", "labels", "images", "namePrefix", "nameSuffix"}
LABELS_HANDLED = {"pairs", "includeSelectors", "includeTemplates"}
IMAGE_HANDLED = {"name", "newName", "newTag", "digest"}


class Unsupported(ValueError):
    """The kustomization uses a feature this renderer does not render."""


def _kustomization_file(folder: Path) -> Path:
    for name in KUSTOMIZATION:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"no kustomization in {folder}")


def _pod_specs(obj: dict) -> list[dict]:
    """The pod specs an object holds (a Pod's own, a workload's template, a CronJob's job's template)."""
    kind, spec = obj.get("kind"), obj.get("spec") or {}
    if kind == "Pod":
        return [spec]
    if kind == "CronJob":
        spec = (spec.get("jobTemplate") or {}).get("spec") or {}
    template = spec.get("template")
    return [template["spec"]] if isinstance(template, dict) and "spec" in template else []


def _split_image(image: str) -> tuple[str, str, str]:
    """name, ":tag" or "", "@digest" or "" of an image reference."""
    name, digest = (image.split("@", 1) + [""])[:2]
    digest = f"@{digest}" if digest else ""
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        return name[:colon], name[colon:], digest
    return name, "", digest


def _set_images(objects: list[dict], images: list[dict]) -> None:
    for entry in images:
        unknown = set(entry) - IMAGE_HANDLED
        if unknown or "name" not in entry:
            raise Unsupported(f"images entry {entry}: only {sorted(IMAGE_HANDLED)} are rendered")
        for obj in objects:
            for pod in _pod_specs(obj):
                for container in [*pod.get("initContainers", []), *pod.get("containers", [])]:
                    name, tag, digest = _split_image(container.get("image", ""))
                    if name != entry["name"]:
                        continue
                    name = entry.get("newName", name)
                    if "digest" in entry:
                        tag, digest = "", "@" + entry["digest"]
                    elif "newTag" in entry:
                        tag, digest = ":" + str(entry["newTag"]), ""
                    container["image"] = name + tag + digest


def _set_labels(objects: list[dict], labels: list[dict]) -> None:
    for entry in labels:
        unknown = set(entry) - LABELS_HANDLED
        if unknown or entry.get("includeSelectors") or entry.get("includeTemplates"):
            raise Unsupported(f"labels entry {entry}: only pairs on metadata.labels are rendered")
        for obj in objects:
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(
                {k: str(v) for k, v in (entry.get("pairs") or {}).items()})


def _pod_references(pod: dict) -> list[tuple[str, dict, str]]:
    """(kind, holder, key) of every ConfigMap and Secret name a pod spec refers to."""
    refs: list[tuple[str, dict, str]] = []
    for secret in pod.get("imagePullSecrets") or []:
        refs.append(("Secret", secret, "name"))
    for container in [*pod.get("initContainers", []), *pod.get("containers", [])]:
        for source in container.get("envFrom") or []:
            if "configMapRef" in source:
                refs.append(("ConfigMap", source["configMapRef"], "name"))
            if "secretRef" in source:
                refs.append(("Secret", source["secretRef"], "name"))
        for env in container.get("env") or []:
            value_from = env.get("valueFrom") or {}
            if "configMapKeyRef" in value_from:
                refs.append(("ConfigMap", value_from["configMapKeyRef"], "name"))
            if "secretKeyRef" in value_from:
                refs.append(("Secret", value_from["secretKeyRef"], "name"))
    for volume in pod.get("volumes") or []:
        if "configMap" in volume:
            refs.append(("ConfigMap", volume["configMap"], "name"))
        if "secret" in volume:
            refs.append(("Secret", volume["secret"], "secretName"))
        for source in (volume.get("projected") or {}).get("sources") or []:
            if "configMap" in source:
                refs.append(("ConfigMap", source["configMap"], "name"))
            if "secret" in source:
                refs.append(("Secret", source["secret"], "name"))
    return refs


def _rename(objects: list[dict], prefix: str, suffix: str) -> None:
    if not prefix and not suffix:
        return
    renamed: dict[tuple[str, str], str] = {}
    for obj in objects:
        old = obj["metadata"]["name"]
        obj["metadata"]["name"] = renamed[(obj["kind"], old)] = f"{prefix}{old}{suffix}"
    for obj in objects:
        refs = [ref for pod in _pod_specs(obj) for ref in _pod_references(pod)]
        if obj["kind"] == "HorizontalPodAutoscaler":
            target = obj["spec"]["scaleTargetRef"]
            refs.append((target["kind"], target, "name"))
        for kind, holder, key in refs:
            if (kind, holder.get(key)) in renamed:
                holder[key] = renamed[(kind, holder[key])]


def render(folder: Path | str) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize folder`` prints, in the order of the resources (kubectl sorts by
    kind; compare them by kind and name)."""
    folder = Path(folder)
    source = _kustomization_file(folder)
    kustomization = yaml.safe_load(source.read_text()) or {}
    unknown = set(kustomization) - HANDLED
    if unknown:
        raise Unsupported(f"{source}: {sorted(unknown)} not rendered (only {sorted(HANDLED)})")
    objects: list[dict] = []
    for resource in kustomization.get("resources") or []:
        path = (folder / resource).resolve()
        if path.is_dir():
            objects += render(path)
        elif path.is_file():
            # a YAML alias is one object in PyYAML: each document copied whole, so a label added to an object's
            # metadata never lands on its pod template through an anchor they share
            objects += [json.loads(json.dumps(doc)) for doc in yaml.safe_load_all(path.read_text()) if doc]
        else:
            raise Unsupported(f"{source}: resource {resource} is neither a file nor a folder here (remote bases are not rendered)")
    _set_labels(objects, kustomization.get("labels") or [])
    _set_images(objects, kustomization.get("images") or [])
    _rename(objects, kustomization.get("namePrefix") or "", kustomization.get("nameSuffix") or "")
    seen = set()
    for obj in objects:
        key = (obj.get("apiVersion"), obj.get("kind"), (obj.get("metadata") or {}).get("namespace"), obj["metadata"]["name"])
        if key in seen:
            raise ValueError(f"{source}: {key} appears twice (kustomize refuses it)")
        seen.add(key)
    return objects
