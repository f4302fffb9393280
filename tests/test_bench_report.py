"""The machine line every bench report carries: it must tell CPU generations apart."""

from __future__ import annotations

import os
from pathlib import Path

from bench.report import machine

ZEN5 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu sse avx2 avx512f avx512bw avx_vnni avx512_bf16 avx512_vnni

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 99
model\t\t: 99
model name\t: not the first block
flags\t\t: amx_tile
"""

OLD_XEON = """processor\t: 0
cpu family\t: 6
model\t\t: 63
model name\t: Intel(R) Xeon(R) CPU E5-2680 v3
flags\t\t: fpu sse avx avx2 fma
"""


def test_the_machine_line_names_family_model_and_the_kernel_deciding_features(
    tmp_path: Path,
) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(ZEN5)
    line = machine(info)
    assert line == (
        "AMD EPYC (family 26 model 2; avx512f avx512_bf16 avx512_vnni); "
        f"{os.cpu_count()} logical CPUs"
    )


def test_a_cpu_without_avx512_says_so(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(OLD_XEON)
    assert machine(info).startswith(
        "Intel(R) Xeon(R) CPU E5-2680 v3 (family 6 model 63; no AVX-512)"
    )


def test_an_unreadable_cpuinfo_still_gives_a_line(tmp_path: Path) -> None:
    assert "family ? model ?" in machine(tmp_path / "missing")
