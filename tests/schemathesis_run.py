"""Schemathesis against a running Ivy, as both the gateway and the end-to-end suites run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["assert_no_server_error"]


def assert_no_server_error(
    base_url: str, report_dir: Path, *, max_examples: int, seed: int, timeout: float
) -> None:
    """Property-based requests generated from /openapi.json (valid and invalid bodies):
    none may answer 5xx, and every answer must match what the document says of its route
    (status code, content type, body schema). /v2/rerank is left out: it is /v1/rerank
    (/rerank, which also takes TEI's shape, is run)."""
    st = Path(sys.executable).with_name("st")
    result = subprocess.run(
        [
            str(st),
            "run",
            f"{base_url}/openapi.json",
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,"
            "response_schema_conformance",
            "--max-examples",
            str(max_examples),
            "--seed",
            str(seed),
            "--generation-database",
            "none",
            # One worker: Hypothesis in worker threads can trip CPython 3.11's AST
            # recursion check on nested schemas (python/cpython#106905).
            "--workers",
            "1",
            "--request-timeout",
            "60",
            "--exclude-path",
            "/v2/rerank",
            "--no-color",
            "--report-dir",
            str(report_dir),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
