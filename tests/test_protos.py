"""The committed gRPC stubs are exactly what `make protos` generates from the .proto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO = "protos/trellis/v1/inference.proto"


def test_stubs_match_proto(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            PROTO,
        ],
        cwd=ROOT,
        check=True,
    )
    generated = sorted((tmp_path / "protos/trellis/v1").glob("*.py*"))
    assert [p.name for p in generated] == [
        "inference_pb2.py",
        "inference_pb2.pyi",
        "inference_pb2_grpc.py",
    ]
    for path in generated:
        committed = ROOT / "protos/trellis/v1" / path.name
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run `make protos`"


def test_contract_services() -> None:
    from protos.trellis.v1 import inference_pb2

    service = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
    assert {m.name for m in service.methods} >= {"Embed", "Score", "Info"}
    assert inference_pb2.DESCRIPTOR.package == "trellis.v1"
