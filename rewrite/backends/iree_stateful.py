"""Stateful KV cache on IREE: the model's cache inputs/outputs become module-level ``util.global`` ops.

Seed 000, "Stateful KV Cache": passing every layer's cache in and out of the compiled function costs copies
of all of it per call (5.6 ms + 4.4 ms per step on the seed's GPU); keeping it in the VM module state gave
+49% decode speed. The caches live in a few combined globals ``tensor<N_j x S...>`` (entry ``k`` of the model =
the ``k``-th (past, present) pair, slots in order, split into groups of :data:`MAX_SLOTS_PER_GLOBAL` or fewer; caches
of another type, such as DeepSeek-V3's MLA values beside its keys, in groups of their own):

* not one global per cache: two globals with equal initial values are merged by iree-compile 3.13 and then
  alias (seed: "IREE aliases the insert_slice destination to the global's storage"; reproduced on
  iree-compile 3.13 with two globals of equal initial values). The groups therefore have distinct sizes
  ``N_0 > N_1 > ...``, so no two globals have the same type;
* not one global for all caches: each write threads the global's value to the next, and iree-compile 3.13's
  stream resource usage analysis fails ("failed to solve for usage analysis") once that chain is long:
  48 caches in one global compile, 60 do not (a 30-layer decoder), on llvm-cpu and cuda alike.

:func:`make_stateful` rewrites the entry function through the MLIR bindings (:mod:`rewrite.backends.mlir`); what
it adds is a set of small private functions, parsed in the module's context, that iree-compile inlines:

* each past argument is removed from the signature; its uses read ``@rewrite_kv_state_slot_<k>`` (a
  ``tensor.extract_slice``) of its group's global, loaded once at the top (``util.global.load``);
* each present result is removed from ``return``. A present computed by ``KVCacheUpdate`` of its own past
  (the ``kv`` plugin's ``func.call @rewrite_KVCacheUpdate_*``) becomes ``@rewrite_kv_state_write_<k>``: insert this
  call's new rows into the group's global at (slot, position) and read the present back as a slice of it, so
  no layer's whole cache is copied out of and back into the global; any other present is written back whole
  (``@rewrite_kv_state_put_<k>``, ``tensor.insert_slice``). Each global is stored once before the return
  (``util.global.store``; load and store are the entry function's own ops: iree-compile's torch conversion
  refuses a ``util.global.store`` in a private function);
* on CUDA, when the step reads the new rows apart from the cache as loaded (the ``attention`` plugin), the writes of
  up to :data:`MAX_ROWS_PER_WRITE` consecutive slots of one global are one dispatch of ``kernels/state_rows_cuda.cu``
  (``@rewrite_kv_state_rows_<c>``, the global tied in place) instead of an ``iree_linalg_ext.scatter`` each: a
  decode step of Qwen3-30B-A3B launched 96 scatters, one per K and V cache;
* per global a public getter returns it (``@rewrite_kv_state_get``, ``@rewrite_kv_state_<j>_get``; for
  tests and tools).

The function then takes the remaining inputs (token ids, position) and returns the remaining outputs
(logits). The state starts at zeros; :meth:`rewrite.backends.iree_toolchain.IreeModule.reset` restores that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from iree.compiler import ir
from iree.compiler.dialects import func, util

from rewrite.backends.mlir import MlirModule
from rewrite.core.iree_lowering import PatchContext, VTensor, cuda_executable_source, insert_rows_mlir
from rewrite.core.kernels import build_cuda_ptx, kernel_source
from rewrite.core.interface import cache_pairs
from rewrite.errors import BackendError

STATE_GLOBAL = "rewrite_kv_state"  #: the first group's global; group j > 0: ``rewrite_kv_state_<j>``
_HELPER = "rewrite_kv_state_"  #: prefix of the private helper functions
KV_UPDATE_CALL = "rewrite_KVCacheUpdate_"  #: the patched KVCacheUpdate wrappers (rewrite.backends.iree_patch)
MAX_SLOTS_PER_GLOBAL = 32  #: caches per global; 48 still compile on iree-compile 3.13, 60 do not (module docstring)
#: cache slots one state-rows dispatch writes: IREE 3.13's CUDA driver takes at most 16 bindings a dispatch
#: (IREE_HAL_CUDA_MAX_DISPATCH_BINDING_COUNT), here the position, the rows of each slot and the global
MAX_ROWS_PER_WRITE = 14
MAX_GRID_Y = 65535  #: CUDA's largest grid y: a state-rows dispatch takes one workgroup per updated row there
ROWS_EXECUTABLE = "rewrite_state_rows"  #: ``hal.executable.source`` of the state-rows kernel for M slots: ``..._m<M>``
ROWS_THREADS = 128  #: threads of a state-rows workgroup (``__launch_bounds__`` in kernels/state_rows_cuda.cu)
#: 16-bit words per element of the cache types the state-rows kernel moves (it copies words)
_WORDS = {"f16": 1, "bf16": 1, "i16": 1, "f32": 2, "i32": 2, "f64": 4, "i64": 4}


def global_name(group: int) -> str:
    """The ``util.global`` symbol of state group ``group``."""
    return STATE_GLOBAL if group == 0 else f"{STATE_GLOBAL}_{group}"


def getter_name(group: int) -> str:
    """The public function returning group ``group``'s global."""
    return f"{global_name(group)}_get"


