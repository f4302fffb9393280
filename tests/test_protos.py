"""The committed gRPC stubs are exactly what `make protos` generates from the .proto, but
for the generator's version stamps: grpcio-tools writes its own release into
``GRPC_GENERATED_VERSION`` (a floor the stubs ask of the grpcio runtime), so a patch release
on PyPI would otherwise fail this on an unchanged .proto."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO = "protos/trellis/v1/inference.proto"
# The generator's version stamps: grpcio-tools' release in the gRPC stubs, protobuf's
# in the message module's header comment and its runtime check.
STAMPS = (
    re.compile(r"^(GRPC_GENERATED_VERSION = )'[0-9.]+'$", re.M),
    re.compile(r"^(# Protobuf Python Version: )[0-9.]+$", re.M),
    re.compile(r"^(_runtime_version\.ValidateProtobufRuntimeVersion\()[^)]*\)", re.M),
)


def _unstamped(text: str) -> str:
    for stamp in STAMPS:
        text = stamp.sub(r"\1<version>", text)
    return text


def test_version_stamps_are_found() -> None:
    """Each stamp matches the committed stubs once, so the comparison below leaves only the
    stamps out."""
    stubs = ROOT / "protos/trellis/v1"
    text = (stubs / "inference_pb2_grpc.py").read_text() + (stubs / "inference_pb2.py").read_text()
    assert [len(stamp.findall(text)) for stamp in STAMPS] == [1, 1, 1]
    assert _unstamped("GRPC_GENERATED_VERSION = '1.85.1'\nx = 1") == (
        "GRPC_GENERATED_VERSION = <version>\nx = 1"
    )


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
        assert _unstamped(committed.read_text()) == _unstamped(path.read_text()), (
            f"{committed} is stale: run `make protos`"
        )


def test_contract_services() -> None:
    from protos.trellis.v1 import inference_pb2

    service = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
    assert {m.name for m in service.methods} >= {"Embed", "Score", "Info"}
    assert inference_pb2.DESCRIPTOR.package == "trellis.v1"
