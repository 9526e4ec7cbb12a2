"""examples/qwen_moe.py: tiny Qwen MoE models export with dynamic axes and match PyTorch on ONNX Runtime."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import qwen_moe  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "dtype", "max_rel"),
    [
        ("qwen2_moe", torch.float32, 1e-4),
        ("qwen3_moe", torch.float32, 1e-4),
        ("qwen2_moe", torch.float16, 1e-2),
    ],
    ids=["qwen2_moe-fp32", "qwen3_moe-fp32", "qwen2_moe-fp16"],
)
def test_export_matches_torch(tmp_path, request, arch, dtype, max_rel):
    model = qwen_moe.build_model(arch, "tiny", dtype)
    if dtype == torch.float32:  # the session's export of the same seeded model (tests only read its folder)
        path = request.getfixturevalue(f"{arch}_tiny")
    else:
        path = qwen_moe.export_hf(model, tmp_path)
    assert [p.name for p in path.parent.iterdir()] == ["model.onnx"]

    result = qwen_moe.check_export(model, path, steps=4, prompt_len=5)

    assert result["max_rel_logits"] < max_rel, result
    assert result["tokens_ort"] == result["tokens_torch"], result
    assert len(result["tokens_ort"]) == 4


def test_decode_loop_feeds_presents_back():
    """One prefill on an empty past, then single-token steps with the previous presents as past."""
    input_names = ["input_ids", "attention_mask", "position_ids",
                   "past_key_values.layers.0.keys", "past_key_values.layers.0.values"]
    output_names = ["logits", "cache.layers.0.keys", "cache.layers.0.values"]
    seen = []

    def run(feeds):
        seen.append(feeds)
        new = feeds["input_ids"].shape[1]
        grow = np.ones((1, 2, new, 8), np.float32)
        logits = np.zeros((1, new, 16), np.float32)
        logits[0, -1, feeds["position_ids"][0, -1] + 1] = 1.0  # next token = last position + 1
        return {"logits": logits,
                "cache.layers.0.keys": np.concatenate([feeds["past_key_values.layers.0.keys"], grow], axis=2),
                "cache.layers.0.values": np.concatenate([feeds["past_key_values.layers.0.values"], grow], axis=2)}

    tokens, logits = qwen_moe.greedy_decode(run, input_names, output_names, [3, 4, 5], 3, (2, 8), np.float32)

    assert tokens == [3, 4, 5]
    assert [l.shape for l in logits] == [(1, 3, 16), (1, 1, 16), (1, 1, 16)]
    assert seen[0]["past_key_values.layers.0.keys"].shape == (1, 2, 0, 8)
    assert seen[2]["past_key_values.layers.0.values"].shape == (1, 2, 4, 8)
    np.testing.assert_array_equal(seen[2]["attention_mask"], np.ones((1, 5), np.int64))
    np.testing.assert_array_equal(seen[2]["position_ids"], [[4]])
    np.testing.assert_array_equal(seen[2]["input_ids"], [[4]])


@pytest.mark.parametrize(("arch", "params"), [("qwen2_moe", 14_315_784_192), ("qwen3_moe", 30_532_122_624)])
def test_full_size_builds_on_meta(arch, params):
    model = qwen_moe.build_model(arch, "full", torch.float16, device="meta")
    assert model.device.type == "meta" and model.dtype == torch.float16
    assert sum(p.numel() for p in model.parameters()) == params


def test_unknown_arch_or_size():
    with pytest.raises(ValueError, match="qwen2_moe, qwen3_moe"):
        qwen_moe.build_model("llama")
    with pytest.raises(ValueError, match="tiny, mid, full"):
        qwen_moe.build_model("qwen2_moe", "huge")
