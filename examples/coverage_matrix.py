"""The coverage matrix: which MoE families and export paths the plugins fuse, and whether the result is exact.

For every (family, exporter, experts implementation, dtype) it exports the tiny model of
`moe_families`, runs ``rewrite apply --plugins topk,moe`` for ``--backend ort`` and ``--backend iree``
(llvm-cpu), and records per row:

* the match counts of ``topk`` and ``moe`` against the number of MoE layers;
* ``rewrite verify`` on each backend (outputs against ONNX Runtime on the original, at the basic level);
* greedy tokens for ``--steps`` steps on each backend against ONNX Runtime on the original;
* for what did not fuse, the first refusal reason of the best attempt.

``--extra-plugins attention`` adds plugins to both backends' lists (and a match-count column each).

    python examples/coverage_matrix.py --out out/coverage --markdown docs/coverage.md
    python examples/coverage_matrix.py --families qwen2_moe,mixtral --exporters dynamo --experts batched_mm

Exit status 0 when every row that fused is exact; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import moe_families  # noqa: E402

from rewrite.core import onnx_io  # noqa: E402
from rewrite.errors import RewriteError  # noqa: E402
from rewrite.generate import GenerationError, Generator  # noqa: E402
from rewrite.pipeline import RewriteContext, apply, rewrite_graph  # noqa: E402
from rewrite.plugins.manager import select_plugins  # noqa: E402
from rewrite.verify import verify  # noqa: E402

PROMPT = [11, 22, 33, 44, 55]
#: IREE also takes ``legalize``, which rewrites only what IREE's importer or compiler cannot take (it does nothing
#: for ONNX Runtime): Qwen3.5-MoE's rotary ScatterNDs, which iree-compile 3.13 cannot compile
BACKEND_PLUGINS = {"ort": "topk,moe", "iree": "legalize,topk,moe"}


@dataclass
class Row:
    """One (family, exporter, experts, dtype) of the matrix."""

    family: str
    exporter: str
    experts: str
    dtype: str
    moe_layers: int = 0
    topk: int = 0
    moe: int = 0
    verify: dict = field(default_factory=dict)
    tokens: dict = field(default_factory=dict)
    #: why ``moe`` did not fuse every layer, else why ``topk`` did not (empty when both did)
    reason: str = ""
    seconds: float = 0.0
    #: matches of each ``--extra-plugins`` plugin (on the first backend whose apply succeeded)
    extra: dict = field(default_factory=dict)

    @property
    def fused(self) -> bool:
        return self.moe_layers > 0 and self.moe == self.moe_layers

    @property
    def exported(self) -> bool:
        return not self.reason.startswith("export failed")

    @property
    def exact(self) -> bool:
        """verify passed and the tokens were equal on every backend."""
        return (set(self.verify) == set(self.tokens) == set(BACKEND_PLUGINS) and all(v == "pass" for v in self.verify.values())
                and all(v == "equal" for v in self.tokens.values()))


def moe_layer_count(model) -> int:
    """MoE feed-forward blocks in the model: ``experts`` modules outside attention (JetMoE's attention experts
    are not an MoE feed-forward block; its feed-forward experts are the ``mlp.input_linear`` /
    ``output_linear`` pair)."""
    return sum(1 for name, _ in model.named_modules()
               if name.endswith((".experts", ".mlp.input_linear")) and "attention" not in name)


def first_refusal(report: list[dict], plugin: str) -> str:
    """The first refusal of a full match, else the reason the best partial match stopped, over ``plugin``'s rules."""
    rules = [rule for rep in report if rep["plugin"] == plugin for rule in rep["rules"]]
    for rule in rules:
        if rule["refusals"]:
            return f"{plugin}/{rule['rule']}: {rule['refusals'][0]['reason']}"[:200]
    for rule in rules:
        if "best_partial" in rule:
            return f"{plugin}/{rule['rule']}: {rule['best_partial']['reason']}"[:200]
    return ""


