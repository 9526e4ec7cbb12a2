"""A wheel built from the repository is the whole product: its plugins' kernel sources ship as package data, so a
non-editable install lowers ``topk`` and ``moe`` for IREE without the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = {"rewrite/plugins/moe/kernels/moe_cpu.c", "rewrite/plugins/moe/kernels/moe_cuda.cu",
           "rewrite/plugins/moe/kernels/moe_cuda.sm_80.ptx", "rewrite/plugins/router/kernels/router_topk.c",
           "rewrite/plugins/router/kernels/router_topk_cuda.cu", "rewrite/plugins/router/kernels/router_topk_cuda.sm_80.ptx"}


def _untracked_top_level(folder: str, names: list[str]) -> set[str]:
    """For copytree: at the checkout's top, what git does not track (local data beside the repository, which can
    be large); everything when git cannot tell."""
    if Path(folder) != ROOT:
        return set()
    r = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True)
    tracked = {p.split("/", 1)[0] for p in r.stdout.splitlines()} if r.returncode == 0 else set()
    return set(names) - tracked if tracked else set()


def test_a_wheel_holds_the_kernels_and_lowers_topk_for_iree_without_the_repo(tmp_path):
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ there
    skip = shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "tests", "benchmarks")
    shutil.copytree(ROOT, src, ignore=lambda folder, names: skip(folder, names) | _untracked_top_level(folder, names))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = tmp_path.glob("rewrite-*.whl")
    assert KERNELS <= set(zipfile.ZipFile(wheel).namelist())
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    script = textwrap.dedent(f"""
        import numpy as np, onnx, rewrite
        from onnx import TensorProto as TP, helper, numpy_helper
        assert rewrite.__file__.startswith({str(site)!r}), rewrite.__file__   # the installed copy, not the repo
        nodes = [helper.make_node("Softmax", ["logits"], ["p"], axis=-1), helper.make_node("TopK", ["p", "k"], ["w", "ids"], axis=-1)]
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("logits", TP.FLOAT, ["T", 8])],
                              [helper.make_tensor_value_info("w", TP.FLOAT, ["T", 2]), helper.make_tensor_value_info("ids", TP.INT64, ["T", 2])],
                              [numpy_helper.from_array(np.array([2], np.int64), "k")])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]); m.ir_version = 8
        onnx.save(m, "m.onnx")
        from rewrite.backends import load_runner
        from rewrite.pipeline import apply
        manifest = apply("m.onnx", "out", plugins="topk", backend="iree")
        assert manifest.report[0]["matches"] == 1 and manifest.kernel_objects
        print(load_runner("out").run({{"logits": np.arange(16, dtype=np.float32).reshape(2, 8)}})["ids"].tolist())
    """)
    env = {**os.environ, "PYTHONPATH": str(site), "REWRITE_KERNEL_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[[7, 6], [7, 6]]"


def test_every_shipped_ptx_was_built_from_its_source():
    """A machine without nvcc uses the PTX shipped beside a kernel only when its digest matches the source: an
    edit to a .cu without a rebuilt PTX would stop every iree:cuda lowering there."""
    from rewrite.core.kernels import DEFAULT_CUDA_ARCH, NVCC_FLAGS, PTX_HEADER, _digest, source_nvcc_flags

    sources = sorted((ROOT / "rewrite").rglob("kernels/*.cu"))
    assert sources
    for cu in sources:
        shipped = cu.with_name(f"{cu.stem}.{DEFAULT_CUDA_ARCH}.ptx")
        digest = _digest(cu, (*NVCC_FLAGS, *source_nvcc_flags(cu), f"-arch={DEFAULT_CUDA_ARCH}"))
        assert shipped.read_text().split("\n", 1)[0] == PTX_HEADER + digest, f"rebuild {shipped.name} (ship_cuda_ptx)"
