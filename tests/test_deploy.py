"""deploy/: the SPECDEC_* variables that the Compose file and the Kubernetes manifests set are real settings, and the
grace periods, probes and ports follow those settings. The manifests' own schemas and security checks are in
`make lint-deploy` (deploy/check.py); this file needs only the project's venv."""

import os
import re
import runpy
import shlex
from pathlib import Path

import pytest
import yaml

from specdec.models import cache
from specdec.serve.config import CONFIG_ENV, ENV_PREFIX, ConfigError, Settings, load_settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
# SPECDEC_ variables that are not settings, and what reads them
NOT_SETTINGS = {CONFIG_ENV: "config.load_settings (a settings file)", "SPECDEC_CACHE": "models.cache.cache_root"}
COMPOSE_DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")
SECONDS = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}


def image_env() -> dict[str, str]:
    """The ENV instructions of the Dockerfile: what every container starts with."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    env = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(item.split("=", 1) for item in shlex.split(line[4:]))
    return env


def compose_service(*files: str) -> dict:
    """The specdec service as Compose merges it from `files` (environment maps merge, the rest overrides)."""
    service: dict = {}
    for name in files:
        layer = yaml.safe_load((DEPLOY / name).read_text())["services"]["specdec"]
        environment = {**service.get("environment", {}), **layer.get("environment", {})}
        service = {**service, **layer, "environment": environment}
    return service


def kubernetes_docs(folder: Path) -> list[dict]:
    return [doc for path in sorted(folder.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def deployment(folder: Path = KUBERNETES) -> dict:
    (found,) = [doc for doc in kubernetes_docs(folder) if doc["kind"] == "Deployment"]
    return found


def containers(pod: dict) -> dict[str, dict]:
    return {c["name"]: c for c in pod.get("initContainers", []) + pod.get("containers", [])}


def container_env(container: dict) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container.get("env", [])}


def workloads() -> dict[str, dict[str, str]]:
    """Each container's environment as it starts: the image's, then what the deployment sets."""
    base = image_env()
    found = {
        "compose": {**base, **compose_service("compose.yaml")["environment"]},
        "compose + api keys": {**base, **compose_service("compose.yaml", "compose.api-keys.yaml")["environment"]},
    }
    pod = deployment()["spec"]["template"]["spec"]
    for name, container in containers(pod).items():
        found[f"kubernetes {name}"] = {**base, **container_env(container)}
    for component in sorted((KUBERNETES / "components").iterdir()):
        patch = deployment(component)["spec"]["template"]["spec"]
        for name, container in containers(patch).items():
            found[f"kubernetes {name} + {component.name}"] = {**found[f"kubernetes {name}"],
                                                              **container_env(container)}
    return found


def unknown_variables(env: dict[str, str]) -> list[str]:
    """SPECDEC_ names that neither a setting nor anything in NOT_SETTINGS reads (load_settings ignores them)."""
    return sorted(name for name in env if name.startswith(ENV_PREFIX) and name not in NOT_SETTINGS
                  and name.removeprefix(ENV_PREFIX).lower() not in Settings.model_fields)


def settings_of(env: dict[str, str]) -> Settings:
    return load_settings(environ={name: str(value) for name, value in env.items()})


def graceful_timeout(env: dict[str, str], monkeypatch) -> int:
    """gunicorn's graceful timeout as config/gunicorn.conf.py computes it under `env`."""
    for name in [name for name in os.environ if name.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    return runpy.run_path(str(ROOT / "config" / "gunicorn.conf.py"))["graceful_timeout"]


def compose_seconds(duration: str) -> float:
    parts = COMPOSE_DURATION.findall(duration)
    assert parts and "".join(a + b for a, b in parts) == duration, f"not a Compose duration: {duration!r}"
    return sum(float(amount) * SECONDS[unit] for amount, unit in parts)


@pytest.mark.parametrize("name", sorted(workloads()))
def test_environment_is_settings(name, monkeypatch, tmp_path):
    env = workloads()[name]
    assert not unknown_variables(env), f"{name} sets variables that no setting reads: {unknown_variables(env)}"
    if "SPECDEC_API_KEYS_FILE" in env:  # a file mounted in the container; start-up reads it, so stand one in here
        assert env["SPECDEC_API_KEYS_FILE"].startswith("/"), env["SPECDEC_API_KEYS_FILE"]
        (tmp_path / "api-keys").write_text("a-key\n")
        env = {**env, "SPECDEC_API_KEYS_FILE": str(tmp_path / "api-keys")}
    settings_of(env)  # raises ConfigError naming the variable if a value is invalid
    monkeypatch.setenv("SPECDEC_CACHE", env["SPECDEC_CACHE"])
    assert cache.cache_root() == Path(env["SPECDEC_CACHE"])


def test_an_unknown_variable_is_caught():
    env = {**image_env(), "SPECDEC_QUEUE_SIZ": "8", "SPECDEC_LOG_LEVEL": "info"}
    assert unknown_variables(env) == ["SPECDEC_QUEUE_SIZ"]


def test_compose_follows_the_settings(monkeypatch):
    service = compose_service("compose.yaml")
    settings = settings_of({**image_env(), **service["environment"]})
    assert compose_seconds(service["stop_grace_period"]) >= graceful_timeout(service["environment"], monkeypatch)
    assert service["ports"][0].rsplit(":", 1)[1] == str(settings.port)
    assert f"127.0.0.1:{settings.port}/readyz" in " ".join(service["healthcheck"]["test"])
    assert service["restart"] in ("always", "unless-stopped", "on-failure")
    (gpu,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert any(volume.endswith(":/cache") for volume in service["volumes"])
    # checkov has no Compose checks: the hardening it would ask of a Kubernetes pod, asked here
    assert service["read_only"] is True and service["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in service["security_opt"]


def test_kubernetes_follows_the_settings(monkeypatch):
    pod = deployment()["spec"]["template"]["spec"]
    container = containers(pod)["specdec"]
    env = {**image_env(), **container_env(container)}
    settings = settings_of(env)
    pause = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] >= int(pause[1]) + graceful_timeout(container_env(container),
                                                                                     monkeypatch)
    (port,) = container["ports"]
    assert port["containerPort"] == settings.port
    probes = {kind: container[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {kind: probe["path"] for kind, probe in probes.items()} == {
        "startupProbe": "/readyz", "readinessProbe": "/readyz", "livenessProbe": "/healthz"}
    assert all(probe["port"] in (port["name"], port["containerPort"]) for probe in probes.values())
    # the model cache: the claim at SPECDEC_CACHE's parent, in both the init container and the server
    (cache,) = [volume["name"] for volume in pod["volumes"] if "persistentVolumeClaim" in volume]
    for each in containers(pod).values():
        assert {"name": cache, "mountPath": str(Path(env["SPECDEC_CACHE"]).parent)} in each["volumeMounts"]
    assert "specdec.default_pair prepare" in " ".join(containers(pod)["prepare-models"]["args"])


def service_links(docs: list[dict]) -> dict[str, str]:
    """The variables Kubernetes gives a pod for each Service of its namespace unless enableServiceLinks is false
    (docker links' form: NAME_SERVICE_HOST, NAME_SERVICE_PORT, NAME_PORT=tcp://ip:port, NAME_PORT_<port>_TCP...)."""
    env = {}
    for service in (doc for doc in docs if doc["kind"] == "Service"):
        name, port = service["metadata"]["name"].upper().replace("-", "_"), service["spec"]["ports"][0]["port"]
        link = f"{name}_PORT_{port}_TCP"
        env |= {f"{name}_SERVICE_HOST": "10.0.0.1", f"{name}_SERVICE_PORT": str(port),
                f"{name}_PORT": f"tcp://10.0.0.1:{port}", link: f"tcp://10.0.0.1:{port}", f"{link}_PROTO": "tcp",
                f"{link}_PORT": str(port), f"{link}_ADDR": "10.0.0.1"}
    return env


def test_kubernetes_gives_the_pod_no_service_links():
    """The Service is named specdec, so its links would be SPECDEC_ variables, SPECDEC_PORT=tcp://10.0.0.1:80 among
    them, which the service would read as its port and refuse to start with (found reviewing an audit of the
    settings): the pod turns them off."""
    pod = deployment()["spec"]["template"]["spec"]
    links = service_links(kubernetes_docs(KUBERNETES))
    assert links["SPECDEC_PORT"].startswith("tcp://")
    with pytest.raises(ConfigError, match="SPECDEC_PORT"):
        settings_of({**image_env(), **links, **container_env(containers(pod)["specdec"])})
    assert pod["enableServiceLinks"] is False


def test_the_autoscalers_figures_are_scraped_and_an_empty_query_is_an_error():
    """An audit: the ScaledObject asks the Prometheus Operator's Prometheus, which ignores the pods' prometheus.io
    annotations, and KEDA reads an empty answer as 0: one replica under any load, silently. The PodMonitor
    selects the Deployment's pods on its named port; the trigger refuses empty answers; both are applied."""
    docs = {doc["kind"]: doc for doc in kubernetes_docs(KUBERNETES)}
    pod = deployment()["spec"]["template"]
    monitor = docs["PodMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {port["name"] for port in containers(pod["spec"])["specdec"]["ports"]}
    assert [(endpoint["port"], endpoint["path"]) for endpoint in monitor["podMetricsEndpoints"]] == \
        [(port, "/metrics") for port in ports]
    (trigger,) = docs["ScaledObject"]["spec"]["triggers"]
    assert trigger["metadata"]["ignoreNullValues"] == "false"
    for metric in re.findall(r"(specdec_\w+)\{", trigger["metadata"]["query"]):
        assert metric in ("specdec_queue_depth", "specdec_engine_busy")  # the gauges the service exports
    listed = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())["resources"]
    assert {"scaledobject.yaml", "podmonitor.yaml"} <= set(listed)


def test_the_image_can_compile_the_models_on_cuda():
    """An audit: `compile = "auto"` compiles on CUDA, and Triton builds its launcher with a C compiler and Python's
    headers at start-up; the image had neither, so the models stayed eager (a warning, then ready)."""
    install = next(line for line in (ROOT / "Dockerfile").read_text().splitlines() if "apt-get install" in line)
    assert {"gcc", "libc6-dev", "python3-dev"} <= set(install.split())
    assert load_settings(environ={}).compile == "auto"