def one_line(error: BaseException | str) -> str:
    """The first line of an error without terminal colours or temporary folders (the table must not change
    with where it was produced)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip().splitlines()[0] if str(error).strip() else ""
    return re.sub(r"(/[^\s:]*/)+(?=[^/\s:]+)", "", text)[:240]


def stage(what: str) -> None:
    """Announce the step a row is in, so that a crash of a runtime can be attributed (see `run_isolated`)."""
    print(f"stage: {what}", flush=True)


def run_isolated(row: Row, out: Path, steps: int, extra: tuple[str, ...] = ()) -> Row:
    """`run_row` in a child process: a runtime that crashes (IREE on some exports) ends that row, not the matrix."""
    cmd = [sys.executable, __file__, "--row", f"{row.family},{row.exporter},{row.experts},{row.dtype}",
           "--out", str(out), "--steps", str(steps), "--extra-plugins", ",".join(extra)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    done = [line for line in lines if line.startswith("{")]
    if proc.returncode == 0 and done:
        return Row(**json.loads(done[-1]))
    last = next((line[len("stage: "):] for line in reversed(lines) if line.startswith("stage: ")), "export")
    partial = [line[len("partial: "):] for line in lines if line.startswith("partial: ")]
    if partial:
        row = Row(**json.loads(partial[-1]))
    why = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
    row.reason = f"crashed ({why}) during: {last}" + (f"; {row.reason}" if row.reason else "")
    return row


def run_row(row: Row, out: Path, steps: int, extra: tuple[str, ...] = (), exported: Path | None = None) -> Row:
    """Export, match, verify and decode one row (module docstring); ``extra``: plugins added to both backends;
    ``exported``: the row's export already made (``moe_families.export`` of the same model), used as it is."""
    import torch

    t0 = time.time()
    folder = out / f"{row.family}.{row.exporter}.{row.experts}.{row.dtype}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = moe_families.build(row.family, experts=row.experts,
                                   dtype=torch.float16 if row.dtype == "fp16" else torch.float32)
        row.moe_layers = moe_layer_count(model)
        try:
            path = exported or moe_families.export(model, row.exporter, folder / "export")
        except Exception as e:  # the exporter's own failure: reported, not ours to fix
            row.reason = f"export failed: {type(e).__name__}: {one_line(e)}"
            row.seconds = time.time() - t0
            return row
    stage("topk,moe match counts")
    graph = onnx_io.load(path)
    reports = [r.to_json() for r in rewrite_graph(graph, select_plugins("topk,moe"), RewriteContext(), dry_run=False)]
    count = lambda p: sum(r["matches"] for rep in reports if rep["plugin"] == p for r in rep["rules"])  # noqa: E731
    row.topk, row.moe = count("topk"), count("moe")
    if not row.fused:
        row.reason = first_refusal(reports, "moe") or first_refusal(reports, "topk")
    elif row.topk < row.moe_layers:  # the experts fused, the router did not: say why
        row.reason = first_refusal(reports, "topk")
    print("partial: " + json.dumps(asdict(row)), flush=True)  # what a crash later in the row keeps
    stage("reference tokens on ONNX Runtime")
    try:
        reference = Generator.reference(path).generate(PROMPT, steps).tokens
    except GenerationError as e:  # the export cannot be decoded this far: compare what it serves, say why
        reference = None
        if e.positions is not None and e.positions >= len(PROMPT):
            steps = e.positions - len(PROMPT) + 1
            reference = Generator.reference(path).generate(PROMPT, steps).tokens
        row.reason = "; ".join(filter(None, [row.reason, f"generate: {one_line(e)}"
                                             + (f" ({steps} steps compared)" if reference else "")]))
    for backend, plugins in BACKEND_PLUGINS.items():
        lowered = folder / backend
        stage(f"apply, verify and generate on {backend}")
        try:
            manifest = apply(path, lowered, plugins=",".join([plugins, *extra]), backend=backend)
            for plugin in extra:
                row.extra.setdefault(plugin, sum(r["matches"] for rep in manifest.report if rep["plugin"] == plugin
                                                 for r in rep["rules"]))
            row.verify[backend] = "pass" if all(c.ok for c in verify(path, lowered)) else "FAIL"
            if reference is None:
                continue
            tokens = Generator(lowered).generate(PROMPT, steps).tokens
            row.tokens[backend] = "equal" if tokens == reference else f"differ from step {next(i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b)}"
        except Exception as e:
            row.verify[backend] = f"error: {one_line(e)}"
    row.seconds = time.time() - t0
    return row


