"""``benchmarks/decode_full.py``'s two steps on this machine's CPU, on the seed form at its tiny default size (the
full-size flow with ``_sizes`` patched): ``prepare`` compiles the bundle (``--target llvm-cpu``), ``run`` regenerates
the weights into ``--seed-dir`` (elsewhere than ``--work``), applies ``--module-from`` the bundle and measures
against ONNX Runtime CPU's reference; the results land in ``WORK/results``, the seed form only in the seed dir."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def decode_full(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import decode_full as module

    monkeypatch.setattr(module, "_sizes", lambda arch, max_seq, layers: {"max_seq": max_seq})
    monkeypatch.setattr(module, "PROMPT_LEN", 12)
    monkeypatch.setattr(module, "DECODE_STEPS", 6)
    monkeypatch.setattr(module, "CHECK_PROMPT", 4)
    monkeypatch.setattr(module, "CHECK_TOKENS", 3)
    yield module
    sys.modules.pop("decode_full", None)


@pytest.mark.slow
def test_prepare_then_run_with_the_seed_elsewhere(decode_full, tmp_path):
    bundle, seed_dir, work = tmp_path / "bundle", tmp_path / "shm" / "seed", tmp_path / "run"
    decode_full.prepare("qwen3_moe", bundle, tmp_path / "prep", 64, target="llvm-cpu", configs=["iree-plain"])
    assert (bundle / "iree-plain" / "model.vmfb").is_file() and not (bundle / "iree-plain" / "model.irpa").exists()
    assert json.loads((bundle / "bundle.json").read_text())["target"] == "llvm-cpu"
    status = decode_full.run(bundle, work, ["reference", "iree-plain"], threads=1, seed_dir=seed_dir)
    assert status == 0
    assert (seed_dir / "model.onnx.data").is_file() and not (work / "seed").exists()
    ref = json.loads((work / "results" / "reference.json").read_text())
    plain = json.loads((work / "results" / "iree-plain.json").read_text())
    assert len(ref["check_tokens"]) == len(plain["check_tokens"]) == 3
    assert len(plain["tokens"]) == 6 and plain["decode_tok_s"] > 0
    assert not (work / "iree-plain.measured").exists()  # each folder deleted once measured


@pytest.mark.slow
def test_the_float32_reference_checks_the_reference_and_every_configuration(decode_full, tmp_path, capsys):
    bundle, work = tmp_path / "bundle", tmp_path / "run"
    decode_full.prepare("qwen2_moe", bundle, tmp_path / "prep", 64, target="llvm-cpu", configs=["ort"])
    status = decode_full.run(bundle, work, ["reference", "reference-fp32", "ort"], threads=1, keep=True)
    assert status == 0
    results = work / "results"
    ref32 = json.loads((results / "reference-fp32.json").read_text())
    ort_cpu = json.loads((results / "ort.json").read_text())
    assert len(ref32["check_tokens"]) == 3 and (results / "reference_fp32_logits.npy").is_file()
    # the fp16 reference and ONNX Runtime CPU on the lowered graph, each teacher-forced against the float32 twin:
    # the tiny model's logits are far from ties, so fp16 rounding moves them by well under 1% and no token
    for c in (ref32["check_logits_fp32"], ort_cpu["check_logits_fp32"]):
        assert len(c["max_rel"]) == 3 and 0 < max(c["max_rel"]) < 1e-2 and all(c["top1_equal"])
    assert 0 < max(ort_cpu["check_logits"]["max_rel"]) < 1e-2
    left = sorted(p.name for p in (work / "reference-fp32.measured").iterdir())  # kept: the twin is gone from it
    assert "model.onnx" in left and not [n for n in left if n.startswith("model.fp32")]
    out = capsys.readouterr().out
    assert "float32 reference (the quantized model widened, ONNX Runtime CPU)" in out
    assert "against float32: tokens equal" in out
