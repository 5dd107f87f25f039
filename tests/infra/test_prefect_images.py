"""The opt-in image build (infra/prefect-images.yaml), checked offline: no Docker daemon
runs here, so its steps are checked against prefect-docker's own step functions and its
deployments against prefect.yaml's, and prefect.yaml itself must build nothing (so
`prefect deploy --all` works without Docker: tests/deploy/test_pools_and_logins.py)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "infra" / "prefect-images.yaml"
STEP = re.compile(r"\{\{\s*([\w-]+)\.(\w+)\s*\}\}")  # {{ step-id.output }}


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _steps(spec: dict, section: str) -> list[tuple[str, dict]]:
    return [next(iter(step.items())) for step in spec.get(section) or []]


def _image_deployments(spec: dict) -> dict[str, dict]:
    return {d["name"]: d for d in spec["deployments"]
            if "image" in (d["work_pool"].get("job_variables") or {})}


def test_prefect_yaml_builds_nothing_so_it_deploys_without_docker():
    spec = _yaml(ROOT / "prefect.yaml")
    assert not spec.get("build") and not spec.get("push")
    assert not any(d.get("build") or d.get("push") for d in spec["deployments"])


def test_every_image_a_deployment_names_is_built_and_pushed_by_the_images_file():
    deployed = _image_deployments(_yaml(ROOT / "prefect.yaml"))
    images = _yaml(IMAGES)
    assert deployed, "no deployment names an image"
    built = {options["id"]: options for name, options in _steps(images, "build")
             if name == "prefect_docker.deployments.steps.build_docker_image"}
    pushed = [options for name, options in _steps(images, "push")
              if name == "prefect_docker.deployments.steps.push_docker_image"]
    compose = _yaml(ROOT / "infra" / "compose.yaml")
    local_tags = {s["image"] for s in compose["services"].values() if "image" in s}
    rebuilt = _image_deployments(images)
    assert set(rebuilt) == set(deployed)
    for name, dep in deployed.items():
        local = dep["work_pool"]["job_variables"]["image"]
        assert local in local_tags, f"{name}: {local} is built by no compose service"
        step_id, output = STEP.fullmatch(
            rebuilt[name]["work_pool"]["job_variables"]["image"]).groups()
        assert output == "image" and step_id in built, name
        build = built[step_id]
        # the same Dockerfile and tag as the image compose builds under that local name
        (service,) = [s for s in compose["services"].values() if s.get("image") == local]
        assert build["dockerfile"] == "infra/docker/" + Path(service["build"]["dockerfile"]).name
        assert (ROOT / build["dockerfile"]).is_file()
        repository, tag = local.rsplit(":", 1)
        assert build["tag"] == tag
        assert build["image_name"].endswith("/" + repository)
        # pushed: the built name and tag, by the build step's outputs
        assert any(p["image_name"] == f"{{{{ {step_id}.image_name }}}}"
                   and p["tag"] == f"{{{{ {step_id}.tag }}}}" for p in pushed), step_id


def test_the_rebuilt_deployments_are_prefect_yamls_but_for_the_image():
    deployed = _image_deployments(_yaml(ROOT / "prefect.yaml"))
    for name, dep in _image_deployments(_yaml(IMAGES)).items():
        original = yaml.safe_load(yaml.safe_dump(deployed[name]))  # a deep copy
        mine = yaml.safe_load(yaml.safe_dump(dep))
        original["work_pool"]["job_variables"].pop("image")
        mine["work_pool"]["job_variables"].pop("image")
        assert mine == original, name


def test_steps_call_prefect_docker_with_arguments_it_takes():
    steps = pytest.importorskip("prefect_docker.deployments.steps")
    images = _yaml(IMAGES)
    for section in ("build", "push"):
        for name, options in _steps(images, section):
            module, _, function = name.rpartition(".")
            assert module == "prefect_docker.deployments.steps", name
            # `id` and `requires` are Prefect's step keys; the rest go to the function
            kwargs = {k: v for k, v in options.items() if k not in {"id", "requires"}}
            inspect.signature(getattr(steps, function)).bind(**kwargs)
            assert options["requires"].startswith("prefect-docker")
