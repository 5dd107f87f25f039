"""Offline checks of infra/: the compose stack, the worker images and the GPU work-pool
template. No container engine is needed: compose files are resolved by the
`docker-compose` binary when it is installed (Debian package `docker-compose`), the
Kubernetes Job is rendered with Prefect's own templating and validated against the
Kubernetes API schema by `kubernetes-validate` when it is installed.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
COMPOSE = INFRA / "compose.yaml"
ENV_EXAMPLE = INFRA / ".env.example"
TEMPLATE = INFRA / "k8s" / "gpu-work-pool-template.json"
WORKER_DOCKERFILES = [INFRA / "docker" / "worker-cpu.Dockerfile",
                      INFRA / "docker" / "worker-cuda.Dockerfile"]
DOCKERFILES = [*WORKER_DOCKERFILES, INFRA / "docker" / "mlflow.Dockerfile"]

# The long-running commands of the stack's own services. tests/deploy/ starts each of them
# natively (a Prefect server, an MLflow server, a process worker) and runs the flow through
# them, so CI exercises every command the stack runs. A new service command goes into those
# tests first, then here.
NATIVELY_TESTED_COMMANDS = {
    ("prefect", "server", "start"),
    ("prefect", "worker", "start"),
    ("mlflow", "server"),
}
# Third-party images with their own commands: the database, the object store and its
# one-shot client.
THIRD_PARTY_SERVICES = {"postgres", "minio", "minio-init"}
# Environment names whose values are secrets (PGPASSWORD included).
SECRET_NAME = re.compile(r"PASSWORD|SECRET|ACCESS_KEY|TOKEN|AUTH_STRING|API_KEY")
REQUIRED_REF = re.compile(r"\$\{(\w+):\?[^}]*\}")      # ${VAR:?message}
DEFAULTED_REF = re.compile(r"\$\{(\w+):-([^}]*)\}")    # ${VAR:-default}
LOOPBACK_PREFIXES = ("127.0.0.1:", "${BIND_ADDRESS:-127.0.0.1}:")
# Prefect's Kubernetes worker insists on these two keys inside the pod spec (they belong to
# the Job spec; the API server drops them with a warning), so strict schema validation runs
# without them.
PREFECT_POD_SPEC_EXTRAS = ("parallelism", "completions")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _services(compose: dict, *, own: bool) -> dict[str, dict]:
    return {n: s for n, s in compose["services"].items() if (n not in THIRD_PARTY_SERVICES) == own}


def _env_example() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def _strings(node) -> list[str]:
    """Every string in the parsed compose file (keys and values; comments are gone)."""
    if isinstance(node, dict):
        return [s for k, v in node.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(node, list):
        return [s for item in node for s in _strings(item)]
    return [node] if isinstance(node, str) else []


def _compose_text() -> str:
    return "\n".join(_strings(yaml.safe_load(COMPOSE.read_text())))


def _required_vars() -> set[str]:
    return set(REQUIRED_REF.findall(_compose_text()))


def _test_secrets() -> dict[str, str]:
    """A distinct, recognisable value for every required variable."""
    return {name: f"s3cr3t{i}{name.lower().replace('_', '')}" for i, name in
            enumerate(sorted(_required_vars()))}


def _docker_compose(tmp_path: Path, env: dict[str, str], env_file: Path | None = None,
                    ) -> subprocess.CompletedProcess:
    """`docker-compose config` with only `env` (and PATH) in the environment; an empty env
    file by default, so that a developer's infra/.env cannot leak in."""
    if env_file is None:
        env_file = tmp_path / "empty.env"
        env_file.write_text("")
    return subprocess.run(
        [shutil.which("docker-compose"), "-f", str(COMPOSE), "--env-file", str(env_file),
         "--profile", "gpu", "config"],
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), **env},
        capture_output=True, text=True, timeout=60, check=False)


