"""Invariants that tie the deployment files to the code they run.

The manifests are read the way the cluster and Compose see them (the kustomize render of
each overlay, the Compose binary's resolved model, BuildKit's Dockerfile parse), and every
setting is checked against the real code: env vars are built into `TulipConfig` / `IvyConfig`
/ `AssetsConfig` by the servers' own parsers, the accepted names come from the CLIs' ``--help``
(plus any variable whose presence demonstrably changes a config), probe service names come from
`tulip.server`, HTTP probe paths from Ivy's app, the asset names from `rose.assets.REGISTRY`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml

from deploy import check
from deploy.tools import Tools, ensure_tools

REPO = Path(__file__).resolve().parents[1]
GPU_RESOURCE = "nvidia.com/gpu"


# --------------------------------------------------------------------------- the real code


def _cli_flags(module: str) -> frozenset[str]:
    """Long flags of ``python -m MODULE --help`` (``--no-x`` of a boolean pair dropped)."""
    return _help_flags(["python", "-m", module])


def _help_flags(entrypoint: list[str]) -> frozenset[str]:
    """Long flags that ``ENTRYPOINT --help`` lists, run here with this interpreter."""
    assert entrypoint[0] == "python", entrypoint
    done = subprocess.run(
        [sys.executable, *entrypoint[1:], "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", done.stdout)) - {"--help"}
    return frozenset(f for f in flags if not (f.startswith("--no-") and f"--{f[5:]}" in flags))


def _env_of(prefix: str, flag: str) -> str:
    return prefix + flag[2:].replace("-", "_").upper()


@dataclass(frozen=True)
class Code:
    """What the code accepts, derived from the code itself."""

    tulip_flags: frozenset[str]
    ivy_flags: frozenset[str]
    models_root: Path  # a directory the fake /models mount maps to (tokenizer.json per model)

    @property
    def flag_env(self) -> frozenset[str]:
        return frozenset(
            {_env_of("TULIP_", f) for f in self.tulip_flags}
            | {_env_of("IVY_", f) for f in self.ivy_flags}
        )

    def tulip(self, env: Mapping[str, str]) -> Any:
        from tulip.config import TulipConfig

        return TulipConfig.from_args([], dict(env))

    def ivy(self, env: Mapping[str, str], mount: str = "/models") -> Any:
        """IvyConfig from ``env``; model directories under ``mount`` map to a local copy."""
        from ivy.config import parse_config

        local = dict(env)
        if "IVY_MODEL" in local:
            entries = []
            for entry in local["IVY_MODEL"].split(";"):
                name, _, directory = entry.partition("=")
                if directory.startswith(mount.rstrip("/") + "/"):
                    target = self.models_root / directory[len(mount) :].lstrip("/")
                    target.mkdir(parents=True, exist_ok=True)
                    (target / "tokenizer.json").write_text("{}")
                    directory = str(target)
                entries.append(f"{name}={directory}")
            local["IVY_MODEL"] = ";".join(entries)
        return parse_config([], local)

    def assets(self, env: Mapping[str, str]) -> Any:
        from rose.assets import AssetsConfig

        return AssetsConfig.from_env(dict(env))

    def _readers(self) -> list[tuple[dict[str, str], Callable[[Mapping[str, str]], Any]]]:
        ivy_base = {"IVY_MODEL": "m=/models/m", "IVY_REPLICAS": "m=h:1"}
        return [
            ({"TULIP_MODEL": "m"}, self.tulip),
            (ivy_base, self.ivy),
            ({}, self.assets),
        ]

    def reads(self, name: str, value: str) -> bool:
        """True when setting ``name`` changes a config built by the real code.

        Tried with ``value`` and with two probes, since a value equal to the default (or an
        empty one) changes nothing even for a variable that is read.
        """
        for base, build in self._readers():
            if name in base:
                continue
            for probe in (value, "7", "x"):
                try:
                    if build(base) != build({**base, name: probe}):
                        return True
                except Exception:  # a reader that rejects the value has read it
                    return True
        return False

    def unaccepted(self, env: Mapping[str, str]) -> list[str]:
        return sorted(
            name
            for name, value in env.items()
            if name not in self.flag_env and not self.reads(name, value)
        )


@pytest.fixture(scope="session")
def code(tmp_path_factory: pytest.TempPathFactory) -> Code:
    return Code(_cli_flags("tulip"), _cli_flags("ivy"), tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tools() -> Tools:
    return ensure_tools()


def test_accepted_names_come_from_the_code(code: Code) -> None:
    # The derivation must see the documented flags, and must not accept a misspelling.
    assert {"TULIP_DRAIN_SECONDS", "TULIP_CUDA_GRAPHS", "IVY_REPLICAS_DNS"} <= code.flag_env
    assert "TULIP_NO_CUDA_GRAPHS" not in code.flag_env
    assert code.reads("IVY_API_KEYS", "k1,k2")
    assert code.reads("TRELLIS_MODELS_DIR", "/models")
    assert code.unaccepted({"TULIP_DRAIN_SECOND": "30", "IVY_CHUNK_TOKEN": "8"}) == [
        "IVY_CHUNK_TOKEN",
        "TULIP_DRAIN_SECOND",
    ]


# --------------------------------------------------------------------------- Kubernetes


@dataclass(frozen=True)
class Rendered:
    overlay: str
    objects: tuple[dict[str, Any], ...]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.overlay}: expected one {kind}/{name}, found {len(found)}"
        return found[0]

    def config_map(self, name: str) -> dict[str, str]:
        return dict(self.get("ConfigMap", name).get("data", {}))

    def container_env(
        self, container: Mapping[str, Any], secret_sample: str = "k1"
    ) -> dict[str, str]:
        """The environment a container starts with (ConfigMaps it loads, then its own env)."""
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            env.update(self.config_map(source["configMapRef"]["name"]))
        for item in container.get("env", []):
            env[item["name"]] = item.get("value", secret_sample if "valueFrom" in item else "")
        return env


def _pod(deployment: Mapping[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def _container(pod: Mapping[str, Any], name: str, init: bool = False) -> dict[str, Any]:
    key = "initContainers" if init else "containers"
    (found,) = [c for c in pod.get(key, []) if c["name"] == name]
    return found


def _port(container: Mapping[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


def _expand(args: Iterable[str], env: Mapping[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of command/args."""
    return [re.sub(r"\$\(([A-Z0-9_]+)\)", lambda m: env[m.group(1)], a) for a in args]


