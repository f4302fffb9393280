"""The deployment's settings, run for real: Tulip and Ivy start from the images' entrypoints
with the environment the rendered cpu overlay gives them (ports moved to free ones, /models
mapped to the local asset cache), and the checks the cluster and Docker run against them answer
as they must: the gRPC probe's service is SERVING, the container health check script passes,
Ivy refuses to start without the API-key Secret, discovers Tulip through DNS and serves an
embedding to a key holder, and SIGTERM drains Ivy and Tulip to exit 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy import check
from deploy.tools import Tools, ensure_tools
from tulip.process import free_port

MODEL = "multilingual-e5-small"
HEALTHCHECK = check.DEPLOY_DIR / "docker" / "healthcheck.py"
# Loading the model (Tulip) or the tokenizer (Ivy) on a busy 2-core machine.
START_TIMEOUT_S = 300.0


def _healthcheck(
    *args: str, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK), *args],
        capture_output=True,
        text=True,
        env=None if env is None else {**os.environ, **env},
        timeout=60,
    )


def _wait(predicate: Any, what: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            pytest.fail(f"{what}: process exited with {proc.returncode}")
        time.sleep(2.0)  # each check is a new interpreter, as in the container
    pytest.fail(f"{what}: not reached in {timeout:.0f}s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def cpu_overlay() -> dict[str, Any]:
    tools: Tools = ensure_tools()
    (overlay,) = [o for o in check.overlays() if o.name == "cpu"]
    objects = [d for d in yaml.safe_load_all(check.render_overlay(tools, overlay)) if d]
    instructions = check.dockerfile_instructions(tools)
    entrypoints: dict[str, list[str]] = {}
    stage = ""
    for instruction in instructions:
        if instruction["cmd"] == "FROM":
            stage = instruction["value"][-1]
        elif instruction["cmd"] == "ENTRYPOINT":
            entrypoints[stage] = list(instruction["value"])
    return {"objects": objects, "entrypoints": entrypoints}


def _deployment(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == name]
    return found


def _env(objects: list[dict[str, Any]], container: Mapping[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        (config_map,) = [
            o
            for o in objects
            if o["kind"] == "ConfigMap" and o["metadata"]["name"] == source["configMapRef"]["name"]
        ]
        env.update(config_map["data"])
    return env


def _command(entrypoint: list[str]) -> list[str]:
    assert entrypoint[0] == "python"
    return [sys.executable, *entrypoint[1:]]


@pytest.fixture(scope="module")
def models_dir() -> Path:
    from rose.assets import ensure_model

    return ensure_model(MODEL).parent


@pytest.fixture(scope="module")
def tulip(cpu_overlay: dict[str, Any], models_dir: Path) -> Iterator[dict[str, Any]]:
    objects = cpu_overlay["objects"]
    pod = _deployment(objects, "tulip")["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "tulip"]
    env = _env(objects, container)
    env.update(
        TULIP_HOST="127.0.0.1",
        TULIP_PORT=str(free_port()),
        TULIP_METRICS_PORT=str(free_port()),
        TULIP_THREADS="1",
        TRELLIS_MODELS_DIR=str(models_dir),
    )
    proc = subprocess.Popen(
        _command(cpu_overlay["entrypoints"]["tulip-cpu"]),
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait(
            lambda: _healthcheck("tulip", env=env).returncode == 0,
            "tulip healthy",
            proc,
            START_TIMEOUT_S,
        )
        yield {"proc": proc, "env": env, "container": container}
    finally:
        _stop(proc)


def test_tulip_answers_the_probe_service(tulip: dict[str, Any]) -> None:
    port = int(tulip["env"]["TULIP_PORT"])
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            service = tulip["container"][probe]["grpc"]["service"]
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, probe
        with pytest.raises(grpc.RpcError) as missing:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def test_tulip_serves_metrics_where_prometheus_looks(
    tulip: dict[str, Any], cpu_overlay: dict[str, Any]
) -> None:
    annotations = _deployment(cpu_overlay["objects"], "tulip")["spec"]["template"]["metadata"][
        "annotations"
    ]
    url = (
        f"http://127.0.0.1:{tulip['env']['TULIP_METRICS_PORT']}{annotations['prometheus.io/path']}"
    )
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        assert b"# TYPE" in reply.read()


def test_healthcheck_fails_on_a_wrong_service_or_no_server(tulip: dict[str, Any]) -> None:
    wrong = _healthcheck("tulip", "--service", "no.such.Service", env=tulip["env"])
    assert wrong.returncode == 1 and "NOT_FOUND" in wrong.stderr
    nobody = _healthcheck("tulip", "--port", str(free_port()), "--timeout", "1")
    assert nobody.returncode == 1
    nobody = _healthcheck("ivy", "--port", str(free_port()), "--timeout", "1")
    assert nobody.returncode == 1


def test_ivy_discovers_tulip_by_dns_and_serves(
    tulip: dict[str, Any], cpu_overlay: dict[str, Any], models_dir: Path
) -> None:
    objects = cpu_overlay["objects"]
    pod = _deployment(objects, "ivy")["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "ivy"]
    env = _env(objects, container)
    # The manifest names the headless Service; here "localhost" plays the Service's DNS name.
    name, _, address = env["IVY_REPLICAS_DNS"].partition("=")
    assert address.rpartition(":")[2] == "50051"
    mount = env["TRELLIS_MODELS_DIR"]
    env.update(
        IVY_HOST="127.0.0.1",
        IVY_PORT=str(free_port()),
        IVY_WORKERS="1",
        IVY_REPLICAS_DNS=f"{name}=localhost:{tulip['env']['TULIP_PORT']}",
        IVY_MODEL=env["IVY_MODEL"].replace(f"={mount}/", f"={models_dir}/"),
        TRELLIS_MODELS_DIR=str(models_dir),
    )
    command = _command(cpu_overlay["entrypoints"]["ivy"])
    # Without the Secret's keys the manifest's settings refuse to start, naming the setting.
    assert env["IVY_REQUIRE_API_KEYS"] == "true"
    refused = subprocess.run(
        command,
        env={**os.environ, **env, "IVY_API_KEYS": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2, refused.stderr
    assert "require-api-keys" in refused.stderr
    env["IVY_API_KEYS"] = "runtime-key"  # what the Secret `ivy-api-keys` provides
    proc = subprocess.Popen(
        command,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait(lambda: _healthcheck("ivy", env=env).returncode == 0, "ivy ready", proc, 180.0)
        url = f"http://127.0.0.1:{env['IVY_PORT']}/v1/embeddings"
        data = json.dumps({"model": name, "input": ["query: how do trellises work"]}).encode()
        anonymous = urllib.request.Request(
            url, data=data, headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as unauthorized:
            urllib.request.urlopen(anonymous, timeout=60)
        assert unauthorized.value.code == 401
        request = urllib.request.Request(
            url,
            data=data,
            headers={"Content-Type": "application/json", "Authorization": "Bearer runtime-key"},
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            body = json.loads(reply.read())
        (item,) = body["data"]
        assert len(item["embedding"]) == 384
        # SIGTERM with nothing in flight: a clean drain, well inside the grace period, exits 0.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        _stop(proc)


def test_tulip_drains_on_sigterm_and_exits_zero(tulip: dict[str, Any]) -> None:
    # Stops the shared Tulip: keep this the last test in the file that uses `tulip`.
    proc: subprocess.Popen[bytes] = tulip["proc"]
    drain = float(tulip["env"]["TULIP_DRAIN_SECONDS"])
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=drain + 15) == 0
    assert time.monotonic() - started < drain + 15
    assert _healthcheck("tulip", "--timeout", "1", env=tulip["env"]).returncode == 1


@pytest.mark.parametrize("deployment", ["tulip", "ivy"])
def test_init_container_pulls_with_the_real_cli(
    cpu_overlay: dict[str, Any], models_dir: Path, deployment: str
) -> None:
    # The init container's command, run as written (only the volume path is local here):
    # `trellis models pull` finds the asset already converted and prints its directory.
    objects = cpu_overlay["objects"]
    pod = _deployment(objects, deployment)["spec"]["template"]["spec"]
    (init,) = [c for c in pod["initContainers"] if c["name"] == "models"]
    env = _env(objects, init)
    env["TRELLIS_MODELS_DIR"] = str(models_dir)
    if deployment == "ivy":
        env["IVY_MODEL"] = env["IVY_MODEL"].replace("=/models/", f"={models_dir}/")
    argv = [
        re.sub(r"\$\(([A-Z0-9_]+)\)", lambda m: env[m.group(1)], a)
        for a in init["command"] + init.get("args", [])
    ]
    bindir = str(Path(sys.executable).parent)
    done = subprocess.run(
        argv,
        env={**os.environ, **env, "PATH": f"{bindir}:{os.environ.get('PATH', '')}"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(models_dir / MODEL)]