needs_docker_compose = pytest.mark.skipif(
    shutil.which("docker-compose") is None,
    reason="docker-compose not installed (apt-get install -y docker-compose)")


# ------------------------------------------------------------------------ compose: secrets
def test_compose_defines_the_stack(compose):
    assert set(compose["services"]) == {"postgres", "minio", "minio-init", "prefect-server",
                                        "mlflow", "worker-cpu", "worker-gpu"}
    gpu = compose["services"]["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_secrets_come_only_from_required_environment_variables(compose):
    for name, service in compose["services"].items():
        for key, value in (service.get("environment") or {}).items():
            value = str(value)
            if SECRET_NAME.search(key):
                assert REQUIRED_REF.fullmatch(value), f"{name}.{key}: {value!r} is no ${{VAR:?}}"
            # a credential inside a URL must be a required reference too
            for url_password in re.findall(r"://[^:/@\s]+:([^@\s]+)@", value):
                assert REQUIRED_REF.fullmatch(url_password), f"{name}.{key}: literal URL password"
        for arg in service.get("command") or []:
            assert not re.search(r"://[^:/@\s]+:[^@\s]+@", str(arg)), f"{name}: password in command"
    for var, _default in DEFAULTED_REF.findall(_compose_text()):
        assert not SECRET_NAME.search(var), f"${{{var}:-...}}: a secret must not have a default"
    assert all(SECRET_NAME.search(v) or v.endswith(("_USER", "_USERNAME"))
               for v in _required_vars())


def test_both_servers_require_the_login_every_client_presents(compose):
    """Prefect's server takes the auth string its clients send; MLflow's basic-auth app
    creates as admin the user the workers log in as; every client (both workers) gets
    both logins under the clients' standard variable names, from one required variable
    each. tests/deploy/test_pools_and_logins.py runs both servers so."""
    services = compose["services"]
    server = services["prefect-server"]["environment"]
    mlflow = services["mlflow"]
    ref = {key: REQUIRED_REF.fullmatch(str(value)).group(1)
           for key, value in mlflow["environment"].items() if REQUIRED_REF.fullmatch(str(value))}
    assert REQUIRED_REF.fullmatch(server["PREFECT_SERVER_API_AUTH_STRING"]).group(1) == (
        "PREFECT_API_AUTH_STRING")
    command = mlflow["command"]
    assert command[command.index("--app-name") + 1] == "basic-auth"
    assert ref["MLFLOW_AUTH_ADMIN_USERNAME"] == "MLFLOW_TRACKING_USERNAME"
    assert ref["MLFLOW_AUTH_ADMIN_PASSWORD"] == "MLFLOW_TRACKING_PASSWORD"
    assert "MLFLOW_FLASK_SERVER_SECRET_KEY" in ref
    for worker in ("worker-cpu", "worker-gpu"):
        env = services[worker]["environment"]
        for var in ("PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME",
                    "MLFLOW_TRACKING_PASSWORD"):
            assert REQUIRED_REF.fullmatch(env[var]).group(1) == var, f"{worker}.{var}"
    # the login settings the server reads: mounted, and the user store on a named volume
    config_path = mlflow["environment"]["MLFLOW_AUTH_CONFIG_PATH"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in mlflow["volumes"]}
    assert (INFRA / mounts[config_path]).is_file()
    import configparser

    ini = configparser.ConfigParser()
    ini.read(INFRA / mounts[config_path])
    assert "admin_password" not in ini["mlflow"]  # credentials come from infra/.env only
    store = ini["mlflow"]["database_uri"].removeprefix("sqlite:///")
    assert mounts[str(Path(store).parent)] in compose["volumes"]


def test_env_example_documents_every_variable_without_secrets():
    example = _env_example()
    defaults = dict(DEFAULTED_REF.findall(_compose_text()))
    assert set(example) == _required_vars() | set(defaults)
    for var in _required_vars():
        assert example[var] == "", f"{var}: .env.example must not hold a value"
    for var, default in defaults.items():
        assert example[var] == default, f"{var}: .env.example says {example[var]!r}"


@needs_docker_compose
def test_docker_compose_resolves_the_stack_with_the_secrets_from_the_environment(tmp_path):
    secrets = _test_secrets()
    out = _docker_compose(tmp_path, secrets)
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)["services"]
    url = resolved["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert urlsplit(url).password == secrets["POSTGRES_PASSWORD"]
    assert resolved["mlflow"]["environment"]["PGPASSWORD"] == secrets["MLFLOW_DB_PASSWORD"]
    postgres_env = resolved["postgres"]["environment"]
    assert postgres_env["MLFLOW_DB_PASSWORD"] == secrets["MLFLOW_DB_PASSWORD"]
    published = [p for s in resolved.values() for p in s.get("ports", [])]
    assert sorted(published) == ["127.0.0.1:4200:4200/tcp", "127.0.0.1:5000:5000/tcp"]


@needs_docker_compose
@pytest.mark.parametrize("missing", sorted(_required_vars()))
def test_docker_compose_refuses_to_start_without_a_secret(tmp_path, missing):
    env = {k: v for k, v in _test_secrets().items() if k != missing}
    out = _docker_compose(tmp_path, env)
    assert out.returncode != 0
    assert missing in out.stderr


@needs_docker_compose
def test_docker_compose_refuses_the_unedited_env_example(tmp_path):
    out = _docker_compose(tmp_path, {}, env_file=ENV_EXAMPLE)
    assert out.returncode != 0
    assert any(var in out.stderr for var in _required_vars())


# ------------------------------------------------------------------------ compose: network
def test_only_the_uis_are_published_and_on_loopback(compose):
    container_ports = set()
    for name, service in compose["services"].items():
        assert service.get("network_mode") != "host", name
        assert not service.get("privileged"), name
        assert not any("docker.sock" in str(v) for v in service.get("volumes", [])), name
        assert service.get("networks"), f"{name}: not on an explicit network"
        for port in service.get("ports", []):
            assert isinstance(port, str) and port.startswith(LOOPBACK_PREFIXES), f"{name}: {port}"
            container_ports.add(int(port.rsplit(":", 1)[1]))
    assert container_ports == {4200, 5000}
    assert compose["networks"]["data"]["internal"] is True
    for store in ("postgres", "minio", "minio-init"):
        assert compose["services"][store]["networks"] == ["data"], store
    for worker in ("worker-cpu", "worker-gpu"):
        assert "data" not in compose["services"][worker]["networks"]


def test_services_restart_wait_for_health_and_keep_data_in_named_volumes(compose):
    services = compose["services"]
    for name, service in services.items():
        if name != "minio-init":
            assert service["restart"] == "unless-stopped", name
            assert service["healthcheck"]["test"][0] == "CMD", name
        for dep, rule in (service.get("depends_on") or {}).items():
            expected = ("service_completed_successfully" if dep == "minio-init"
                        else "service_healthy")
            assert rule["condition"] == expected, f"{name} -> {dep}"
    for name in ("postgres", "minio", "worker-cpu"):
        for volume in services[name]["volumes"]:
            source = volume.split(":", 1)[0]
            assert source in compose["volumes"] or (INFRA / source).is_file(), volume


# ------------------------------------------------------------------------ compose: commands
def _command_key(command: list[str]) -> tuple[str, ...] | None:
    for key in NATIVELY_TESTED_COMMANDS:
        if tuple(command[:len(key)]) == key:
            return key
    return None


def test_service_commands_are_the_ones_ci_runs_natively(compose):
    for name, service in _services(compose, own=True).items():
        assert _command_key(service["command"]) is not None, f"{name}: {service['command']}"


def test_the_clis_accept_every_flag_the_stack_uses(compose):
    def executable(name: str) -> str:  # the environment's own CLI, even when not on PATH
        beside = Path(sys.executable).parent / name
        return str(beside) if beside.exists() else shutil.which(name)

    procs = {key: subprocess.Popen([executable(key[0]), *key[1:], "--help"], text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   env={**os.environ, "COLUMNS": "250", "NO_COLOR": "1"})
             for key in NATIVELY_TESTED_COMMANDS}
    helps = {key: p.communicate(timeout=120)[0] for key, p in procs.items()}
    for name, service in _services(compose, own=True).items():
        key = _command_key(service["command"])
        for flag in (a for a in service["command"] if a.startswith("--")):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", helps[key]), (
                f"{name}: `{' '.join(key)}` has no {flag}")