def group_sizes(n: int, cap: int = MAX_SLOTS_PER_GLOBAL) -> list[int]:
    """Split ``n`` cache slots into the fewest groups of at most ``cap`` slots whose sizes all differ
    (strictly decreasing, so that no two globals share a type; module docstring).

    Raises:
        ValueError: ``n`` < 1 or ``cap`` < 1, or more than ``cap * (cap + 1) / 2`` slots (cap, cap - 1, ..., 1).
    """
    if n < 1 or cap < 1:
        raise ValueError(f"group_sizes: need n >= 1 and cap >= 1, got n={n}, cap={cap}")
    g = 1
    while g * cap - g * (g - 1) // 2 < n:  # the most g distinct sizes <= cap can hold
        g += 1
        if g > cap:
            raise ValueError(f"group_sizes: {n} slots do not fit distinct groups of at most {cap}")
    top = -(-(n + g * (g - 1) // 2) // g)  # sizes top, top-1, ..., top-g+1 hold n or up to g-1 more
    sizes = [top - j for j in range(g)]
    for j in range(g - (sum(sizes) - n), g):  # take one from the last ones: still strictly decreasing
        sizes[j] -= 1
    return sizes


@dataclass
class StateSpec:
    """One combined state global, as recorded in the manifest's ``state`` list.

    Attributes:
        name: the ``util.global`` symbol.
        getter: public function returning the whole global.
        shape: ``[N, *entry shape]``; ``dtype`` the ONNX element type name (``FLOAT``...).
        entries: per slot ``k`` of this global: ``{"input": past name, "output": present name}``.
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


def _call(callee: str, results: list[ir.Type], operands: list[ir.Value], before: ir.Operation, loc: ir.Location) -> ir.Operation:
    with ir.InsertionPoint(before), loc:
        return func.CallOp(results, ir.FlatSymbolRefAttr.get(callee), operands).operation


def _direct_update(value: ir.Value, past: ir.Value, block: ir.Block) -> ir.Operation | None:
    """The ``func.call @rewrite_KVCacheUpdate_*(past, update, position)`` in ``block`` that computes ``value``."""
    owner = value.owner
    if not isinstance(owner, ir.Operation):
        owner = getattr(owner, "operation", None)
    if owner is None or owner.name != "func.call" or owner.parent is None or owner.block != block:
        return None
    callee = ir.FlatSymbolRefAttr(owner.attributes["callee"]).value
    if not callee.startswith(KV_UPDATE_CALL) or len(owner.operands) != 3 or owner.operands[0] != past:
        return None
    return owner


@dataclass
class _Slot:
    """Cache ``k`` of the model: argument ``arg``, result ``res``, its type, its group and index in the group."""

    arg: int
    res: int
    type: VTensor
    group: int
    index: int


def make_stateful(mod: MlirModule, function: str, input_names: list[str], output_names: list[str],
                  pairs: list[tuple[str, str]], onnx_dtypes: Sequence[str], axis: int | None = None,
                  max_slots: int = MAX_SLOTS_PER_GLOBAL, rows_apart: bool = False,
                  rows_object: Callable[[], str] | None = None) -> list[StateSpec]:
    """Move the cache tensors of ``pairs`` ((input name, output name), in slot order) into module state, in place.

    ``input_names``/``output_names``: the entry function's arguments/results in order (graph inputs, graph
    outputs); ``onnx_dtypes``: each pair's ONNX element type name (``FLOAT``...). Each paired tensor must keep one
    static type. Caches of one type share globals, split into groups of at most ``max_slots`` (:func:`group_sizes`);
    caches of another type get globals of their own (DeepSeek-V3's MLA keys and values differ in head size). When ``axis`` is given, a present that is
    ``KVCacheUpdate(past, update, position)`` of its own past is written as its new rows only (module docstring);
    ``rows_apart``: the step also reads those rows apart from the cache as loaded (see :func:`_rows_barrier`).
    ``rows_object``: gives the PTX of ``kernels/state_rows_cuda.cu`` (a path as ``#hal.executable.object`` takes
    it; called only when some chunk forms); given, the row writes of consecutive slots are one dispatch per
    :func:`_row_chunks` chunk.

    Returns:
        one :class:`StateSpec` per global: the globals of the first slot's type first, each type's in slot order.

    Raises:
        BackendError: the entry function or a name is not found, a cache type is dynamic or differs between its
            past and its present.
    """
    fn = mod.function(function)
    block = fn.regions[0].blocks[0]
    ret = list(block.operations)[-1].operation
    args, results = list(block.arguments), list(ret.operands)
    if len(args) != len(input_names) or len(results) != len(output_names):
        raise BackendError(f"stateful: @{function} has {len(args)} args/{len(results)} results, the model "
                           f"{len(input_names)} inputs/{len(output_names)} outputs")
    found = []
    for past, present in pairs:
        if past not in input_names or present not in output_names:
            raise BackendError(f"stateful: cache pair ({past}, {present}) is not an (input, output) of the model")
        i, o = input_names.index(past), output_names.index(present)
        t_in, t_out = VTensor.parse(str(args[i].type)), VTensor.parse(str(results[o].type))
        if None in t_in.dims or t_in.text != t_out.text:
            raise BackendError(f"stateful: cache '{past}' -> '{present}' has type {t_in.text} -> {t_out.text}; a static, "
                               "unchanged type is needed (run the kv plugin with --max-seq)")
        found.append((i, o, t_in))
    if len(onnx_dtypes) != len(found):
        raise BackendError(f"stateful: {len(onnx_dtypes)} element types for {len(found)} cache pairs")
    # global j holds caches of type entries[j]: one type's slots split by group_sizes, then the next type's
    slots: list[_Slot | None] = [None] * len(found)
    sizes, entries, dtypes = [], [], []
    for text in dict.fromkeys(t.text for _, _, t in found):
        members = [k for k, (_, _, t) in enumerate(found) if t.text == text]
        for size in group_sizes(len(members), max_slots):
            j = len(sizes)
            sizes.append(size)
            entries.append(found[members[0]][2])
            dtypes.append(onnx_dtypes[members[0]])
            for x, k in enumerate(members[:size]):
                slots[k] = _Slot(*found[k], j, x)
            members = members[size:]
    gtypes = [_global_type(size, entry) for size, entry in zip(sizes, entries)]
    direct = {k: _direct_update(results[s.res], args[s.arg], block) if axis is not None else None for k, s in enumerate(slots)}
    chunks = _row_chunks(slots, direct, ret, axis) if rows_object is not None else []
    opset = fn.attributes["torch.onnx_meta.opset_version"] if "torch.onnx_meta.opset_version" in fn.attributes else None
    globals_ = "\n".join(f"util.global private mutable @{global_name(j)} = dense<{_zero(entries[j])}> : {gtype}"
                         for j, gtype in enumerate(gtypes))
    mod.add(globals_, "stateful KV cache", first=True)
    if chunks:
        sizes_used, obj = sorted({len(c) for c in chunks}), rows_object()
        mod.add("\n".join(cuda_executable_source(f"{ROWS_EXECUTABLE}_m{m}", obj, [f"state_rows_m{m}"], m + 1, 1, 5,
                                                 ROWS_THREADS) for m in sizes_used), "stateful KV cache: row writes", first=True)
    # the helpers' piece holds the globals again (left out when added: the same ops) so that it verifies alone
    mod.add(globals_ + "\n" + _helpers(slots, direct, gtypes, axis, str(opset) if opset is not None else None, rows_apart,
                                       chunks), "stateful KV cache")

    loc = fn.location
    g = [ir.Type.parse(gtype, mod.context) for gtype in gtypes]
    first = list(block.operations)[0].operation
    with ir.InsertionPoint(first), loc:  # the globals' loads and stores sit in the entry function itself: iree-compile's
        states = [util.GlobalLoadOp(g[j], global_name(j)).result for j in range(len(sizes))]  # torch conversion refuses a store in a private function
    for k, s in enumerate(slots):
        past = _call(f"{_HELPER}slot_{k}", [args[s.arg].type], [states[s.group]], first, loc).results[0]
        args[s.arg].replace_all_uses_with(past)
    order = {o.operation: n for n, o in enumerate(block.operations)}
    chunked = {k for c in chunks for k in c}
    units = [("rows", c, n) for n, c in enumerate(chunks)] + \
            [("write", [k], k) for k, c in direct.items() if c is not None and k not in chunked]
    # each unit where its last update was: every operand is there; the global's value threads through in that order
    for kind, members, tag in sorted(units, key=lambda u: max(order[direct[k]] for k in u[1])):
        calls = [direct[k] for k in members]
        anchor, j = max(calls, key=lambda c: order[c]), slots[members[0]].group
        operands = [states[j], *(c.operands[1] for c in calls), calls[0].operands[2]]
        w = _call(f"{_HELPER}{kind}_{tag}", [g[j], *(c.results[0].type for c in calls)], operands, anchor, anchor.location)
        for n, c in enumerate(calls):
            c.results[0].replace_all_uses_with(w.results[1 + n])
        for c in calls:
            c.erase()
        states[j] = w.results[0]
    for k, s in enumerate(slots):
        if direct[k] is None:
            states[s.group] = _call(f"{_HELPER}put_{k}", [g[s.group]], [states[s.group], ret.operands[s.res]], ret, loc).results[0]
    with ir.InsertionPoint(ret), loc:
        for j, state in enumerate(states):
            util.GlobalStoreOp(state, global_name(j))
    state_res = {s.res for s in slots}
    kept = [v for k, v in enumerate(ret.operands) if k not in state_res]
    with ir.InsertionPoint(ret), ret.location:
        func.ReturnOp(kept)
    ret.erase()
    for i in sorted((s.arg for s in slots), reverse=True):
        block.erase_argument(i)
    fn.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get([a.type for a in block.arguments], [v.type for v in kept]))
    for key, drop in (("arg_attrs", {s.arg for s in slots}), ("res_attrs", state_res)):
        if key in fn.attributes:
            fn.attributes[key] = ir.ArrayAttr.get([a for k, a in enumerate(ir.ArrayAttr(fn.attributes[key])) if k not in drop])
    for op in list(block.operations):  # slot reads nothing uses any more (their presents are written directly)
        op = op.operation
        if op.name == "func.call" and ir.FlatSymbolRefAttr(op.attributes["callee"]).value.startswith(f"{_HELPER}slot_") \
                and not list(op.results[0].uses):
            op.erase()
    return [StateSpec(global_name(j), getter_name(j), [size, *entries[j].dims], dtypes[j],
                      [{"input": input_names[s.arg], "output": output_names[s.res]} for s in slots if s.group == j], axis)
            for j, size in enumerate(sizes)]


def _zero(entry: VTensor) -> str:
    """The zero literal of ``entry``'s element type in a ``dense<...>`` initial value."""
    return "0.0" if entry.builtin_element.startswith(("f", "bf")) else "0"


def _row_chunks(slots: list[_Slot], direct, ret: ir.Operation, axis: int) -> list[list[int]]:
    """The slots whose row writes one state-rows dispatch makes, in chunks: runs of at most
    :data:`MAX_ROWS_PER_WRITE` consecutive slots of one global whose updates have one static type and one position
    value (an int64), and whose presents only the return reads (the write may then move to the chunk's last
    update). The element type must be a whole number of 16-bit words (the kernel moves words), and an update 1 to
    :data:`MAX_GRID_Y` rows (a workgroup each along the grid's y, CUDA's limit there)."""
    chunks: list[list[int]] = []
    for k, s in enumerate(slots):
        call = direct[k]
        if s.type.builtin_element not in _WORDS:
            continue
        dims = VTensor.parse(str(call.operands[1].type)).dims if call is not None else [None]
        rows = int(np.prod(dims[:axis + 1])) if None not in dims else 0
        ok = 0 < rows <= MAX_GRID_Y and all(use.owner == ret for use in call.results[0].uses) \
            and VTensor.parse(str(call.operands[2].type)).builtin_element == "i64"  # the kernel reads an int64
        if not ok:
            continue
        last = chunks[-1] if chunks else None
        if last and len(last) < MAX_ROWS_PER_WRITE and slots[last[-1]].group == s.group and slots[last[-1]].index + 1 == s.index \
                and last[-1] == k - 1 and call.operands[1].type == direct[last[-1]].operands[1].type \
                and call.operands[2] == direct[last[-1]].operands[2]:
            last.append(k)
        else:
            chunks.append([k])
    return chunks


def _rows_helper(c: int, members: list[int], slots: list[_Slot], direct, gtype: str, axis: int, attrs: str) -> str:
    """``@rewrite_kv_state_rows_<c>(state, rows..., position) -> (state, present...)``: one dispatch of the state-rows
    kernel (``kernels/state_rows_cuda.cu``: its layout and contract) writing each member slot's rows in place."""
    calls = [direct[k] for k in members]
    t_u, t_p = VTensor.parse(str(calls[0].operands[1].type)), VTensor.parse(str(calls[0].operands[2].type))
    entry = slots[members[0]].type  # a chunk's slots share one global, so one type
    t, b, m = entry.text, entry.builtin, len(calls)
    words = _WORDS[entry.builtin_element]
    outer, n = 1, t_u.dims[axis]
    for d in entry.dims[:axis]:
        outer *= d
    inner = words
    for d in entry.dims[axis + 1:]:
        inner *= d
    slot0 = slots[members[0]].index  # the chunk's slots are consecutive in their global
    r = len(entry.dims)
    ones = ", ".join("1" for _ in range(r + 1))
    sizes = ", ".join(["1", *(str(d) for d in entry.dims)])
    lines = [f"func.func private @{_HELPER}rows_{c}(%s: {gtype}, "
             + ", ".join(f"%u{i}: {t_u.text}" for i in range(m)) + f", %p: {t_p.text}) -> ({gtype}"
             + "".join(f", {t}" for _ in range(m)) + f"){attrs} {{"]
    lines += [f"  %ub{i} = torch_c.to_builtin_tensor %u{i} : {t_u.text} -> {t_u.builtin}" for i in range(m)]
    lines += [f"  %pb = torch_c.to_builtin_tensor %p : {t_p.text} -> {t_p.builtin}",
              f"  %gx = arith.constant {m} : index", f"  %gy = arith.constant {outer * n} : index", "  %gz = arith.constant 1 : index",
              f"  %outer = arith.constant {outer} : i32", f"  %seq = arith.constant {entry.dims[axis]} : i32",
              f"  %inner = arith.constant {inner} : i32", f"  %n = arith.constant {n} : i32",
              f"  %slot0 = arith.constant {slot0} : i32",
              f"  %w = flow.dispatch @{ROWS_EXECUTABLE}_m{m}::@state_rows_m{m}[%gx, %gy, %gz](%pb, "
              + "".join(f"%ub{i}, " for i in range(m)) + f"%s, %outer, %seq, %inner, %n, %slot0) : ({t_p.builtin}, "
              + "".join(f"{t_u.builtin}, " for _ in range(m)) + f"{gtype}, i32, i32, i32, i32, i32) -> %s"]
    for i in range(m):
        offs = ", ".join([str(slot0 + i)] + ["0"] * r)
        lines += [f"  %e{i} = tensor.extract_slice %w[{offs}] [{sizes}] [{ones}] : {gtype} to {b}",
                  f"  %v{i} = torch_c.from_builtin_tensor %e{i} : {b} -> {t}"]
    lines.append(f"  return %w, " + ", ".join(f"%v{i}" for i in range(m)) + f" : {gtype}" + "".join(f", {t}" for _ in range(m)) + "\n}")
    return "\n".join(lines)


def _global_type(size: int, entry: VTensor) -> str:
    return "tensor<" + "x".join(str(d) for d in [size, *entry.dims]) + "x" + entry.builtin_element + ">"


def _helpers(slots: list[_Slot], direct, gtypes: list[str], axis: int | None, opset: str | None,
             rows_apart: bool = False, chunks: list[list[int]] = ()) -> str:
    """The getters and the private helpers of :func:`make_stateful`, as one piece of MLIR (it loads the
    globals, which the module must hold already). ``chunks``: :func:`_row_chunks`, written by the state-rows
    kernel instead of a scatter each."""
    attrs = f" attributes {{torch.onnx_meta.opset_version = {opset}}}" if opset else ""  # the torch pipeline wants it on every function
    out = [f"func.func @{getter_name(j)}() -> {gtype}{attrs} {{\n  %s = util.global.load @{global_name(j)} : {gtype}\n"
           f"  return %s : {gtype}\n}}" for j, gtype in enumerate(gtypes)]
    for k, slot in enumerate(slots):
        gtype, entry = gtypes[slot.group], slot.type
        r = len(entry.dims)
        ones = ", ".join("1" for _ in range(r + 1))
        sizes = ", ".join(["1", *(str(d) for d in entry.dims)])
        t, b = entry.text, entry.builtin
        offs = ", ".join([str(slot.index)] + ["0"] * r)
        out.append(f"func.func private @{_HELPER}slot_{k}(%s: {gtype}) -> {t}{attrs} {{\n"
                   f"  %e = tensor.extract_slice %s[{offs}] [{sizes}] [{ones}] : {gtype} to {b}\n"
                   f"  %v = torch_c.from_builtin_tensor %e : {b} -> {t}\n  return %v : {t}\n}}")
        call = direct[k]
        if any(k in c for c in chunks):
            continue
        if call is None:
            out.append(f"func.func private @{_HELPER}put_{k}(%s: {gtype}, %x: {t}) -> {gtype}{attrs} {{\n"
                       f"  %b = torch_c.to_builtin_tensor %x : {t} -> {b}\n"
                       f"  %w = tensor.insert_slice %b into %s[{offs}] [{sizes}] [{ones}] : {b} into {gtype}\n"
                       f"  return %w : {gtype}\n}}")
            continue
        t_u, t_p = VTensor.parse(str(call.operands[1].type)), VTensor.parse(str(call.operands[2].type))
        out.append(f"func.func private @{_HELPER}write_{k}(%s: {gtype}, %u: {t_u.text}, %p: {t_p.text}) -> ({gtype}, {t}){attrs} {{\n"
                   f"  %ur = torch_c.to_builtin_tensor %u : {t_u.text} -> {t_u.builtin}\n"
                   + (_rows_barrier(t_u) if rows_apart else f"  %ub = tensor.cast %ur : {t_u.builtin} to {t_u.builtin}\n") +
                   f"  %pb = torch_c.to_builtin_tensor %p : {t_p.text} -> {t_p.builtin}\n"
                   + insert_rows_mlir("w", "%s", gtype, [str(slot.index)], "%ub", t_u, "%pb", t_p, entry.dims[axis], axis, "%w") + "\n"
                   f"  %e = tensor.extract_slice %w[{offs}] [{sizes}] [{ones}] : {gtype} to {b}\n"
                   f"  %v = torch_c.from_builtin_tensor %e : {b} -> {t}\n  return %w, %v : {gtype}, {t}\n}}")
    out += [_rows_helper(c, members, slots, direct, gtypes[slots[members[0]].group], axis, attrs)
            for c, members in enumerate(chunks)]
    return "\n".join(out)


def _rows_barrier(rows: VTensor) -> str:
    """MLIR defining ``%ub``: the rows a state write inserts (``%ur``) behind ``iree_tensor_ext.compute_barrier.start``,
    for a step that reads them apart from the cache as loaded.

    Their producer then stays out of the write's dispatch. Fused into it, the write would run where the rows are
    made, before this step's reads of the cache as loaded (GroupedAttention with new rows, the ``attention``
    plugin), and iree-compile 3.13 would copy the whole global to keep those reads valid; kept apart, every write
    stays after the reads (they are the entry function's last ops) and is done in place. (``util.optimization_barrier``
    does the same but makes the step wait on the host there.) A step whose attention reads the written cache needs
    no barrier, and iree-compile fuses a producer such as its own RoPE into the write: a dispatch fewer per cache."""
    dims = [f"%ud{k}" for k, d in enumerate(rows.dims) if d is None]
    lines = [f"  %uc{k} = arith.constant {k} : index\n  %ud{k} = tensor.dim %ur, %uc{k} : {rows.builtin}\n"
             for k, d in enumerate(rows.dims) if d is None]
    types = "".join(", index" for _ in dims)
    return "".join(lines) + (f"  %ub = \"iree_tensor_ext.compute_barrier.start\"(%ur{''.join(', ' + d for d in dims)}) : "
                             f"({rows.builtin}{types}) -> {rows.builtin}\n")


def make_module_stateful(mod: MlirModule, function: str, manifest, graph, ctx: PatchContext | None = None) -> list[StateSpec]:
    """:func:`make_stateful` for every static KV cache pair of the model (found from what the graph computes,
    :func:`rewrite.core.interface.cache_pairs`); record the state in ``manifest.state`` and drop the cache tensors
    from ``manifest.inputs``/``outputs``. The sequence axis is the one dim where a KVCacheUpdate writes, when the
    ``kv`` plugin ran (else None). ``ctx``: where the module is patched; for ``cuda``, where an attention reads the
    new rows apart, the state-rows kernel is built for ``ctx.cuda_arch`` and copied into ``ctx.folder``.

    Raises:
        BackendError: the model has no cache pairs, :func:`make_stateful` refuses, or the state-rows kernel cannot
            be built (no nvcc and no matching shipped PTX).
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
    shapes = {d["name"]: d.get("shape") for d in manifest.inputs}
    for past, _ in pairs:  # a symbolic batch dim (optimum's exports): a global needs a static type
        dim = next((d for d in shapes.get(past) or () if isinstance(d, str)), None)
        if dim is not None:
            raise BackendError(f"--stateful: cache '{past}' has the symbolic dim '{dim}' (shape {shapes[past]}); its state "
                               f"needs a static type: fix it with --dim {dim}=N (one sequence per call: --dim {dim}=1)")
    dtype = {d["name"]: d["dtype"] for d in manifest.inputs}
    axes = {n.attr("axis") % len(graph.values[n.inputs[0]].shape) for n in graph.nodes.values()
            if n.op_type == "KVCacheUpdate" and graph.values[n.inputs[0]].shape is not None}  # as the op reads it
    axis = axes.pop() if len(axes) == 1 else None
    # an attention reading the cache as loaded plus the new rows (the attention plugin's attention-reads-loaded-cache)
    rows_apart = any(n.op_type == "GroupedAttention" and any(n.inputs[4:]) for n in graph.nodes.values())
    # there every write is a dispatch of its own at the step's end (_rows_barrier): on CUDA, a few slots a dispatch
    rows_object = None
    if rows_apart and axis is not None and ctx is not None and ctx.target == "cuda":
        def rows_object() -> str:
            return ctx.object_path(build_cuda_ptx(kernel_source(__file__, "state_rows_cuda.cu"), ctx.cuda_arch))
    with mod.context:
        specs = make_stateful(mod, function, ins, outs, pairs, [dtype[p] for p, _ in pairs], axis, rows_apart=rows_apart,
                              rows_object=rows_object)
    state_in, state_out = {p for p, _ in pairs}, {o for _, o in pairs}
    manifest.inputs = [d for d in manifest.inputs if d["name"] not in state_in]
    manifest.outputs = [d for d in manifest.outputs if d["name"] not in state_out]
    manifest.state = [spec.to_json() for spec in specs]
    return specs
