"""Stateful KV cache on IREE: the model's cache inputs/outputs become one module-level ``util.global``.

Seed 000, "Stateful KV Cache": passing every layer's cache in and out of the compiled function costs copies
of all of it per call (5.6 ms + 4.4 ms per step on the seed's GPU); keeping it in the VM module state gave
+49% decode speed. All caches live in ONE combined global ``tensor<N x S...>`` (``N`` = number of cache
tensors, entry ``k`` = the ``k``-th (past, present) pair): two globals with equal initial values are merged
by iree-compile 3.13 and then alias (seed: "IREE aliases the insert_slice destination to the global's
storage"; reproduced on iree-compile 3.13 with two globals of equal initial values).

:func:`make_stateful` patches the importer's MLIR text of the entry function:

* each past argument ``%argK`` is removed from the signature and defined at the top of the body as
  ``tensor.extract_slice`` of ``util.global.load @rewrite_kv_state`` (converted with
  ``torch_c.from_builtin_tensor``);
* each present result is removed from ``return``. A present computed by ``KVCacheUpdate`` of its own past
  (the ``kv`` plugin) becomes "insert this call's new rows into the global at (slot, position), read the
  present back as a slice of it", so no layer's whole cache is copied out of and back into the global;
  any other present is written back whole with ``tensor.insert_slice``. The global is stored once
  (``util.global.store``) before the return;
* a public function ``@rewrite_kv_state_get() -> tensor<N x ...>`` returns the global (for tests and tools).

The function then takes the remaining inputs (token ids, position) and returns the remaining outputs
(logits). The state starts at zeros; :meth:`rewrite.backends.iree_toolchain.IreeModule.reset` restores that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rewrite.backends.iree_patch import split_resources
from rewrite.core.iree_lowering import VTensor, insert_rows_mlir, split_types
from rewrite.core.interface import cache_pairs
from rewrite.errors import BackendError

STATE_GLOBAL = "rewrite_kv_state"
STATE_GETTER = "rewrite_kv_state_get"


@dataclass
class StateSpec:
    """One combined state global, as recorded in the manifest's ``state`` list.

    Attributes:
        name: the ``util.global`` symbol.
        getter: public function returning the whole global.
        shape: ``[N, *entry shape]``; ``dtype`` the ONNX element type name (``FLOAT``...).
        entries: per slot ``k``: ``{"input": past name, "output": present name}``.
        axis: the cache entries' sequence axis (``S = shape[1 + axis]`` positions), None when unknown.
    """

    name: str
    getter: str
    shape: list[int]
    dtype: str
    entries: list[dict] = field(default_factory=list)
    axis: int | None = None

    def to_json(self) -> dict:
        return dict(name=self.name, getter=self.getter, shape=self.shape, dtype=self.dtype, entries=self.entries, axis=self.axis)


_FUNC_RE = r'^(?P<indent>\s*)func\.func\s+(?:public\s+)?@(?:"{q}"|{q})\((?P<args>.*?)\)\s*->\s*(?P<res>\(.*?\)|!torch\.vtensor<[^>]*>)\s*(?P<attrs>attributes\s*\{{.*\}})?\s*\{{\s*$'


def make_stateful(mlir: str, function: str, input_names: list[str], output_names: list[str],
                  pairs: list[tuple[str, str]], onnx_dtype: str, axis: int | None = None) -> tuple[str, StateSpec]:
    """Move the cache tensors of ``pairs`` ((input name, output name), in slot order) into module state.

    ``input_names``/``output_names``: the entry function's arguments/results in order (graph inputs
    without initializers, graph outputs). Every paired tensor must have the same static type.

    When ``axis`` is given and a present is ``KVCacheUpdate(past, update, position)`` of its own past (the
    patched ``func.call @rewrite_KVCacheUpdate_*``), only the ``update`` rows are written into the global
    (at slot, ``position``) and the present is read back as a slice of it: no copy of the whole entry in and out.

    Returns (patched MLIR, the state's :class:`StateSpec`).

    Raises:
        BackendError: the entry function or a name is not found, a cache type is dynamic, or types differ.
    """
    module, trailer = split_resources(mlir)
    m = re.search(_FUNC_RE.format(q=re.escape(function)), module, re.M)
    if m is None:
        raise BackendError(f"stateful: entry function @{function} not found in the imported MLIR")
    args = split_types(m.group("args"))
    res_types = split_types(m.group("res")) if m.group("res").startswith("(") else [m.group("res")]
    if len(args) != len(input_names) or len(res_types) != len(output_names):
        raise BackendError(f"stateful: @{function} has {len(args)} args/{len(res_types)} results, the model {len(input_names)} inputs/{len(output_names)} outputs")
    arg_names = [a.split(":", 1)[0].strip() for a in args]
    arg_types = [a.split(":", 1)[1].strip() for a in args]
    slots = []
    for past, present in pairs:
        if past not in input_names or present not in output_names:
            raise BackendError(f"stateful: cache pair ({past}, {present}) is not an (input, output) of the model")
        i, o = input_names.index(past), output_names.index(present)
        t_in, t_out = VTensor.parse(arg_types[i]), VTensor.parse(res_types[o])
        if None in t_in.dims or t_in.text != t_out.text:
            raise BackendError(f"stateful: cache '{past}' -> '{present}' has type {t_in.text} -> {t_out.text}; a static, unchanged type is needed (run the kv plugin with --max-seq)")
        slots.append((i, o, t_in))
    entry = slots[0][2]
    if any(t.text != entry.text for _, _, t in slots):
        raise BackendError("stateful: cache tensors differ in type; one combined global needs equal types")
    n, r = len(slots), len(entry.dims)
    gtype = "tensor<" + "x".join(str(d) for d in [n, *entry.dims]) + "x" + entry.builtin_element + ">"
    zero = "0.0" if entry.builtin_element.startswith(("f", "bf")) else "0"
    state_args = {i for i, _, _ in slots}
    state_res = {o for _, o, _ in slots}

    new_args = ", ".join(a for k, a in enumerate(args) if k not in state_args)
    kept_res = [t for k, t in enumerate(res_types) if k not in state_res]
    head = f"{m.group('indent')}func.func @{_sym(function)}({new_args}) -> ({', '.join(kept_res)})"
    if m.group("attrs"):
        head += " " + m.group("attrs")
    head += " {"
    ones = ", ".join("1" for _ in range(r + 1))
    sizes = ", ".join(["1", *(str(d) for d in entry.dims)])
    load = [f"    %rw_state = util.global.load @{STATE_GLOBAL} : {gtype}"]
    for k, (i, _, t) in enumerate(slots):
        offs = ", ".join([str(k)] + ["0"] * r)
        load += [f"    %rw_past{k} = tensor.extract_slice %rw_state[{offs}] [{sizes}] [{ones}] : {gtype} to {t.builtin}",
                 f"    {arg_names[i]} = torch_c.from_builtin_tensor %rw_past{k} : {t.builtin} -> {t.text}"]
    body_start = m.end()
    # the entry function's return: the first `return` after its header (patched-in wrappers come after it)
    ret_re = re.compile(r"^(?P<ind>\s*)return (?P<vals>[^:]+?)\s*:\s*(?P<types>.+)$", re.M)
    ret = ret_re.search(module, body_start)
    if ret is None:
        raise BackendError(f"stateful: no return in @{function}")
    vals = [v.strip() for v in ret.group("vals").split(",")]
    body = module[body_start: ret.start()]
    direct: list[tuple[int, re.Match]] = []
    for k, (i, o, t) in enumerate(slots if axis is not None else []):
        call = re.search(rf"^\s*{re.escape(vals[o])} = func\.call @rewrite_KVCacheUpdate_\d+\({re.escape(arg_names[i])}, "
                         r"(?P<u>%[\w#.]+), (?P<p>%[\w#.]+)\) : \((?P<types>.*)\) -> .*$", body, re.M)
        if call is not None:
            direct.append((k, call))
    cur = "%rw_state"
    pieces, last = [], 0
    for k, call in sorted(direct, key=lambda kc: kc[1].start()):
        t_u, t_p = (VTensor.parse(x) for x in split_types(call.group("types"))[1:3])
        t = slots[k][2]
        offs = ", ".join([str(k)] + ["0"] * r)
        lines = [f"    %rw_u{k} = torch_c.to_builtin_tensor {call.group('u')} : {t_u.text} -> {t_u.builtin}",
                 f"    %rw_pos{k} = torch_c.to_builtin_tensor {call.group('p')} : {t_p.text} -> {t_p.builtin}",
                 insert_rows_mlir(f"rw_w{k}", cur, gtype, [str(k)], f"%rw_u{k}", t_u, f"%rw_pos{k}", t_p, t.dims[axis], axis, f"%rw_statew{k}"),
                 f"    %rw_e{k} = tensor.extract_slice %rw_statew{k}[{offs}] [{sizes}] [{ones}] : {gtype} to {t.builtin}",
                 f"    {vals[slots[k][1]]} = torch_c.from_builtin_tensor %rw_e{k} : {t.builtin} -> {t.text}"]
        pieces += [body[last: call.start()], "\n".join(lines)]
        last = call.end()
        cur = f"%rw_statew{k}"
    body = "".join(pieces) + body[last:]
    store = []
    done = {k for k, _ in direct}
    for k, (_, o, t) in enumerate(slots):
        if k in done:
            continue
        offs = ", ".join([str(k)] + ["0"] * r)
        store += [f"    %rw_present{k} = torch_c.to_builtin_tensor {vals[o]} : {t.text} -> {t.builtin}",
                  f"    %rw_state{k + 1} = tensor.insert_slice %rw_present{k} into {cur}[{offs}] [{sizes}] [{ones}] : {t.builtin} into {gtype}"]
        cur = f"%rw_state{k + 1}"
    store.append(f"    util.global.store {cur}, @{STATE_GLOBAL} : {gtype}")
    kept_vals = [v for k, v in enumerate(vals) if k not in state_res]
    store.append(f"{ret.group('ind')}return {', '.join(kept_vals)} : {', '.join(kept_res)}")
    new = (module[: m.start()] + f"  util.global private mutable @{STATE_GLOBAL} = dense<{zero}> : {gtype}\n"
           + head + "\n" + "\n".join(load) + body + "\n".join(store) + module[ret.end():])
    end = new.rstrip().rfind("}")
    opset = re.search(r"torch\.onnx_meta\.opset_version = (\d+)", module)
    attrs = f" attributes {{torch.onnx_meta.opset_version = {opset.group(1)} : si64}}" if opset else ""  # the torch input pipeline wants it on every function
    getter = (f"  func.func @{STATE_GETTER}() -> {gtype}{attrs} {{\n    %s = util.global.load @{STATE_GLOBAL} : {gtype}\n"
              f"    return %s : {gtype}\n  }}\n")
    new = new[:end] + getter + new[end:]
    spec = StateSpec(STATE_GLOBAL, STATE_GETTER, [n, *entry.dims], onnx_dtype,
                     [{"input": input_names[i], "output": output_names[o]} for i, o, _ in slots])
    return new + trailer, spec


def _sym(name: str) -> str:
    return name if re.fullmatch(r"[\w$.\-]+", name) else '"' + name.replace('"', '\\"') + '"'


def make_module_stateful(mlir_path, function: str, manifest, graph) -> StateSpec:
    """Patch ``mlir_path`` in place with :func:`make_stateful` for every static KV cache pair of the model (found
    from what the graph computes, :func:`rewrite.core.interface.cache_pairs`); record the state in ``manifest.state`` and drop the cache tensors from
    ``manifest.inputs``/``outputs``. The sequence axis is the one dim where a KVCacheUpdate writes, when the
    ``kv`` plugin ran (else None).

    Raises:
        BackendError: the model has no cache pairs, or :func:`make_stateful` refuses.
    """
    ins = [d["name"] for d in manifest.inputs]
    outs = [d["name"] for d in manifest.outputs]
    found = cache_pairs(graph)
    pairs = [(p.past, p.present) for p in found if p.kind == "kv-static" and p.past in ins and p.present in outs]
    if not pairs:
        growing = [p.past for p in found if p.kind == "kv-growing"]
        if growing:
            raise BackendError(f"--stateful: the KV cache '{growing[0]}' grows by a Concat each call; a static, unchanged "
                               f"type is needed: add --max-seq N (the kv plugin's static cache)")
        raise BackendError(f"--stateful: no static KV cache (past input written into a present output) in the model (inputs: {', '.join(ins)})")
    dtype = next(d["dtype"] for d in manifest.inputs if d["name"] == pairs[0][0])
    axes = {n.attr("axis") for n in graph.nodes.values() if n.op_type == "KVCacheUpdate"}
    axis = axes.pop() if len(axes) == 1 else None
    mlir, spec = make_stateful(mlir_path.read_text(), function, ins, outs, pairs, dtype, axis)
    spec.axis = axis
    mlir_path.write_text(mlir)
    state_in, state_out = {p for p, _ in pairs}, {o for _, o in pairs}
    manifest.inputs = [d for d in manifest.inputs if d["name"] not in state_in]
    manifest.outputs = [d for d in manifest.outputs if d["name"] not in state_out]
    manifest.state = [spec.to_json()]
    return spec
