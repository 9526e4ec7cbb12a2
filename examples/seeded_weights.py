"""Seeded weights for full-size models: the same bytes on any machine from (seed, tensor name), tensor by tensor.

A full-size MoE export is tens of gigabytes of weights that are random anyway. Here every tensor's values come from
a counter-based generator (numpy's Philox, keyed by a SHA-256 of ``"{seed}/{name}"``), so

- they are written tensor by tensor in fixed-size chunks, never the whole model in memory;
- the result does not depend on the order, the threads or the chunking that wrote it;
- a machine that holds only the weightless graph (``model.onnx`` with external-data references, a few MB)
  regenerates the identical ``model.onnx.data`` with `regenerate` and numpy alone.

Values (``init_kind`` picks by name, in the spirit of transformers' ``_init_weights``):

- norm weights (``*norm.weight``, ``*layernorm.weight``): 1.0;
- router weights (``*.mlp.gate.weight``): uniform with std 0.5 (`ROUTER_STD`): a router at the default std routes by
  rounding noise, and runtimes then disagree on the selection. An exporter may draw them with another std
  (``router_std``, recorded in the metadata so that `regenerate` draws the same): the router's logits have about
  std ``router_std x sqrt(hidden)`` (its input is RMS-normalized), so a std that keeps a small model's choices
  decisive saturates a full-size model's softmax, where fp16 rounding then moves the experts' weights;
- INT4 weights in the seed's form (``*.qweight`` UINT8 codes, ``*.zero_points`` UINT8, ``*.scales`` float; see
  ``examples/seed_form.py``): codes uniform in 0..15, zero points uniform in 7..8 (mean 7.5, the codes' mean, so the
  weights have mean 0 and no common offset builds up in the residual stream across layers), scales uniform in
  [0.5, 1.5] x `WEIGHT_STD` / 4.6, so that ``(code - zero_point) * scale`` has about std `WEIGHT_STD` (codes uniform in
  0..15 have std 4.6);
- everything else: uniform with std 0.02 (transformers' ``initializer_range``), biases included.

CLI: ``python examples/seeded_weights.py regenerate model.onnx --seed 0`` writes the external data ``model.onnx``
references, next to it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

ROUTER_STD = 0.5
#: the router weights' std of the full-size exports (``seed_form.FULL``, ``qwen_moe.export_seeded(size="full")``):
#: logits of std about 2.3 at hidden 2048. `ROUTER_STD` there gives logits of std 22.6, a softmax so saturated that
#: fp16 rounding moved Qwen1.5-MoE-A2.7B's top-2 expert weights by up to 0.43 (0.47 / 0.39 in float32, 0.90 / 0.07
#: in fp16), and ONNX Runtime CPU's fp16 tokens left those of the same model in float32 at the second token
#: (BENCHMARKS.md, "a float32 reference")
FULL_ROUTER_STD = 0.05
WEIGHT_STD = 0.02
CHUNK = 1 << 22  # elements per generator call; fixed, so the stream of every tensor is the same everywhere
ALIGN = 64  # byte alignment of each tensor in the data file (mmap and vector loads)
METADATA_KEY = "seeded_weights"  # model metadata_props key: seed and derived tensors (see `metadata`)

_DTYPES = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}
_ITEMSIZE = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.FLOAT16: 2, onnx.TensorProto.BFLOAT16: 2,
             onnx.TensorProto.UINT8: 1}
_CODE_STD = math.sqrt((16**2 - 1) / 12)  # std of codes uniform in 0..15
_INTEGER_KINDS = {"codes": (0, 15), "zero_points": (7, 8)}  # inclusive ranges of the UINT8 kinds


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor's bytes live in the data file.

    Attributes:
        name: tensor name (the key of its values).
        shape: dims.
        elem_type: ONNX element type: FLOAT, FLOAT16 or BFLOAT16.
        offset: byte offset in the data file (a multiple of `ALIGN`).
        length: byte length (elements x item size).
    """

    name: str
    shape: tuple[int, ...]
    elem_type: int
    offset: int
    length: int


def layout(tensors: Iterable[tuple[str, Sequence[int], int]], *, align: int = ALIGN) -> list[TensorSlot]:
    """Consecutive ``align``-aligned slots for ``(name, shape, elem_type)`` tensors, in the order given.

    Raises:
        ValueError: an element type other than FLOAT, FLOAT16, BFLOAT16 and UINT8 (INT4 codes and zero points,
            `init_kind`), or a UINT8 tensor `init_kind` does not name as codes or zero points.
    """
    slots, offset = [], 0
    for name, shape, elem_type in tensors:
        if elem_type not in _ITEMSIZE:
            raise ValueError(f"tensor '{name}': element type {onnx.TensorProto.DataType.Name(elem_type)} is not "
                             f"generated (float32, float16, bfloat16, uint8 codes)")
        if (elem_type == onnx.TensorProto.UINT8) != (init_kind(name)[0] in _INTEGER_KINDS):
            raise ValueError(f"tensor '{name}': {onnx.TensorProto.DataType.Name(elem_type)} is generated only for "
                             f"INT4 codes and zero points ('*.qweight', '*.zero_points'), and those only as UINT8")
        length = math.prod(shape) * _ITEMSIZE[elem_type]
        slots.append(TensorSlot(name, tuple(int(d) for d in shape), elem_type, offset, length))
        offset += length + (-length) % align
    return slots