def test_urls_pools_and_bucket_agree_across_services(compose):
    services = compose["services"]

    def arg(service: str, flag: str) -> str:
        command = services[service]["command"]
        return command[command.index(flag) + 1]

    workers = ("worker-cpu", "worker-gpu")
    for worker in workers:
        env = services[worker]["environment"]
        prefect_port = arg("prefect-server", "--port")
        assert env["PREFECT_API_URL"] == f"http://prefect-server:{prefect_port}/api"
        assert env["MLFLOW_TRACKING_URI"] == f"http://mlflow:{arg('mlflow', '--port')}"
        assert env["PREFECT_LOGGING_EXTRA_LOGGERS"] == "mlm_pipeline"
    bucket = urlsplit(arg("mlflow", "--artifacts-destination")).netloc
    assert services["minio-init"]["environment"]["BUCKET"] == bucket
    assert urlsplit(services["mlflow"]["environment"]["MLFLOW_S3_ENDPOINT_URL"]).hostname == "minio"
    # every pool that prefect.yaml deploys to has a worker here, or is the Kubernetes pool
    served = {arg(w, "--pool") for w in workers}
    deployments = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    for dep in deployments:
        assert dep["work_pool"]["name"] in served | {"gpu-k8s"}, dep["name"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # SQLAlchemy, from mlflow's import
def test_mlflow_accepts_the_workers_and_the_browser_and_nobody_else(compose):
    from mlflow.server.security_utils import (
        get_default_allowed_hosts,
        is_allowed_host_header,
    )

    command = compose["services"]["mlflow"]["command"]
    allowed_ref = command[command.index("--allowed-hosts") + 1]
    allowed = dict(DEFAULTED_REF.findall(allowed_ref))["MLFLOW_ALLOWED_HOSTS"].split(",")
    workers = urlsplit(compose["services"]["worker-cpu"]["environment"]["MLFLOW_TRACKING_URI"])
    for host in (workers.netloc, "127.0.0.1:5000", "localhost:5000"):
        assert is_allowed_host_header(allowed, host), host
    assert not is_allowed_host_header(allowed, "attacker.example:5000")
    # why the flag is set: MLflow's default list refuses the service name
    assert not is_allowed_host_header(get_default_allowed_hosts(), workers.netloc)


def test_init_scripts_are_valid_shell_and_create_what_the_servers_use(compose):
    pg_script = INFRA / "postgres" / "10-create-mlflow-db.sh"
    minio_script = INFRA / "minio" / "create-bucket.sh"
    subprocess.run(["bash", "-n", str(pg_script)], check=True)
    subprocess.run(["sh", "-n", str(minio_script)], check=True)
    assert os.access(pg_script, os.X_OK)
    command = compose["services"]["mlflow"]["command"]
    backend = urlsplit(command[command.index("--backend-store-uri") + 1])
    sql = pg_script.read_text()
    assert f"CREATE ROLE {backend.username} LOGIN" in sql
    assert f"CREATE DATABASE {backend.path.lstrip('/')} OWNER {backend.username}" in sql
    assert backend.password is None  # it comes from PGPASSWORD


# ------------------------------------------------------------------------ k8s template
def _template() -> dict:
    return json.loads(TEMPLATE.read_text())


def _render_job(values: dict | None = None) -> dict:
    """The Job the worker submits: variable defaults (overridden by `values`) applied with
    Prefect's templating, then the worker's env dict turned into the container's env list."""
    from prefect.utilities.templating import apply_values

    template = _template()
    variables = {k: v["default"] for k, v in template["variables"]["properties"].items()
                 if "default" in v}
    variables.update(values or {})
    config = apply_values(copy.deepcopy(template["job_configuration"]), variables)
    job = config["job_manifest"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": k, "value": v} for k, v in config["env"].items()]
    container["args"] = ["prefect", "flow-run", "execute"]
    job["metadata"]["generateName"] = "mlm-pretraining-"
    return job


def test_template_is_prefects_kubernetes_template_plus_gpu_settings():
    import prefect
    from prefect.server.schemas.actions import validate_base_job_template

    template = _template()
    validate_base_job_template(template)  # every placeholder is a declared variable
    bundled = Path(prefect.__file__).parent / "server/api/collections_data/views"
    default = json.loads((bundled / "aggregate-worker-metadata.json").read_text())[
        "prefect-kubernetes"]["kubernetes"]["default_base_job_configuration"]
    assert set(default["job_configuration"]) <= set(template["job_configuration"])
    assert set(default["variables"]["properties"]) <= set(template["variables"]["properties"])
    # the gpu deployment's job variables exist in the template
    gpu = next(d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
               if d["work_pool"]["name"] == "gpu-k8s")
    assert set(gpu["work_pool"]["job_variables"]) <= set(template["variables"]["properties"])


def test_rendered_job_runs_the_cuda_image_on_a_gpu_node(compose):
    job = _render_job()
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"] == compose["services"]["worker-gpu"]["image"]
    shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    shm_volume = next(v for v in pod["volumes"] if v["name"] == shm["name"])
    assert shm_volume["emptyDir"]["medium"] == "Memory"
    assert pod["nodeSelector"] and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["securityContext"]["runAsNonRoot"] is True
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["MLFLOW_TRACKING_URI"].startswith("http")
    # The store's credentials and the MLflow login come from optional Secrets, and the
    # README's command creates the logins Secret with the two names the MLflow client reads.
    secrets = {s["secretRef"]["name"]: s["secretRef"]["optional"] for s in container["envFrom"]}
    assert secrets == {"mlm-pipeline-store": True, "mlm-pipeline-logins": True}
    readme = (INFRA / "README.md").read_text()
    create = re.search(r"kubectl create secret generic mlm-pipeline-logins(.*?)\n```", readme,
                       re.S)
    assert create and set(re.findall(r"--from-literal=(\w+)=", create.group(1))) == {
        "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"}
    assert "PREFECT_API_URL" not in env  # unset: the worker passes its own
    job = _render_job({"gpu_count": 4, "prefect_api_url": "http://prefect:4200/api"})
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert {"name": "PREFECT_API_URL", "value": "http://prefect:4200/api"} in container["env"]


@pytest.mark.parametrize("values", [{}, {"work_volume": {
    "name": "work", "persistentVolumeClaim": {"claimName": "mlm-pipeline-work"}}}])
def test_rendered_job_validates_against_the_kubernetes_api_schema(values):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    job = _render_job(values)
    for key in PREFECT_POD_SPEC_EXTRAS:
        job["spec"]["template"]["spec"].pop(key)
    kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)


# ------------------------------------------------------------------------ Dockerfiles
def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [ln for ln in dockerfile.read_text().splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in joined.splitlines()
            if ln.strip()]


def test_base_images_and_compose_images_are_pinned(compose):
    for dockerfile in DOCKERFILES:
        for base in (args for ins, args in _instructions(dockerfile) if ins == "FROM"):
            name, _, tag = base.split()[0].rpartition(":")
            assert name and tag and tag != "latest", f"{dockerfile.name}: FROM {base}"
    for name, service in compose["services"].items():
        tag = service["image"].rpartition(":")[2]
        assert tag and "/" not in tag and tag != "latest", f"{name}: {service['image']}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_run_steps_are_valid_shell(dockerfile):
    for ins, args in _instructions(dockerfile):
        if ins == "RUN":
            out = subprocess.run(["sh", "-n", "-c", args], capture_output=True, text=True,
                                 check=False)
            assert out.returncode == 0, f"{dockerfile.name}: RUN {args}\n{out.stderr}"


@pytest.mark.parametrize("dockerfile", WORKER_DOCKERFILES, ids=lambda p: p.name)
def test_worker_images_install_torch_first_then_the_project(dockerfile):
    # versions: tests/infra/test_constraints.py (every pip install reads constraints.txt)
    steps = _instructions(dockerfile)
    runs = [args for ins, args in steps if ins == "RUN"]
    torch_step = next(i for i, r in enumerate(runs) if re.search(r"pip install .*\storch$", r))
    project_step = next(i for i, r in enumerate(runs)
                        if re.search(r"pip install .*\s\"?\.(\[[\w,-]+\])?\"?(\s|$)", r))
    assert torch_step < project_step
    assert "--index-url" in runs[torch_step].split()
    args = dict(a.split("=", 1) for ins, a in steps if ins == "ARG" and "=" in a)
    if "cpu" in dockerfile.name:
        assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


@pytest.mark.parametrize("dockerfile", WORKER_DOCKERFILES, ids=lambda p: p.name)
def test_worker_images_run_unprivileged_from_the_deployed_directory(dockerfile):
    steps = _instructions(dockerfile)
    user = [a for ins, a in steps if ins == "USER"][-1].split(":")[0]
    assert user not in ("root", "0")
    env = " ".join(a for ins, a in steps if ins == "ENV")
    assert "PREFECT_LOGGING_EXTRA_LOGGERS=mlm_pipeline" in env
    workdir = [a for ins, a in steps if ins == "WORKDIR"][-1]
    gpu = next(d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
               if d["work_pool"]["name"] == "gpu-k8s")
    pull = gpu["pull"][0]["prefect.deployments.steps.set_working_directory"]["directory"]
    assert workdir == pull


def test_dockerignore_sends_only_what_the_images_copy():
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    assert patterns[0] == "*"
    admitted = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = {src for dockerfile in WORKER_DOCKERFILES
              for ins, args in _instructions(dockerfile) if ins == "COPY"
              for src in args.split()[:-1]}
    assert copied == admitted
    assert not admitted & {".mlm-pipeline", ".venv", ".git", "mlflow.db", "mlartifacts"}


# ------------------------------------------------------------------------ deployment recipe
def test_weekly_schedule_ships_paused_and_the_docs_say_how_to_run_and_stop_it():
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import CronSchedule

    deployments = {d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())
                   ["deployments"]}
    (spec,) = deployments["scheduled-retrain"]["schedules"]
    schedule = DeploymentScheduleCreate(
        schedule=CronSchedule(cron=spec["cron"], timezone=spec["timezone"]),
        active=spec["active"], parameters=spec["parameters"])
    assert schedule.active is False  # `prefect deploy` must not start weekly runs unasked
    page = (ROOT / "docs" / "deploy.md").read_text()
    recipe = page.split("# Deploy and schedule", 1)[1].split("\n## ", 1)[0]
    for needed in ("prefect deployment schedule resume 'mlm-pretraining/scheduled-retrain'",
                   "PREFECT_UI_API_URL=", "echo $! > prefect-worker.pid",
                   "kill -KILL \"$(cat prefect-worker.pid)\"", "active: true"):
        assert needed in recipe, needed
    # pkill patterns match other users' processes: the recipe stops by PID
    assert not [line for line in recipe.splitlines() if line.lstrip().startswith("pkill")]
