"""Graph maintenance at full-model sizes: removing unused initializers.

A full Qwen3-30B-A3B export holds tens of thousands of initializers before its experts are stacked. The
per-initializer scan this replaced asked ``Graph.uses`` once per initializer (each call walks every edge out of
the SOURCE pseudo node) and removed from a list one name at a time: quadratic. This measures, side by side in
one run on the same graphs, that scan and ``Graph.remove_unused_initializers`` (one pass over SOURCE's edges).

    python benchmarks/graph_maintenance.py [--sizes 4000,16000]   (the old scan takes ~17 minutes at 50000)

Each graph has N initializers of 4 floats, N Add nodes each reading one of them, and half of the nodes removed
before the measurement, so N/2 initializers are unused.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from rewrite.core import onnx_io


def build(n: int):
    """A chain x -> Add(., w_i) -> ... of ``n`` Adds, each with its own initializer; then every other Add
    removed (its input wired to its output's reader), leaving n/2 initializers unused."""
    nodes, inits, prev = [], [], "x"
    for i in range(n):
        inits.append(numpy_helper.from_array(np.full(4, i, np.float32), f"w{i}"))
        nodes.append(helper.make_node("Add", [prev, f"w{i}"], [f"a{i}"], name=f"add{i}"))
        prev = f"a{i}"
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [4])], inits)
    graph = onnx_io.load(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))
    for node in [nd for nd in graph.topo_nodes() if int(nd.name[3:]) % 2 == 1]:
        graph.replace_all_uses(node.outputs[0], node.inputs[0])
        graph.remove_node(node)
    return graph


def per_initializer_scan(graph) -> int:
    """The replaced algorithm: one ``uses`` call and one ``list.remove`` per initializer."""
    dead = [i for i in graph.initializers if not graph.uses(i) and i not in graph.inputs]
    for i in dead:
        graph.initializers.remove(i)
        del graph.values[i]
        del graph.producer[i]
    return len(dead)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4000,16000")
    args = ap.parse_args()
    print(f"{'initializers':>12} {'removed':>8} {'per-initializer scan s':>23} {'one pass s':>11} {'ratio':>8}")
    for n in map(int, args.sizes.split(",")):
        g1, g2 = build(n), build(n)
        t0 = time.perf_counter()
        r1 = per_initializer_scan(g1)
        t1 = time.perf_counter()
        r2 = g2.remove_unused_initializers()
        t2 = time.perf_counter()
        assert r1 == r2 and g1.initializers == g2.initializers
        print(f"{n:>12} {r2:>8} {t1 - t0:>23.3f} {t2 - t1:>11.4f} {(t1 - t0) / (t2 - t1):>7.0f}x")


if __name__ == "__main__":
    main()
