"""End-to-end demo: export real MoE decoders, rewrite them, lower to ONNX Runtime and IREE, decode, verify.

    python examples/demo.py                 # tiny Qwen1.5-MoE (transformers export) + the seed's static-cache form
    python examples/demo.py --dtype fp16    # the same in float16

For each model and backend it runs ``rewrite apply --plugins cast,legalize,topk``, greedy-decodes ``--steps``
tokens through the lowered model and through the original model on ONNX Runtime (each fed back its own
tokens and KV cache), and prints the logits error and whether the tokens agree. A backend that fails the
check is then run through ``rewrite verify --locate``, which names the first node whose result differs
(``--plugins cast,legalize`` shows IREE's own router TopK failing inside the full model, located there).
Exit status 0 when every backend either passes (relative error under 1e-4 in fp32, 1e-2 in fp16, identical
tokens) or its failure was located to a node; 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import qwen_moe  # noqa: E402
import seed_form  # noqa: E402

from rewrite.backends import load_runner  # noqa: E402
from rewrite.backends.ort import OrtRunner  # noqa: E402
from rewrite.pipeline import apply  # noqa: E402
from rewrite.verify import REL_TOL, locate  # noqa: E402

PLUGINS = "cast,legalize,topk"  #: the topk plugin replaces the router TopK IREE gets wrong
TOL = {"fp32": REL_TOL[1], "fp16": REL_TOL[10]}


def rel_error(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """max|a-b| / max|b| over all steps' logits (normwise)."""
    x = np.concatenate([np.asarray(v, np.float64).ravel() for v in a])
    y = np.concatenate([np.asarray(v, np.float64).ravel() for v in b])
    return float(np.abs(x - y).max() / np.abs(y).max())


def hf_decoder(path: Path, steps: int):
    """Greedy decode through the transformers export's interface (Concat KV cache, empty-past prefill)."""
    sig = qwen_moe.decode_signature(path)
    prompt = list(np.random.default_rng(0).integers(0, 512, 5))

    def decode(run):
        return qwen_moe.greedy_decode(run, sig.input_names, sig.output_names, prompt, steps, sig.kv_shape_per_layer, sig.dtype)

    return decode


def seed_decoder(weights, steps: int):
    """Greedy decode through the seed form's interface (static cache written at seq_position)."""
    cfg = weights.config
    prompt = np.random.default_rng(0).integers(cfg.vocab, size=(1, 5), dtype=np.int64)

    def decode(run):
        tokens, logits, _ = seed_form.greedy(seed_form.runner_step(run, cfg), cfg, prompt, steps)
        return tokens, logits

    return decode


def check(name: str, model_path: Path, decode, dtype: str, out: Path, backends: list[str], plugins: str = PLUGINS) -> list[dict]:
    """Apply, decode and compare one model on each backend; returns one result row per backend."""
    ref_tokens, ref_logits = decode(OrtRunner(model_path).run)
    rows = []
    for backend in backends:
        folder = out / f"{name}.{backend}"
        t = time.time()
        apply(model_path, folder, plugins=plugins, backend=backend)
        built = time.time() - t
        tokens, logits = decode(load_runner(folder).run)
        err = rel_error(logits, ref_logits)
        ok = err <= TOL[dtype] and tokens == ref_tokens
        row = dict(model=name, backend=backend, rel_err=err, tokens_equal=tokens == ref_tokens, ok=ok, build_s=built, located=None)
        if not ok:
            loc = locate(model_path, folder)
            row["located"] = loc.line() if loc else "no intermediate value differs"
        rows.append(row)
        status = "PASS" if ok else "FAIL"
        print(f"[{status}] {name} on {backend}: logits rel err {err:.2e} (tol {TOL[dtype]:g}), tokens {'identical' if tokens == ref_tokens else f'{tokens} vs {ref_tokens}'}  [apply {built:.1f} s]", flush=True)
        if row["located"]:
            print(f"       rewrite verify --locate: {row['located']}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out/demo"))
    ap.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--backends", default="ort,iree")
    ap.add_argument("--plugins", default=PLUGINS)
    ap.add_argument("--skip-seed-form", action="store_true")
    args = ap.parse_args(argv)
    backends = args.backends.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    rows = []
    print(f"exporting tiny Qwen1.5-MoE ({args.dtype}) with transformers' ONNX exporter ...", flush=True)
    model = qwen_moe.build_model("qwen2_moe", "tiny", dtype=torch.float16 if args.dtype == "fp16" else torch.float32)
    hf_path = qwen_moe.export_hf(model, args.out / f"qwen2_moe_tiny_{args.dtype}")
    rows += check(f"qwen2_moe_tiny_{args.dtype}", hf_path, hf_decoder(hf_path, args.steps), args.dtype, args.out, backends, args.plugins)
    if not args.skip_seed_form:
        print(f"building the seed's static-cache INT4 form ({args.dtype}) ...", flush=True)
        seed_model, weights = seed_form.build_seed_model(args.dtype)
        seed_path = seed_form.save_seed_model(seed_model, args.out / f"seed_form_{args.dtype}.onnx")
        rows += check(f"seed_form_{args.dtype}", seed_path, seed_decoder(weights, args.steps), args.dtype, args.out, backends, args.plugins)
    bad = [r for r in rows if not r["ok"] and not r["located"]]
    located = [r for r in rows if not r["ok"] and r["located"]]
    print(f"\n{len(rows) - len(bad) - len(located)} passed, {len(located)} failed with the differing node located, {len(bad)} unexplained")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