@pytest.fixture(scope="session", params=[o.name for o in check.overlays()])
def rendered(request: pytest.FixtureRequest, tools: Tools) -> Rendered:
    (overlay,) = [o for o in check.overlays() if o.name == request.param]
    text = check.render_overlay(tools, overlay)
    return Rendered(overlay.name, tuple(d for d in yaml.safe_load_all(text) if d))


def test_k8s_config_maps_hold_only_settings_the_code_reads(rendered: Rendered, code: Code) -> None:
    for config_map in (o for o in rendered.objects if o["kind"] == "ConfigMap"):
        assert code.unaccepted(config_map["data"]) == [], config_map["metadata"]["name"]
    for deployment in (o for o in rendered.objects if o["kind"] == "Deployment"):
        pod = _pod(deployment)
        for container in pod.get("initContainers", []) + pod["containers"]:
            env = rendered.container_env(container)
            assert code.unaccepted(env) == [], container["name"]


def test_k8s_tulip_probes_match_what_tulip_serves(rendered: Rendered, code: Code) -> None:
    from tulip.server import SERVICE_NAME

    tulip = _container(_pod(rendered.get("Deployment", "tulip")), "tulip")
    config = code.tulip(rendered.container_env(tulip))
    assert _port(tulip, "grpc") == config.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc_probe = tulip[probe]["grpc"]
        assert grpc_probe["port"] == config.port, probe
        assert grpc_probe["service"] == SERVICE_NAME, probe
    assert _port(tulip, "metrics") == config.metrics_port
    annotations = rendered.get("Deployment", "tulip")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == config.metrics_port