def markdown(rows: list[Row], command: str, extra: tuple[str, ...] = ()) -> str:
    plus = "".join(f",{p}" for p in extra)
    lines = [
        "# Coverage matrix", "",
        "Tiny random decoders of the MoE families transformers ships (`examples/moe_families.py`: 2 layers, hidden 64,",
        f"8 experts), exported one decode step at a time, rewritten with `--plugins topk,moe{plus}`, lowered for ONNX Runtime",
        f"(`ort`) and, with `--plugins legalize,topk,moe{plus}`, for IREE llvm-cpu (`iree`). `verify`: every output against",
        "ONNX Runtime on the original at the basic",
        f"level; tokens: {len(PROMPT)}-token prompt then greedy decoding, against ONNX Runtime on the original.", "",
        f"Produced by `{command}`.", "",
        "| family | exporter | experts | dtype | topk | moe | " + "".join(f"{p} | " for p in extra)
        + "verify ort | verify iree | tokens ort | tokens iree | notes: why not fused (moe, else topk), why decoding stops |",
        "|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(extra),
    ]
    for r in rows:
        counts = "".join(f"{r.extra.get(p, '-')} | " for p in extra)
        lines.append(f"| {r.family} | {r.exporter} | {r.experts} | {r.dtype} | {r.topk}/{r.moe_layers} | {r.moe}/{r.moe_layers} | {counts}"
                     f"{r.verify.get('ort', '-')} | {r.verify.get('iree', '-')} | {r.tokens.get('ort', '-')} | "
                     f"{r.tokens.get('iree', '-')} | {r.reason.replace('|', '/')} |")
    exported = [r for r in rows if r.exported]
    fused = [r for r in exported if r.fused]
    lines += ["", f"Of {len(rows)} rows, {len(exported)} export; {len(fused)} of those fuse every MoE layer, and "
              f"{sum(r.exact for r in fused)} of those pass `verify` with equal tokens on both backends. A `-` is a step "
              "that did not run because an earlier one failed; `crashed` is a runtime that died (run in a child process)."]
    lines += ["", "Why the fused rows that are not exact are not:", "",
              "* JetMoE: its MoE blocks fuse (`fused-moe-index-add`); its attention experts (MoA) sort the (token, expert) "
              "pairs with a TopK of dynamic K, which iree-compile 3.13 cannot lower (unbounded stack allocation).",
              "* Jamba (hf): the export fixes `input_ids` at 2 tokens per call; `verify` passes on both backends, and "
              "`generate` refuses a prefill of 5 tokens and one-token steps.",
              "* gpt-oss (dynamo) is exact as far as it decodes: the export gives its sliding-window and full-attention "
              "pasts one dim, so the graph serves 16 positions (12 greedy steps after the 5-token prompt)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(moe_families.FAMILIES))
    ap.add_argument("--exporters", default=",".join(moe_families.EXPORTERS))
    ap.add_argument("--experts", default=",".join(moe_families.EXPERTS))
    ap.add_argument("--dtypes", default="fp32")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("out/coverage"))
    ap.add_argument("--markdown", type=Path, help="also write the table here")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--extra-plugins", default="", help="comma-separated plugins added to both backends (e.g. attention)")
    ap.add_argument("--row", help=argparse.SUPPRESS)  # family,exporter,experts,dtype: one row, in this process
    args = ap.parse_args(argv)
    try:
        extra = tuple(p.short for p in select_plugins(args.extra_plugins)) if args.extra_plugins else ()  # short names
    except RewriteError as e:
        ap.error(f"--extra-plugins: {e}")
    if args.row:
        row = Row(*args.row.split(","))
        try:
            run_row(row, args.out, args.steps, extra)
        except Exception as e:  # a failure of ours: the row says what, the matrix goes on
            row.reason = f"error: {type(e).__name__}: {one_line(e)}"
        print(json.dumps(asdict(row)), flush=True)
        return 0
    rows = []
    for family in args.families.split(","):
        for exporter in args.exporters.split(","):
            for experts in args.experts.split(","):
                for dtype in args.dtypes.split(","):
                    row = Row(family, exporter, experts, dtype)
                    row = run_isolated(row, args.out, args.steps, extra)
                    rows.append(row)
                    print(json.dumps(asdict(row)), flush=True)
    command = "python examples/coverage_matrix.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.markdown:
        args.markdown.write_text(markdown(rows, command.strip(), extra))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    return 0 if all(r.exact for r in rows if r.fused) else 1


if __name__ == "__main__":
    sys.exit(main())
