"""A model past protobuf's 2 GB: one 2.2 GB initializer in external data, written without ever holding a
serialized proto. Both backends lower it and compute x @ W (IREE's importer takes its large-model path: before,
it serialized the whole model and failed with EncodeError)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from rewrite.backends import load_runner
from rewrite.pipeline import apply

N, M = 16384, 33792  #: W is N x M float32: 2,214,592,512 bytes


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("big")
    w = np.memmap(d / "big.onnx.data", np.float32, "w+", shape=(N, M))  # zeros on disk, a few rows set
    w[0, :] = 1.0
    w[3, :5] = np.arange(5, dtype=np.float32)
    w[N - 1, M - 1] = -2.0
    w.flush()
    del w
    t = onnx.TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[N, M], data_location=TensorProto.EXTERNAL)
    for k, v in (("location", "big.onnx.data"), ("offset", "0"), ("length", str(N * M * 4))):
        e = t.external_data.add()
        e.key, e.value = k, v
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, N])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, M])], [t])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.save(m, d / "big.onnx")
    return d / "big.onnx"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_a_model_over_2gb_lowers_and_runs(big_model, tmp_path, backend):
    apply(big_model, tmp_path / "out", backend=backend)
    x = np.zeros((1, N), np.float32)
    x[0, 0], x[0, 3], x[0, N - 1] = 0.5, 2.0, 1.0
    want = np.full((1, M), 0.5, np.float32)
    want[0, :5] += 2.0 * np.arange(5)
    want[0, M - 1] -= 2.0
    got = load_runner(tmp_path / "out").run({"x": x})["y"]
    np.testing.assert_array_equal(got, want)
