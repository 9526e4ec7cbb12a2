"""Seeded full-size exports (examples/seeded_weights.py, qwen_moe.export_seeded), checked at tiny size: the graph
is transformers' own export, its weights are the generator's, and another machine regenerates the same bytes."""

from __future__ import annotations

import filecmp
import json
import shutil

import numpy as np
import onnx
import pytest
import torch

import qwen_moe
import seeded_weights

pytestmark = pytest.mark.slow


def _reference_model(arch: str, seed: int) -> torch.nn.Module:
    """`build_model`'s tiny model with every parameter set from the generator (the weights the export holds)."""
    model = qwen_moe.build_model(arch, "tiny", torch.float32)
    params = list(model.named_parameters())
    slots = seeded_weights.layout((n, p.shape, onnx.TensorProto.FLOAT) for n, p in params)
    with torch.no_grad():
        for slot, (_, p) in zip(slots, params):
            p.copy_(torch.from_numpy(seeded_weights.tensor_values(seed, slot).copy()))
    return model


@pytest.mark.parametrize("arch,inline_limit", [("qwen2_moe", 4096), ("qwen3_moe", None)])
def test_seeded_export_matches_torch_and_regenerates_byte_for_byte(tmp_path, monkeypatch, arch, inline_limit):
    # with a small limit every constant the exporter derives from a parameter goes to the data file (as at full
    # size, where they are hundreds of MB), so regeneration must rebuild copies and transposes too; with the
    # default one the small derived constants stay inline in model.onnx
    if inline_limit is not None:
        monkeypatch.setattr(qwen_moe, "_INLINE_SEEDED_LIMIT", inline_limit)
    path = qwen_moe.export_seeded(arch, "tiny", torch.float32, tmp_path / "a", seed=3)
    model = onnx.load(str(path), load_external_data=False)
    meta = json.loads({p.key: p.value for p in model.metadata_props}[seeded_weights.METADATA_KEY])
    assert meta["seed"] == 3
    perms = [tuple(perm) for _, perm in meta["derived"].values()]
    if inline_limit is not None:
        assert any(p != tuple(range(len(p))) for p in perms), "no transposed weight was derived"
        big = [t.name for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL and t.ByteSize() > 4096 + 64]
        assert big == []
    else:
        assert meta["derived"] == {}
        inline = [t for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL and len(t.dims) == 2]
        assert inline and all(np.abs(onnx.numpy_helper.to_array(t)).max() > 0 for t in inline)  # not zeroed

    (tmp_path / "b").mkdir()
    shutil.copy(path, tmp_path / "b" / "model.onnx")
    seeded_weights.regenerate(tmp_path / "b" / "model.onnx", threads=1)  # the seed comes from the metadata
    assert filecmp.cmp(tmp_path / "a" / "model.onnx.data", tmp_path / "b" / "model.onnx.data", shallow=False)

    report = qwen_moe.check_export(_reference_model(arch, 3), path, steps=3)
    assert report["tokens_ort"] == report["tokens_torch"]
    assert report["max_rel_logits"] < 1e-4, report


def test_values_do_not_depend_on_threads_or_order(tmp_path):
    slots = seeded_weights.layout([("a.mlp.gate.weight", (7, 33), onnx.TensorProto.FLOAT16),
                                   ("b.weight", (5, 1000), onnx.TensorProto.BFLOAT16),
                                   ("c.input_layernorm.weight", (9,), onnx.TensorProto.FLOAT)])
    assert [s.offset % seeded_weights.ALIGN for s in slots] == [0, 0, 0]
    seeded_weights.write(tmp_path / "one", slots, 1, threads=1)
    seeded_weights.write(tmp_path / "two", list(reversed(slots)), 1, threads=3)
    assert filecmp.cmp(tmp_path / "one", tmp_path / "two", shallow=False)
    router, dense, norm = (seeded_weights.tensor_values(1, s) for s in slots)
    assert np.all(norm == 1.0)
    # uniform with the stated std: router decisive, the rest small
    assert 0.4 < router.std() < 0.6 and 0.015 < dense.std() < 0.025
    # bfloat16 is the float32 value rounded to nearest even (torch's conversion)
    want = torch.from_numpy(_float32_values(1, slots[1]).copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = np.fromfile(tmp_path / "one", np.uint16, count=5000, offset=slots[1].offset)
    np.testing.assert_array_equal(got, want.reshape(-1))


def _float32_values(seed: int, slot: seeded_weights.TensorSlot) -> np.ndarray:
    as_f32 = seeded_weights.TensorSlot(slot.name, slot.shape, onnx.TensorProto.FLOAT, 0, slot.length * 2)
    return seeded_weights.tensor_values(seed, as_f32)


def test_bfloat16_export_regenerates_byte_for_byte(tmp_path, monkeypatch):
    """bf16 (Qwen3-30B-A3B's dtype): parameters compared and written as bit patterns (numpy has no bfloat16)."""
    monkeypatch.setattr(qwen_moe, "_INLINE_SEEDED_LIMIT", 4096)
    path = qwen_moe.export_seeded("qwen3_moe", "tiny", torch.bfloat16, tmp_path / "a")
    model = onnx.load(str(path), load_external_data=False)
    assert {t.data_type for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL} == {onnx.TensorProto.BFLOAT16}
    assert json.loads({p.key: p.value for p in model.metadata_props}[seeded_weights.METADATA_KEY])["derived"]
    (tmp_path / "b").mkdir()
    shutil.copy(path, tmp_path / "b" / "model.onnx")
    seeded_weights.regenerate(tmp_path / "b" / "model.onnx")
    assert filecmp.cmp(tmp_path / "a" / "model.onnx.data", tmp_path / "b" / "model.onnx.data", shallow=False)
