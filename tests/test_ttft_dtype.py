"""The TTFT benchmark computes in bfloat16 only where the CPU does bfloat16 natively
(``benchmarks/vllm_ttft.default_dtype``): on a CPU that would emulate it, one 16K-token prefill
outlasts vLLM's own 300 s step limit, so the benchmark could not run at all there."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import vllm_ttft

AVX2_ONLY = (
    "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma avx_vnni\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma\n"
)


@pytest.mark.parametrize("flag", vllm_ttft.BF16_FLAGS)
def test_native_bf16_keeps_bf16(tmp_path: Path, flag: str) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(AVX2_ONLY.replace("avx2 fma", f"avx2 avx512f {flag} fma"))
    dtype, why = vllm_ttft.default_dtype(info)
    assert dtype == "bfloat16"
    assert flag in why


def test_emulated_bf16_computes_in_float32(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(AVX2_ONLY)
    dtype, why = vllm_ttft.default_dtype(info)
    assert dtype == "float32"
    assert "none of" in why


def test_arm_features_line(tmp_path: Path) -> None:
    """aarch64 kernels list their flags under ``Features`` (``bf16``: ARMv8.6's bfloat16)."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert vllm_ttft.default_dtype(info) == ("bfloat16", "the CPU has bf16")
    info.write_text("processor\t: 0\nFeatures\t: fp asimd\n")
    assert vllm_ttft.default_dtype(info)[0] == "float32"


def test_unreadable_cpuinfo_keeps_bf16(tmp_path: Path) -> None:
    dtype, why = vllm_ttft.default_dtype(tmp_path / "missing")
    assert dtype == "bfloat16"
    assert "unreadable" in why


def test_cli_rejects_an_unknown_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        vllm_ttft.main(["--dtype", "float16"])
    assert "float16" in capsys.readouterr().err