def init_kind(name: str, router_std: float = ROUTER_STD) -> tuple[str, float]:
    """How the tensor ``name`` is drawn (see the module docstring): ``("ones", 1.0)`` for norm weights, ``("codes",
    0)`` and ``("zero_points", 0)`` for INT4 codes and zero points, ``("scales", mean)`` for their scales, else
    ``("uniform", std)``: ``router_std`` for router weights, `WEIGHT_STD` otherwise."""
    if name.endswith("norm.weight"):
        return "ones", 1.0
    if name.endswith(".qweight"):
        return "codes", 0.0
    if name.endswith(".zero_points"):
        return "zero_points", 0.0
    if name.endswith(".scales"):
        return "scales", WEIGHT_STD / _CODE_STD
    if name.endswith("mlp.gate.weight"):
        return "uniform", router_std
    return "uniform", WEIGHT_STD


def _generator(seed: int, name: str) -> np.random.Generator:
    key = int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:16], "little")
    return np.random.Generator(np.random.Philox(key=key))


def _encode(values: np.ndarray, elem_type: int) -> bytes:
    """float32 values as the bytes of ``elem_type`` (bfloat16: round to nearest even, as torch does; UINT8 values are
    already uint8)."""
    if elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.UINT8):
        return values.tobytes()
    if elem_type == onnx.TensorProto.FLOAT16:
        return values.astype(np.float16).tobytes()
    bits = values.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def tensor_chunks(seed: int, slot: TensorSlot, router_std: float = ROUTER_STD) -> Iterable[bytes]:
    """The bytes of ``slot``'s tensor, in chunks of at most `CHUNK` elements (no padding)."""
    count = slot.length // _ITEMSIZE[slot.elem_type]
    kind, std = init_kind(slot.name, router_std)
    gen = _generator(seed, slot.name)
    half_width = np.float32(std * math.sqrt(3.0))  # uniform(-a, a) has std a / sqrt(3)
    buf = np.empty(min(CHUNK, max(count, 1)), np.float32)
    done = 0
    while done < count:
        n = min(CHUNK, count - done)
        out = buf[:n]
        if kind in _INTEGER_KINDS:
            lo, hi = _INTEGER_KINDS[kind]
            yield gen.integers(lo, hi + 1, size=n, dtype=np.uint8).tobytes()
            done += n
            continue
        if kind == "ones":
            out.fill(1.0)
        elif kind == "scales":  # uniform in [0.5, 1.5] x mean
            gen.random(out=out, dtype=np.float32)
            out += np.float32(0.5)
            out *= np.float32(std)
        else:
            gen.random(out=out, dtype=np.float32)
            out *= 2 * half_width
            out -= half_width
        yield _encode(out, slot.elem_type)
        done += n


def tensor_values(seed: int, slot: TensorSlot, router_std: float = ROUTER_STD) -> np.ndarray:
    """``slot``'s tensor as a numpy array (float32, or uint8 for UINT8 slots; small tensors and tests: the whole
    tensor is in memory)."""
    raw = b"".join(tensor_chunks(seed, slot, router_std))
    if slot.elem_type == onnx.TensorProto.UINT8:
        return np.frombuffer(raw, np.uint8).reshape(slot.shape)
    if slot.elem_type == onnx.TensorProto.FLOAT:
        return np.frombuffer(raw, np.float32).reshape(slot.shape)
    if slot.elem_type == onnx.TensorProto.FLOAT16:
        return np.frombuffer(raw, np.float16).astype(np.float32).reshape(slot.shape)
    return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(slot.shape)


def write(path: str | os.PathLike, slots: Sequence[TensorSlot], seed: int, *, threads: int | None = None,
          progress=None, derived: dict[str, Sequence] | None = None, router_std: float = ROUTER_STD) -> int:
    """Write every slot's tensor into ``path`` at its offset (the file is created, or emptied, at the layout's size;
    bytes outside the slots are zero). Tensors are written in parallel, each by one thread in `CHUNK` pieces, so
    memory stays at a few chunks per thread.

    Args:
        progress: called with each slot's byte length once it is written (e.g. a progress bar's advance).
        derived: slots made from a parameter rather than by name: ``{name: (parameter, perm)}`` (see `metadata`).
        router_std: the router weights' std (the module docstring; record it with `metadata`).

    Returns:
        The file size in bytes.
    """
    end = max((s.offset + s.length for s in slots), default=0)
    size = end + (-end) % ALIGN
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, 0)  # every byte outside the slots is zero, whatever the file held before
        os.ftruncate(fd, size)

        def one(slot: TensorSlot) -> None:
            pos = slot.offset
            recipe = (derived or {}).get(slot.name)
            chunks = (tensor_chunks(seed, slot, router_std) if recipe is None
                      else _derived_chunks(seed, slot, *recipe, router_std=router_std))
            for chunk in chunks:
                os.pwrite(fd, chunk, pos)
                pos += len(chunk)
            if progress is not None:
                progress(slot.length)

        with ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
            for _ in pool.map(one, sorted(slots, key=lambda s: -s.length)):
                pass
    finally:
        os.close(fd)
    return size


