"""tests/kustomize_render.py renders deploy/kubernetes as ``kubectl kustomize`` does, and refuses what it
does not render: a feature added to a kustomization fails here until the renderer handles it."""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests import kustomize_render

ROOT = Path(__file__).resolve().parents[1]
KUSTOMIZATIONS = [ROOT / "deploy" / "kubernetes", ROOT / "deploy" / "kubernetes" / "rabbitmq"]


def _by_name(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def _operator_overlay(folder: Path) -> Path:
    """An overlay as tests/test_kube_play.py makes one: the shipped manifests, a Secret, a suffix, an image."""
    shutil.copytree(ROOT / "deploy" / "kubernetes", folder / "kubernetes")
    (folder / "secret.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "voice-tools-secrets"},
        "data": {"DATABASE_URL": base64.b64encode(b"postgresql://x@postgres/x").decode()}}))
    (folder / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["kubernetes", "secret.yaml"], "nameSuffix": "-run1",
        "images": [{"name": "registry.example.com/voice-tools", "newName": "localhost/voice-tools", "newTag": "test"}]}))
    return folder


@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_shipped_kustomization_renders_with_its_image_and_labels(folder):
    objects = _by_name(kustomize_render.render(folder))
    web = objects[("Deployment", "voice-tools-web")]
    assert web["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example.com/voice-tools:0.1.0"
    assert web["metadata"]["labels"]["app.kubernetes.io/part-of"] == "voice-tools"
    # labels go on metadata only: a selector, immutable once applied, stays as written
    assert "app.kubernetes.io/part-of" not in web["spec"]["selector"]["matchLabels"]
    assert "app.kubernetes.io/part-of" not in web["spec"]["template"]["metadata"]["labels"]
    assert sum(1 for kind, _ in objects if kind == "ScaledObject") >= 10


def test_the_overlay_renames_objects_and_the_references_kustomize_follows(tmp_path):
    objects = _by_name(kustomize_render.render(_operator_overlay(tmp_path)))
    web = objects[("Deployment", "voice-tools-web-run1")]
    container = web["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "localhost/voice-tools:test"
    assert [next(iter(s.values()))["name"] for s in container["envFrom"]] == [
        "voice-tools-config-run1", "voice-tools-secrets-run1"]
    assert objects[("HorizontalPodAutoscaler", "voice-tools-web-run1")]["spec"]["scaleTargetRef"]["name"] == "voice-tools-web-run1"


@pytest.mark.parametrize("feature", [
    {"patches": [{"path": "patch.yaml"}]},
    {"configMapGenerator": [{"name": "x", "literals": ["a=b"]}]},
    {"namespace": "voice-tools"},
    {"labels": [{"pairs": {"a": "b"}, "includeSelectors": True}]},
    {"images": [{"name": "voice-tools", "newTag": "1", "tagSuffix": "x"}]},
])
def test_a_feature_it_does_not_render_is_refused(tmp_path, feature):
    (tmp_path / "cm.yaml").write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"resources": ["cm.yaml"], **feature}))
    with pytest.raises(kustomize_render.Unsupported):
        kustomize_render.render(tmp_path)


def _kubectl_renders(folder: Path) -> dict[tuple[str, str], dict]:
    done = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return _by_name([o for o in yaml.safe_load_all(done.stdout) if o])


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: nothing to compare with")
def test_it_renders_what_kubectl_kustomize_renders(tmp_path):
    for folder in [*KUSTOMIZATIONS, _operator_overlay(tmp_path)]:
        ours, kubectl = _by_name(kustomize_render.render(folder)), _kubectl_renders(folder)
        assert sorted(ours) == sorted(kubectl), folder
        for key, obj in ours.items():
            assert obj == kubectl[key], (folder, key)