def test_k8s_tulip_drain_fits_in_the_grace_period(rendered: Rendered, code: Code) -> None:
    pod = _pod(rendered.get("Deployment", "tulip"))
    tulip = _container(pod, "tulip")
    config = code.tulip(rendered.container_env(tulip))
    pre_stop = tulip["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = pod["terminationGracePeriodSeconds"]
    # SIGTERM comes after preStop; the drain must end before SIGKILL, with room to exit.
    assert grace >= pre_stop + config.drain_seconds + 5, (grace, pre_stop, config.drain_seconds)
    # Draining reports NOT_SERVING: liveness must not kill the pod before the grace ends.
    liveness = tulip["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= grace
    # Ivy must notice the pod is gone (DNS refresh) before Tulip stops taking work.
    ivy = _container(_pod(rendered.get("Deployment", "ivy")), "ivy")
    ivy_config = code.ivy(rendered.container_env(ivy))
    assert pre_stop >= ivy_config.dns_refresh_seconds
    # Work admitted just before SIGTERM may run until Ivy's deadline for it: the drain must
    # not cut it earlier.
    assert config.drain_seconds >= _longest_request(ivy_config), config.drain_seconds


def test_k8s_tulip_pod_shape(rendered: Rendered, code: Code) -> None:
    pod = _pod(rendered.get("Deployment", "tulip"))
    tulip = _container(pod, "tulip")
    config = code.tulip(rendered.container_env(tulip))
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in tulip["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    limits = tulip["resources"]["limits"]
    if rendered.overlay == "gpu":
        assert int(limits[GPU_RESOURCE]) >= 1
        assert config.device.startswith("cuda")
        assert tulip["image"].startswith("trellis/tulip-gpu:")
    else:
        assert GPU_RESOURCE not in limits
        assert config.device == "cpu"
        assert config.threads is not None and config.threads <= float(limits["cpu"])
        assert tulip["image"].startswith("trellis/tulip-cpu:")


def test_k8s_model_volume_is_pulled_by_the_real_cli(rendered: Rendered, code: Code) -> None:
    from ivy.cli import build_parser
    from rose.assets import REGISTRY

    for name in ("tulip", "ivy"):
        pod = _pod(rendered.get("Deployment", name))
        init = _container(pod, "models", init=True)
        main = _container(pod, name)
        env = rendered.container_env(init)
        models_dir = str(code.assets(env).models_dir)
        init_mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
        main_mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
        assert init_mounts[models_dir] == main_mounts[models_dir] == "models"
        assert str(code.assets(rendered.container_env(main)).models_dir) == models_dir
        if name == "tulip":
            argv = _expand(init["command"] + init["args"], env)
            assert argv[0] == "trellis"
            parsed = build_parser().parse_args(argv[1:])
            assert parsed.command == "models" and parsed.models_command == "pull"
            config = code.tulip(rendered.container_env(main))
            assert parsed.names == [config.model] and config.model in REGISTRY
        else:
            # The shell loop pulls each NAME of IVY_MODEL; every directory sits in the volume.
            config = code.ivy(rendered.container_env(main), mount=models_dir)
            assert (
                init["command"][:2] == ["/bin/sh", "-c"]
                and "trellis models pull" in init["args"][0]
            )
            raw = dict(e.split("=", 1) for e in env["IVY_MODEL"].split(";"))
            assert set(raw) == set(config.models)
            for model, directory in raw.items():
                assert model in REGISTRY
                assert directory == f"{models_dir}/{model}"


def test_k8s_ivy_discovers_tulip_through_the_headless_service(
    rendered: Rendered, code: Code
) -> None:
    ivy = _container(_pod(rendered.get("Deployment", "ivy")), "ivy")
    config = code.ivy(rendered.container_env(ivy))
    tulip_deployment = rendered.get("Deployment", "tulip")
    tulip = _container(_pod(tulip_deployment), "tulip")
    tulip_config = code.tulip(rendered.container_env(tulip))
    assert config.replicas == {}, "Kubernetes discovery must go through DNS"
    assert set(config.replicas_dns) == set(config.models) == {tulip_config.model_name}
    for address in config.replicas_dns.values():
        host, _, port = address.rpartition(":")
        service_name = host.split(".")[0]
        service = rendered.get("Service", service_name)
        assert service["spec"]["clusterIP"] == "None", "Tulip's Service must be headless"
        selector = service["spec"]["selector"]
        labels = tulip_deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
        (grpc_port,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
        target = grpc_port["targetPort"]
        assert (_port(tulip, target) if isinstance(target, str) else target) == tulip_config.port


def test_k8s_ivy_probes_service_and_grace(rendered: Rendered, code: Code) -> None:
    from ivy.app import create_app

    pod = _pod(rendered.get("Deployment", "ivy"))
    ivy = _container(pod, "ivy")
    config = code.ivy(rendered.container_env(ivy))
    routes = {getattr(r, "path", None) for r in create_app(config).routes}
    assert _port(ivy, "http") == config.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        http = ivy[probe]["httpGet"]
        assert http["path"] in routes, (probe, http["path"])
        assert http["port"] in ("http", config.port)
    assert ivy["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    service = rendered.get("Service", "ivy")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    hpa = rendered.get("HorizontalPodAutoscaler", "ivy")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "ivy",
    }
    assert "cpu" in ivy["resources"]["requests"], "the HPA's CPU utilization needs a request"
    pdb = rendered.get("PodDisruptionBudget", "ivy")
    ivy_labels = rendered.get("Deployment", "ivy")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= ivy_labels.items()
    assert pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"]


def _longest_request(config: Any) -> float:
    return max(config.request_timeout_seconds, config.generation_timeout_seconds)


def test_k8s_ivy_drain_fits_in_the_grace_period(rendered: Rendered, code: Code) -> None:
    from ivy.serve import EXIT_SECONDS

    pod = _pod(rendered.get("Deployment", "ivy"))
    ivy = _container(pod, "ivy")
    config = code.ivy(rendered.container_env(ivy))
    pre_stop = ivy["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = pod["terminationGracePeriodSeconds"]
    # Ivy's drain is derived from its request lifetimes; SIGKILL must come after it ends.
    assert config.shutdown_seconds > _longest_request(config)
    assert grace >= pre_stop + config.shutdown_seconds + EXIT_SECONDS, (grace, pre_stop)
    # The listener closes when the drain starts: liveness must not kill the pod before.
    liveness = ivy["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= grace


def test_k8s_ivy_requires_api_keys(rendered: Rendered, code: Code) -> None:
    from ivy.config import ConfigError

    ivy = _container(_pod(rendered.get("Deployment", "ivy")), "ivy")
    env = rendered.container_env(ivy)
    assert code.ivy(env).require_api_keys
    (keys,) = [e for e in ivy["env"] if e["name"] == "IVY_API_KEYS"]
    secret = keys["valueFrom"]["secretKeyRef"]
    assert secret.get("optional", False) is False, "a missing Secret must not open the API"
    # Without a key (an empty Secret value) Ivy refuses to start, naming the setting.
    with pytest.raises(ConfigError) as refused:
        code.ivy({**env, "IVY_API_KEYS": ""})
    assert refused.value.key == "require-api-keys"


def _policy_for(rendered: Rendered, labels: Mapping[str, str]) -> dict[str, Any]:
    (policy,) = [
        o
        for o in rendered.objects
        if o["kind"] == "NetworkPolicy"
        and o["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    ]
    assert "Ingress" in policy["spec"]["policyTypes"]
    return policy


def _rule_ports(rule: Mapping[str, Any], container: Mapping[str, Any]) -> set[int]:
    assert rule.get("ports"), "a rule without ports opens every port"
    out = set()
    for port in rule["ports"]:
        assert port.get("protocol", "TCP") == "TCP"
        number = port["port"]
        out.add(_port(container, number) if isinstance(number, str) else number)
    return out


def test_k8s_network_policies_guard_tulip(rendered: Rendered, code: Code) -> None:
    tulip_deployment = rendered.get("Deployment", "tulip")
    tulip_labels = tulip_deployment["spec"]["template"]["metadata"]["labels"]
    tulip = _container(_pod(tulip_deployment), "tulip")
    config = code.tulip(rendered.container_env(tulip))
    ivy_deployment = rendered.get("Deployment", "ivy")
    ivy_labels = ivy_deployment["spec"]["template"]["metadata"]["labels"]
    ivy = _container(_pod(ivy_deployment), "ivy")
    policy = _policy_for(rendered, tulip_labels)
    sources_by_port: dict[int, list[dict[str, Any]]] = {}
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from"), "a rule without sources lets every pod in"
        for port in _rule_ports(rule, tulip):
            sources_by_port.setdefault(port, []).extend(rule["from"])
    # Only the gRPC and metrics ports are reachable at all.
    assert set(sources_by_port) == {config.port, config.metrics_port}
    # gRPC: the Ivy pods of this namespace and nothing else.
    for source in sources_by_port[config.port]:
        assert set(source) == {"podSelector"}, source
        selector = source["podSelector"]["matchLabels"]
        assert selector and selector.items() <= ivy_labels.items()
        assert not selector.items() <= tulip_labels.items()
    # Metrics: a monitoring namespace's Prometheus pods, never every namespace or pod.
    for source in sources_by_port[config.metrics_port]:
        assert source.get("namespaceSelector", {}).get("matchLabels"), source
        assert source.get("podSelector", {}).get("matchLabels"), source
        assert "ipBlock" not in source
    # Ivy itself stays reachable on its HTTP port from anywhere, and on nothing else.
    ivy_config = code.ivy(rendered.container_env(ivy))
    (ivy_rule,) = _policy_for(rendered, ivy_labels)["spec"]["ingress"]
    assert "from" not in ivy_rule
    assert _rule_ports(ivy_rule, ivy) == {ivy_config.port}


# --------------------------------------------------------------------------- images


@pytest.fixture(scope="session")
def stages(tools: Tools) -> dict[str, list[dict[str, Any]]]:
    """Dockerfile stages by name, each a list of BuildKit-parsed instructions."""
    out: dict[str, list[dict[str, Any]]] = {}
    current: list[dict[str, Any]] | None = None
    for instruction in check.dockerfile_instructions(tools):
        if instruction["cmd"] == "FROM":
            value = instruction["value"]
            name = value[2] if len(value) == 3 and value[1].upper() == "AS" else value[0]
            current = out.setdefault(name, [])
        if current is not None:
            current.append(instruction)
    return out


def _stage_chain(stages: Mapping[str, list[dict[str, Any]]], target: str) -> list[dict[str, Any]]:
    """Instructions that apply to ``target``, following FROM <earlier stage>."""
    instructions = stages[target]
    parent = instructions[0]["value"][0]
    return (_stage_chain(stages, parent) if parent in stages else []) + instructions[1:]


def _last(instructions: list[dict[str, Any]], cmd: str) -> dict[str, Any]:
    found = [i for i in instructions if i["cmd"] == cmd]
    assert found, f"no {cmd}"
    return found[-1]


def _image_env(instructions: list[dict[str, Any]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction in (i for i in instructions if i["cmd"] == "ENV"):
        values = instruction["value"]
        env.update(dict(zip(values[::2], values[1::2], strict=True)))
    return env


TARGETS = {"ivy": "ivy", "tulip-cpu": "tulip", "tulip-gpu": "tulip"}


def test_images_run_the_real_cli(stages: dict[str, list[dict[str, Any]]], code: Code) -> None:
    for target, module in TARGETS.items():
        chain = _stage_chain(stages, target)
        entrypoint = _last(chain, "ENTRYPOINT")
        assert entrypoint["json"] and list(entrypoint["value"]) == ["python", "-m", module]
        # The entrypoint runs here and offers the flags the settings were checked against.
        flags = _help_flags(list(entrypoint["value"]))
        assert flags == (code.tulip_flags if module == "tulip" else code.ivy_flags)
        env = {
            k: v
            for k, v in _image_env(chain).items()
            if k.startswith(("TULIP_", "IVY_", "TRELLIS_"))
        }
        assert code.unaccepted(env) == [], target
        user = _last(chain, "USER")["value"][0]
        assert re.fullmatch(r"\d+:\d+", user), f"{target}: USER must be numeric for runAsNonRoot"
        health = _last(chain, "HEALTHCHECK")
        assert list(health["value"]) == ["CMD", "python", "/opt/trellis/healthcheck.py", module]
        exposed = {int(p) for i in chain if i["cmd"] == "EXPOSE" for p in i["value"]}
        if module == "tulip":
            config = code.tulip({"TULIP_MODEL": "m", **env})
            assert exposed == {config.port, config.metrics_port}
            # Tulip defaults to loopback (it has no auth); its image opens it for Ivy.
            assert config.host == "0.0.0.0", "Tulip must listen on all interfaces in a container"
        else:
            config = code.ivy({"IVY_MODEL": "m=/models/m", "IVY_REPLICAS": "m=h:1", **env})
            assert exposed == {config.port}
            assert config.host == "0.0.0.0", "Ivy must listen on all interfaces in a container"


def test_images_copy_the_healthcheck_and_build_the_wheel(
    stages: dict[str, list[dict[str, Any]]],
) -> None:
    copies = [i["value"] for s in stages.values() for i in s if i["cmd"] == "COPY"]
    assert ("deploy/docker/healthcheck.py", "/opt/trellis/healthcheck.py") in [
        tuple(c) for c in copies
    ]
    wheel = stages["wheel"]
    assert any(
        "maturin build --release" in " ".join(i["value"]) for i in wheel if i["cmd"] == "RUN"
    )
    for source in (c[0] for c in copies if len(c) == 2 and not c[0].startswith("/")):
        assert (REPO / source).exists(), f"COPY source {source} is missing"


def test_images_are_pinned_by_build_args(tools: Tools) -> None:
    # Reproducible tags: every base image and tool version is a build argument with a pinned
    # default, and every cross-stage reference names an earlier stage.
    instructions = check.dockerfile_instructions(tools)
    declared: dict[str, str] = {}
    stages: list[str] = []
    for instruction in instructions:
        cmd, flags, value = instruction["cmd"], instruction["flags"], instruction["value"]
        if cmd == "ARG":
            name, sep, default = value[0].partition("=")
            assert sep and default, f"ARG {name} needs a pinned default"
            declared[name] = default
        elif cmd == "FROM":
            image = value[0]
            if image not in stages:
                expanded = re.sub(r"\$\{(\w+)\}", lambda m: declared[m.group(1)], image)
                _, _, tag = expanded.rpartition(":")
                assert re.search(r"\d", tag) and tag != "latest", expanded
            if len(value) == 3:
                stages.append(value[2])
        references = [f.partition("=")[2] for f in flags if f.startswith("--from=")]
        references += re.findall(r"(?:^|,)from=([\w.-]+)", ",".join(flags))
        for reference in references:
            assert reference in stages, f"{cmd} refers to unknown stage {reference}"
        for pin in re.findall(r"==\$\{(\w+)\}", " ".join(value) if cmd == "RUN" else ""):
            assert pin in declared, pin
    assert {"ivy", "tulip-cpu", "tulip-gpu", "wheel"} <= set(stages)
    compose = check.compose_config(tools, ("gpu", "metrics"))
    for name, service in compose["services"].items():
        for arg in (service.get("build") or {}).get("args", {}):
            assert arg in declared, f"compose {name} passes undeclared build arg {arg}"


def test_build_context_holds_the_wheel_inputs_and_nothing_local(
    tools: Tools, stages: dict[str, list[dict[str, Any]]]
) -> None:
    # The context as Docker sends it (moby/patternmatcher applying .dockerignore).
    files = set(check.context_files(tools))
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    maturin = project["tool"]["maturin"]
    crate = Path(maturin["manifest-path"]).parent
    required = {"pyproject.toml", "Cargo.toml", "Cargo.lock", project["project"]["readme"]}
    required.add(maturin["manifest-path"])
    required |= {p.relative_to(REPO).as_posix() for p in (REPO / crate / "src").rglob("*.rs")}
    packages = [*maturin["python-packages"], maturin["module-name"].split(".")[0]]
    for package in packages:
        sources = {
            p.relative_to(REPO).as_posix()
            for p in (REPO / package).rglob("*.py")
            if "__pycache__" not in p.parts
        }
        assert sources, package
        required |= sources
    assert sorted(required - files) == []
    local = [
        f
        for f in files
        if f.split("/")[0] in {".venv", "target", ".git", "tests", "bench"}
        or f.endswith((".so", ".pyc"))
        or "__pycache__" in f
    ]
    assert local == []
    # Every COPY from the context finds its source there; the wheel stage copies every package.
    copied: set[str] = set()
    for stage in stages.values():
        for instruction in stage:
            if instruction["cmd"] != "COPY" or any(
                f.startswith("--from") for f in instruction["flags"]
            ):
                continue
            for source in instruction["value"][:-1]:
                copied.add(source.rstrip("/"))
                assert any(f == source or f.startswith(source.rstrip("/") + "/") for f in files), (
                    source
                )
    assert set(packages) <= copied


def test_manifest_images_are_dockerfile_targets_at_the_project_version(
    rendered: Rendered, stages: dict[str, list[dict[str, Any]]]
) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for deployment in (o for o in rendered.objects if o["kind"] == "Deployment"):
        pod = _pod(deployment)
        for container in pod.get("initContainers", []) + pod["containers"]:
            repository, _, tag = container["image"].partition(":")
            assert repository.startswith("trellis/") and repository[8:] in TARGETS
            assert tag == version, container["image"]
            if "command" not in container:  # runs the image's entrypoint
                module = TARGETS[repository[8:]]
                assert deployment["metadata"]["name"] == module
        run_as = pod["securityContext"]["runAsUser"]
        for container in pod["containers"]:
            target = container["image"].partition(":")[0][8:]
            user = _last(_stage_chain(stages, target), "USER")["value"][0]
            assert user == f"{run_as}:{pod['securityContext']['runAsGroup']}"


def test_console_script_used_by_the_manifests_exists() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["trellis"] == "ivy.cli:main"


# --------------------------------------------------------------------------- Compose


@pytest.fixture(scope="session", params=[(), ("gpu", "metrics")], ids=["default", "gpu+metrics"])
def compose(request: pytest.FixtureRequest, tools: Tools) -> dict[str, Any]:
    return check.compose_config(tools, request.param)


def _tulips(compose: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose["services"].items() if n.startswith("tulip-")}


def test_compose_env_is_what_the_code_reads(compose: dict[str, Any], code: Code) -> None:
    for name, service in compose["services"].items():
        env = {k: v for k, v in (service.get("environment") or {}).items() if v is not None}
        if name == "prometheus":
            assert env == {}
            continue
        assert code.unaccepted(env) == [], name
        if name.startswith("tulip-"):
            code.tulip(env)
        elif name == "ivy":
            code.ivy(env)


def test_compose_ivy_reaches_every_replica(compose: dict[str, Any], code: Code) -> None:
    ivy = compose["services"]["ivy"]
    config = code.ivy(ivy["environment"])
    tulips = _tulips(compose)
    assert len(tulips) == 2
    names: dict[str, dict[str, Any]] = {}
    for name, service in tulips.items():
        for alias in [name, *service["networks"]["default"]["aliases"]]:
            names[alias] = service
    for model, addresses in config.replicas.items():
        assert len(addresses) == 2
        reached = set()
        for address in addresses:
            host, _, port = address.rpartition(":")
            service = names[host]
            tulip_config = code.tulip(service["environment"])
            assert int(port) == tulip_config.port
            assert tulip_config.model_name == model
            reached.add(id(service))
        assert len(reached) == 2, "each replica address must reach a different Tulip"
    waits = {n for n, d in ivy["depends_on"].items() if d["condition"] == "service_healthy"}
    assert set(tulips) <= waits


def test_compose_drain_and_healthchecks(
    compose: dict[str, Any], code: Code, stages: dict[str, list[dict[str, Any]]]
) -> None:
    from ivy.serve import EXIT_SECONDS

    ivy_service = compose["services"]["ivy"]
    ivy = code.ivy(ivy_service["environment"])
    assert _seconds(ivy_service["stop_grace_period"]) >= ivy.shutdown_seconds + EXIT_SECONDS
    for name, service in _tulips(compose).items():
        config = code.tulip(service["environment"])
        grace = _seconds(service["stop_grace_period"])
        assert grace >= config.drain_seconds + 5, name
        assert config.drain_seconds >= _longest_request(ivy), name
        target = service["image"].partition(":")[0].split("/")[-1]
        health = _last(_stage_chain(stages, target), "HEALTHCHECK")
        assert service["healthcheck"]["test"] == list(health["value"]), name
        assert service["depends_on"]["models"]["condition"] == "service_completed_successfully"
        if "gpu" in name:
            (device,) = service["deploy"]["resources"]["reservations"]["devices"]
            assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
            assert config.device.startswith("cuda")
        else:
            assert config.device == "cpu"
    gpu_ids = [
        tuple(s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"])
        for n, s in _tulips(compose).items()
        if "gpu" in n
    ]
    assert len(set(gpu_ids)) == len(gpu_ids), "GPU replicas must not share a device by default"


def test_compose_models_service_uses_the_real_cli(compose: dict[str, Any], code: Code) -> None:
    from ivy.cli import build_parser
    from rose.assets import REGISTRY

    models = compose["services"]["models"]
    assert models["entrypoint"] == ["trellis"]
    parsed = build_parser().parse_args(models["command"])
    assert parsed.models_command == "pull" and set(parsed.names) <= set(REGISTRY)
    root = str(code.assets(models["environment"]).models_dir)
    (volume,) = [v for v in models["volumes"] if v["target"] == root]
    for name, service in _tulips(compose).items():
        config = code.tulip(service["environment"])
        assert config.model in parsed.names, name
        assert str(code.assets(service["environment"]).models_dir) == root
        assert any(
            v["source"] == volume["source"] and v["target"] == root for v in service["volumes"]
        )


def test_compose_images_match_build_targets(compose: dict[str, Any]) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for name, service in compose["services"].items():
        if name == "prometheus":
            continue
        repository, _, tag = service["image"].partition(":")
        assert tag == version, name
        if "build" in service:
            assert repository == f"trellis/{service['build']['target']}", name
            assert Path(service["build"]["dockerfile"]).resolve() == check.DOCKERFILE


def test_compose_prometheus_scrapes_both(tools: Tools, code: Code) -> None:
    model = check.compose_config(tools, ("cpu", "metrics"))
    (mount,) = model["services"]["prometheus"]["volumes"]
    scrape = yaml.safe_load(Path(mount["source"]).read_text())
    assert mount["target"] == "/etc/prometheus/prometheus.yml"
    jobs = {j["job_name"]: j for j in scrape["scrape_configs"]}
    ivy = code.ivy(model["services"]["ivy"]["environment"])
    assert jobs["ivy"]["static_configs"][0]["targets"] == [f"ivy:{ivy.port}"]
    targets = []
    for _name, service in sorted(_tulips(model).items()):
        config = code.tulip(service["environment"])
        (alias,) = service["networks"]["default"]["aliases"]
        targets.append(f"{alias}:{config.metrics_port}")
    assert jobs["tulip"]["static_configs"][0]["targets"] == targets


def test_compose_publishes_on_loopback_unless_told(tools: Tools) -> None:
    # A workstation's ports stay on loopback; publishing wider is a choice (documented).
    def published(env: Mapping[str, str]) -> dict[str, set[str]]:
        services = check.compose_config(tools, ("cpu", "metrics"), env)["services"]
        return {
            name: {p["host_ip"] for p in s["ports"]} for name, s in services.items() if "ports" in s
        }

    assert published({}) == {"ivy": {"127.0.0.1"}, "prometheus": {"127.0.0.1"}}
    assert published({"IVY_PUBLISH_ADDRESS": "0.0.0.0"})["ivy"] == {"0.0.0.0"}
    assert published({"PROMETHEUS_PUBLISH_ADDRESS": "0.0.0.0"})["prometheus"] == {"0.0.0.0"}


def _seconds(duration: str) -> float:
    total = 0.0
    for amount, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration):
        total += float(amount) * {"h": 3600, "m": 60, "s": 1, "ms": 0.001}[unit]
    return total
