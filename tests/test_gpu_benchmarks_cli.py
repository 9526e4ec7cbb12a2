"""The GPU kernel benchmarks (benchmarks/*_cuda_kernel*.py) on a machine without CuPy or a CUDA GPU: a one-line
reason and exit status 1, not a traceback; ``--help`` still works there."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["argmax_cuda_kernel.py", "attention_cuda_kernels.py", "dense_cuda_kernels.py", "moe_cuda_kernels.py",
           "norm_cuda_kernels.py"]


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_gpu_benchmark_without_cupy_says_what_it_needs(script):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip() == (f"{script}: needs CuPy and a CUDA GPU (ModuleNotFoundError: No module named "
                                "'cupy')")


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s != "argmax_cuda_kernel.py"])  # it takes no options
def test_a_gpu_benchmarks_help_needs_no_gpu(script):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: "), r.stderr
