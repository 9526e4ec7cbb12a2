"""Matcher/driver speed: rewrite's plugins against onnxscript's rewriter with comparable rules, side by side.

Graphs:

* ``qwen2_moe full``: the 24-layer Qwen1.5-MoE-A2.7B decoder graph, exported on the meta device
  (``OnnxConfig(dynamic=True, optimize=False)``; ~1 min, cached under ``.work/bench/``). Weights do not
  exist on meta: every initializer whose data is not available becomes a graph input of the same dtype and
  shape, so the structure (and every op the rules look at) is the real one.
* ``synthetic N``: N nodes (12.5k, 25k, 50k) of repeated blocks: an RMSNorm as transformers exports it
  (Pow, ReduceMean, Add eps, Sqrt, Reciprocal, Mul, Mul weight), an f16 MatMul, a Softmax whose f16->f32->f16
  Cast round trip the ``cast`` rule removes, a lossy f32->f16->f32 pair it must keep, and filler ops.

Comparable rules: rewrite's ``cast`` plugin and the ``rmsnorm`` example plugin
(``examples/third_party_plugin``) against onnxscript 0.7's ``cast_cast_rule`` and its RMSNorm fusion
(``rms_normalization_rules``), each applied to a fresh copy of the same graph; timed is the rewrite only
(graphs are loaded and typed beforehand, outside the timer), fastest of ``--repeat`` runs. Also timed:
every built-in plugin of rewrite on the full graph, one by one.

Run: ``python benchmarks/matcher_speed.py`` (needs ``pip install -e '.[bench]'`` and
``pip install -e examples/third_party_plugin``). Prints one table; figures go to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".work" / "bench"
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "examples" / "third_party_plugin" / "src"))


# --------------------------------------------------------------------- graphs
def full_qwen_graph() -> Path:
    """The full Qwen1.5-MoE-A2.7B graph without weights, constants folded (cached)."""
    folded = CACHE / "qwen2_moe_full_noweights_folded.onnx"
    if folded.exists():
        return folded
    import onnx_ir
    from onnxscript.optimizer import fold_constants

    # optimize=False leaves constant chains (ReduceMean axes = Reshape(Constant)) that neither tool's rules
    # see through: fold them once, as an optimizing export would
    program = onnx_ir.load(str(_exported_qwen_graph()))
    fold_constants(program)
    onnx_ir.save(program, str(folded))
    return folded


def _exported_qwen_graph() -> Path:
    path = CACHE / "qwen2_moe_full_noweights.onnx"
    if path.exists():
        return path
    import onnx_ir
    import qwen_moe
    from transformers.exporters.exporter_onnx import OnnxConfig, OnnxExporter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = qwen_moe.build_model("qwen2_moe", "full", device="meta")
        program = OnnxExporter().export(model, qwen_moe._decode_sample(model, 5, 2), OnnxConfig(dynamic=True, optimize=False)).program
    g = program.graph
    for name, v in list(g.initializers.items()):
        cv = v.const_value
        try:
            cv.numpy() if cv is not None else None
            real = cv is not None
        except Exception:  # noqa: BLE001 - a meta tensor has no data
            real = False
        if not real:  # weights: a graph input of the same dtype and shape
            g.initializers.pop(name)
            v.const_value = None
            g.inputs.append(v)
    CACHE.mkdir(parents=True, exist_ok=True)
    onnx_ir.save(program, str(path))
    return path


def synthetic(n_nodes: int) -> onnx.ModelProto:
    """About ``n_nodes`` nodes of 20-node blocks (see the module docstring); opset 23, hidden size 64."""
    H = 64
    nodes, inits = [], [
        numpy_helper.from_array(np.array([-1], np.int64), "axes"),
        numpy_helper.from_array(np.float32(2.0), "two"),
        numpy_helper.from_array(np.float32(1e-6), "eps"),
        numpy_helper.from_array(np.ones(H, np.float32), "w"),
        numpy_helper.from_array(np.ones((H, H), np.float16), "proj"),
    ]
    x = "x"
    for k in range(n_nodes // 20):
        p = f"b{k}_"
        nodes += [
            helper.make_node("Pow", [x, "two"], [p + "sq"]),
            helper.make_node("ReduceMean", [p + "sq", "axes"], [p + "ms"], keepdims=1),
            helper.make_node("Add", [p + "ms", "eps"], [p + "v"]),
            helper.make_node("Sqrt", [p + "v"], [p + "std"]),
            helper.make_node("Reciprocal", [p + "std"], [p + "inv"]),
            helper.make_node("Mul", [x, p + "inv"], [p + "n"]),
            helper.make_node("Mul", [p + "n", "w"], [p + "y"]),
            helper.make_node("Cast", [p + "y"], [p + "h"], to=TensorProto.FLOAT16),
            helper.make_node("MatMul", [p + "h", "proj"], [p + "mm"]),
            helper.make_node("Softmax", [p + "mm"], [p + "sm"], axis=-1),
            helper.make_node("Cast", [p + "sm"], [p + "up"], to=TensorProto.FLOAT),  # exact round trip
            helper.make_node("Cast", [p + "up"], [p + "dn"], to=TensorProto.FLOAT16),
            helper.make_node("Cast", [p + "dn"], [p + "f"], to=TensorProto.FLOAT),
            helper.make_node("Cast", [p + "f"], [p + "lossy16"], to=TensorProto.FLOAT16),  # f32->f16->f32: lossy
            helper.make_node("Cast", [p + "lossy16"], [p + "back"], to=TensorProto.FLOAT),
            helper.make_node("Relu", [p + "back"], [p + "r"]),
            helper.make_node("Neg", [p + "r"], [p + "ng"]),
            helper.make_node("Abs", [p + "ng"], [p + "ab"]),
            helper.make_node("Sigmoid", [p + "ab"], [p + "sg"]),
            helper.make_node("Add", [x, p + "sg"], [p + "out"]),
        ]
        x = p + "out"
    g = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, H])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 8, H])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)


# ---------------------------------------------------------------- the runners
def ours(model: onnx.ModelProto, plugins: list) -> tuple[float, int]:
    """Seconds to run ``plugins`` (rewrite_graph's loop, shapes already inferred) and total matches."""
    from rewrite.core import onnx_io
    from rewrite.core.driver import run_plugin
    from rewrite.core.shapes import infer_shapes

    g = onnx_io.load(model)
    infer_shapes(g)
    gc.collect()
    t = time.perf_counter()
    n = sum(run_plugin(g, p).matches for p in plugins)
    return time.perf_counter() - t, n


def onnxscript_rules(model: onnx.ModelProto) -> tuple[float, int]:
    """Seconds for onnxscript's RewriteRuleSet([cast_cast_rule, *rms_normalization_rules]) and its count."""
    import onnx_ir as ir
    from onnxscript.rewriter import pattern
    from onnxscript.rewriter.ort_fusions.rms_normalization import rms_normalization_rules
    from onnxscript.rewriter.rules.common._basic_rules import cast_cast_rule

    m = ir.from_proto(model)
    rules = pattern.RewriteRuleSet([cast_cast_rule, *rms_normalization_rules])
    gc.collect()
    t = time.perf_counter()
    n = rules.apply_to_model(m)
    return time.perf_counter() - t, n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="12500,25000,50000")
    ap.add_argument("--no-full", action="store_true", help="skip the full Qwen graph")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; the fastest is reported (shared machines)")
    args = ap.parse_args(argv)
    from rewrite.plugins.manager import available_plugins
    from rewrite_rmsnorm.plugin import RMSNormFusion

    cast = available_plugins()["cast"]
    graphs: list[tuple[str, onnx.ModelProto]] = []
    if not args.no_full:
        t = time.perf_counter()
        p = full_qwen_graph()
        graphs.append(("qwen2_moe full (24 layers)", onnx.load(p)))
        print(f"full graph: {p} ({time.perf_counter() - t:.1f} s to build or load)")
    for n in (int(s) for s in args.sizes.split(",")):
        graphs.append((f"synthetic {n // 1000}k", synthetic(n)))

    print(f"\n{'graph':<28} {'nodes':>7}  {'rewrite s':>9} {'matches':>7}  {'onnxscript s':>12} {'matches':>7}  {'ratio':>6}")
    for name, m in graphs:
        (t_ours, n_ours), (t_os, n_os) = (min(runs) for runs in zip(*(
            (ours(m, [cast, RMSNormFusion()]), onnxscript_rules(copy.deepcopy(m))) for _ in range(args.repeat))))
        print(f"{name:<28} {len(m.graph.node):>7}  {t_ours:>9.2f} {n_ours:>7}  {t_os:>12.2f} {n_os:>7}  {t_os / t_ours:>5.1f}x")

    if not args.no_full:
        print("\nevery built-in plugin on the full graph, one at a time (fresh copy each):")
        full = graphs[0][1]
        for short, plugin in available_plugins().items():
            if not type(plugin).__module__.startswith("rewrite.plugins."):
                continue
            try:
                t, n = min(ours(full, [plugin]) for _ in range(args.repeat))
                print(f"  {short:<10} {t:>7.2f} s  {n:>5} matches")
            except Exception as e:  # noqa: BLE001 - report and go on with the other plugins
                print(f"  {short:<10} error: {str(e).splitlines()[0][:150]}")


if __name__ == "__main__":
    main()