def zero_ranges(path: str | os.PathLike, ranges: Iterable[tuple[int, int]]) -> None:
    """Make ``(offset, length)`` ranges of ``path`` zeros, releasing their disk blocks where the file system can
    (Linux ``fallocate(PUNCH_HOLE)``; elsewhere zeros are written). For parameters the exported graph does not
    reference (the exporter folded them into transposed copies): `regenerate` leaves them zero too."""
    fd = os.open(path, os.O_RDWR)
    try:
        punch = None
        try:
            import ctypes
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            punch = libc.fallocate
            punch.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong)
        except (OSError, AttributeError):
            punch = None
        for offset, length in ranges:
            if punch is not None and punch(fd, 0x01 | 0x02, offset, length) == 0:  # KEEP_SIZE | PUNCH_HOLE
                continue
            for start in range(offset, offset + length, 1 << 24):
                os.pwrite(fd, bytes(min(1 << 24, offset + length - start)), start)
    finally:
        os.close(fd)


def external_slots(model: onnx.ModelProto) -> dict[str, list[TensorSlot]]:
    """The external-data tensors of ``model``'s main graph, by data file location.

    Raises:
        ValueError: an external tensor without a length, or of an element type that is not generated.
    """
    by_file: dict[str, list[TensorSlot]] = {}
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        if "length" not in info:
            raise ValueError(f"initializer '{t.name}': external data without a length")
        if t.data_type not in _ITEMSIZE:
            raise ValueError(f"initializer '{t.name}': {onnx.TensorProto.DataType.Name(t.data_type)} is not generated")
        slot = TensorSlot(t.name, tuple(t.dims), t.data_type, int(info.get("offset", 0)), int(info["length"]))
        if slot.length != math.prod(slot.shape) * _ITEMSIZE[t.data_type]:
            raise ValueError(f"initializer '{t.name}': length {slot.length} does not fit its shape {slot.shape}")
        by_file.setdefault(info["location"], []).append(slot)
    return by_file


def metadata(seed: int, derived: dict[str, tuple[str, Sequence[int]]], router_std: float = ROUTER_STD) -> str:
    """The model metadata value (under `METADATA_KEY`) that `regenerate` reads: the seed, for each initializer the
    exporter derived from a parameter (a transposed weight its optimizer folded) the parameter's name and the
    permutation (``initializer == parameter.transpose(perm)``), and the router weights' std when it is not
    `ROUTER_STD` (a model recorded without one was drawn with `ROUTER_STD`)."""
    out = {"seed": seed, "derived": {k: [src, list(perm)] for k, (src, perm) in sorted(derived.items())}}
    if router_std != ROUTER_STD:
        out["router_std"] = router_std
    return json.dumps(out)


def _derived_chunks(seed: int, slot: TensorSlot, source: str, perm: Sequence[int], *,
                    router_std: float = ROUTER_STD) -> Iterable[bytes]:
    """The bytes of a derived tensor: its source parameter generated whole (float32), then transposed."""
    inverse = np.argsort(perm)
    source_slot = TensorSlot(source, tuple(slot.shape[i] for i in inverse), slot.elem_type, 0, slot.length)
    yield _encode(np.ascontiguousarray(tensor_values(seed, source_slot, router_std).transpose(perm)), slot.elem_type)


def regenerate(onnx_path: str | os.PathLike, seed: int | None = None, *, threads: int | None = None) -> list[Path]:
    """Write the external data files a weightless ``onnx_path`` references (see the module docstring).

    Args:
        seed: the weight seed; by default the one recorded in the model's metadata (`METADATA_KEY`).

    Returns:
        The files written.

    Raises:
        ValueError: no seed given and none recorded, or a tensor the generator does not make (see `external_slots`).
    """
    onnx_path = Path(onnx_path)
    model = onnx.load(str(onnx_path), load_external_data=False)
    recorded = json.loads({p.key: p.value for p in model.metadata_props}.get(METADATA_KEY, "{}"))
    seed = recorded.get("seed") if seed is None else seed
    if seed is None:
        raise ValueError(f"{onnx_path}: no --seed given and none recorded in its metadata ({METADATA_KEY})")
    derived = recorded.get("derived", {})
    router_std = float(recorded.get("router_std", ROUTER_STD))
    written = []
    for location, slots in external_slots(model).items():
        target = onnx_path.parent / location
        write(target, slots, seed, threads=threads, derived=derived, router_std=router_std)
        written.append(target)
    return written


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    regen = sub.add_parser("regenerate", help="write the external data a weightless model.onnx references")
    regen.add_argument("model", type=Path)
    regen.add_argument("--seed", type=int, default=None, help="default: the seed recorded in the model")
    regen.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    for path in regenerate(args.model, args.seed, threads=args.threads):
        print(f"{path}: {path.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
