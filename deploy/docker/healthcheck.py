"""Container health check for the Trellis images (Docker HEALTHCHECK and compose).

``healthcheck.py tulip`` asks Tulip's ``grpc.health.v1.Health`` for the status of the
``trellis.v1.Inference`` service (the name comes from the compiled proto, the same one the
Kubernetes gRPC probes name); ``healthcheck.py ivy`` asks Ivy's ``/health/ready``. Ports come
from ``TULIP_PORT`` / ``IVY_PORT`` when set, else from the servers' own configuration
defaults, so the check follows whatever the container was configured with. Exit status 0
means healthy, 1 unhealthy (Docker's convention).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

__all__ = ["check_ivy", "check_tulip", "main"]


def _default_port(config_class: type, environ: Mapping[str, str], env: str) -> int:
    if environ.get(env):
        return int(environ[env])
    defaults = {f.name: f.default for f in dataclasses.fields(config_class)}
    return int(defaults["port"])


def inference_service_name() -> str:
    """Full name of the Inference service, as the health service registers it."""
    from protos.trellis.v1 import inference_pb2

    return inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name


def check_tulip(host: str, port: int, service: str, timeout: float) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"{host}:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return False, f"tulip {host}:{port} {service!r}: {exc.code().name}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"tulip {service!r}: {status}"


def check_ivy(host: str, port: int, path: str, timeout: float) -> tuple[bool, str]:
    url = f"http://{host}:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:  # noqa: S310 (loopback)
            return reply.status == 200, f"ivy {url}: HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return False, f"ivy {url}: HTTP {exc.code}"
    except OSError as exc:
        return False, f"ivy {url}: {exc}"


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog="healthcheck.py", description=__doc__.splitlines()[0])
    parser.add_argument("server", choices=("tulip", "ivy"))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, help="default: TULIP_PORT / IVY_PORT or the default")
    parser.add_argument("--service", help="gRPC health service (tulip; default: Inference)")
    parser.add_argument("--path", default="/health/ready", help="HTTP path (ivy)")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    if args.server == "tulip":
        from tulip.config import TulipConfig

        port = args.port or _default_port(TulipConfig, env, "TULIP_PORT")
        service = inference_service_name() if args.service is None else args.service
        healthy, message = check_tulip(args.host, port, service, args.timeout)
    else:
        from ivy.config import IvyConfig

        port = args.port or _default_port(IvyConfig, env, "IVY_PORT")
        healthy, message = check_ivy(args.host, port, args.path, args.timeout)
    print(message, file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
