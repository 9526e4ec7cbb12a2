"""The ``rewrite`` command line.

Exit status: 0 success; 1 a verification found outputs beyond tolerance; 2 bad input or a failure, with a
one-line ``error:`` message naming the file, node or value (nothing written); 3 ``apply --expect`` counts
not reached.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from rewrite.errors import RewriteError

# tables are read in logs and CI output as often as in terminals: never narrower than 140 columns
console = Console(width=max(shutil.get_terminal_size((140, 24)).columns, 140), highlight=False)


_INT64_MAX = (1 << 63) - 1


def _tolerance(v: float | None) -> float | None:
    """A tolerance option's value: None, or a finite number >= 0.

    Raises:
        click.BadParameter: negative, NaN or infinite.
    """
    if v is not None and not (np.isfinite(v) and v >= 0):
        raise click.BadParameter(f"{v}: expected a finite number >= 0")
    return v


def _parse_dims(dims: tuple[str, ...]) -> dict[str, int]:
    """``--dim NAME=INT`` (repeatable) -> ``{NAME: INT}``; a dim is a size: 0 to 2^63 - 1, each name once.

    Raises:
        click.BadParameter: not NAME=INT, a size out of that range, a name given twice with other sizes.
    """
    out = {}
    for d in dims:
        k, sep, v = d.partition("=")
        k, v = k.strip(), v.strip()
        if not sep or not k or not (v.isascii() and v.isdigit()):
            raise click.BadParameter(f"'{d}': expected NAME=INT with INT >= 0, e.g. seq_len=1", param_hint="--dim")
        if int(v) > _INT64_MAX:
            raise click.BadParameter(f"'{d}': {v} is past an ONNX dim's int64 range", param_hint="--dim")
        if out.get(k, int(v)) != int(v):
            raise click.BadParameter(f"'{d}': {k} is already {out[k]}", param_hint="--dim")
        out[k] = int(v)
    return out


def _parse_opts(opts: tuple[str, ...]) -> dict[str, dict]:
    """``--opt quant4.block_size=64`` -> ``{"quant4": {"block_size": 64}}`` (RewriteContext.options).

    Values: ``true``/``false`` -> bool, integer or float literals -> int/float, anything else -> str."""
    out: dict[str, dict] = {}
    for o in opts:
        key, sep, v = o.partition("=")
        plugin, dot, name = key.strip().partition(".")
        if not sep or not dot or not plugin or not name:
            raise click.BadParameter(f"'{o}': expected PLUGIN.KEY=VALUE, e.g. quant4.block_size=64", param_hint="--opt")
        v = v.strip()
        value: object = {"true": True, "false": False}.get(v.lower(), v)
        for conv in (int, float):
            if isinstance(value, str):
                try:
                    value = conv(v)
                except ValueError:
                    pass
        out.setdefault(plugin, {})[name.strip()] = value
    return out


def _load_feeds(path: str | None) -> dict[str, np.ndarray] | None:
    if path is None:
        return None
    import ml_dtypes

    try:
        with np.load(path) as z:
            feeds = {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise RewriteError(f"{path}: cannot read inputs ({e}); expected an .npz of arrays named after the model inputs") from e
    # numpy has no bfloat16: an .npz keeps ml_dtypes' bfloat16 as 2-byte voids ('run --save' writes them so)
    return {k: a.view(ml_dtypes.bfloat16) if a.dtype.kind == "V" and a.dtype.itemsize == 2 and a.dtype.names is None else a
            for k, a in feeds.items()}


@click.group()
@click.version_option(package_name="rewrite")
def cli() -> None:
    """Rewrite ONNX models with pattern plugins and lower them to ONNX Runtime or IREE."""


@cli.command("plugins")
def plugins_cmd() -> None:
    """List the registered plugins (built-in and from the 'rewrite.plugins' entry point)."""
    from rewrite.plugins.manager import available_plugins

    t = Table("plugin", "short", "rules", "backends", "kernel objects", "description")
    for p in available_plugins().values():
        t.add_row(p.name, p.short, ", ".join(r.name for r in p.rules) or "-", ", ".join(p.backends), ", ".join(k.path for k in p.kernels) or "-", p.description)
    console.print(t)


#: files an output folder of apply may hold (rewrite.backends): a report must not take their names
FOLDER_FILES = frozenset({"manifest.json", "model.onnx", "model.onnx.data", "model.irpa", "model.vmfb",
                          "model.mlir", "compile.log"})


def _check_writable(option: str, path: str | None, out_dir: str | None = None, model: str | None = None) -> None:
    """A file option's folder must exist before any work starts (not fail after the output folder is written);
    the output folder itself counts as existing (it is written before the file). The file must not be the output
    folder or a folder above it, one of :data:`FOLDER_FILES` in it, nor ``model`` or one of its external data
    files (it would be overwritten with JSON).

    Raises:
        click.UsageError: the folder is missing or is not a folder; the path is the output folder or above it, a
            file of the folder's, the model or its external data.
    """
    if not path:
        return
    target = Path(path).resolve()
    parent = target.parent
    if not parent.is_dir() and not (out_dir and parent == Path(out_dir).resolve()):
        raise click.UsageError(f"{option} {path}: folder '{Path(path).parent}' does not exist")
    if out_dir:
        out = Path(out_dir).resolve()
        if target == out or target in out.parents:
            raise click.UsageError(f"{option} {path}: that is the output folder or a folder above it; give a file")
        if target.parent == out and target.name in FOLDER_FILES:
            raise click.UsageError(f"{option} {path}: the output folder's own {target.name}; give another name")
    if model and target.exists() and _is_model_file(target, Path(model)):
        raise click.UsageError(f"{option} {path}: that is the model {model} or one of its external data files; "
                               "give another file")


def _is_model_file(target: Path, model: Path) -> bool:
    """Whether ``target`` (resolved, existing) is ``model`` or a file its initializers' external data lives in
    (resolved from the model's folder as given, as the loader does: links there may lead anywhere)."""
    if not model.is_file():
        return False
    if target == model.resolve():
        return True
    from rewrite.core.onnx_io import external_locations, read_model

    try:
        locations = external_locations(read_model(model))
    except RewriteError:
        return False  # an unreadable model is reported by the command itself
    folder = Path(os.path.abspath(model)).parent
    return any((folder / loc).resolve() == target for loc in locations)


def _folder_file(path: str | None, out_dir: str) -> bool:
    """Whether ``path`` is a file the output folder ``out_dir`` now holds (after apply wrote it)."""
    return bool(path) and Path(path).exists() and Path(out_dir).resolve() in Path(path).resolve().parents


def _print_report(report: list[dict]) -> None:
    t = Table("plugin", "rule", "matches", "removed", "added", "refusals (at nodes) / why nothing matched")
    for pr in report:
        for r in pr["rules"]:
            ref = "; ".join(f"{x['count']}x {x['reason']} ({', '.join(x['nodes'][:2])}{', ...' if x['count'] > 2 else ''})" for x in r["refusals"][:3])
            if not ref and "best_partial" in r:  # see 'rewrite explain' for the matched pattern nodes
                bp = r["best_partial"]
                ref = f"best partial match stopped: {bp['reason']}" + (f" ({bp['node']})" if bp["node"] else "")
            t.add_row(pr["plugin"], r["rule"], str(r["matches"]), str(r["nodes_removed"]), str(r["nodes_added"]), ref or "-")
        for note in pr["notes"]:
            t.add_row(pr["plugin"], "(note)", "", "", "", note)
    console.print(t)


def _print_interface_notes(m) -> None:
    """Say where the folder's interface differs from the source's, or could: frozen inputs, kept defaults."""
    if m.frozen_inputs:
        click.echo(f"frozen (now constants, no longer inputs): {_names(m.frozen_inputs)}")
    kept = [d["name"] for d in m.inputs if d.get("default")]
    if kept:
        click.echo(f"inputs with initializer defaults kept overridable: {_names(kept)} (--freeze-inputs makes them constants)")


class _ProgressBars:
    """Draws one rich progress bar per running stage (`rewrite.core.stages`) on stderr; finished stages leave."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                  TimeElapsedColumn(), console=Console(stderr=True), transient=True)
        self._tasks: dict[str, object] = {}

    def __enter__(self):
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def started(self, name: str, total: int | None, unit: str) -> None:
        self._tasks[name] = self._progress.add_task(name, total=total if unit == "B" and total else None)

    def advanced(self, name: str, done: int) -> None:
        if name in self._tasks:
            self._progress.update(self._tasks[name], completed=done)

    def finished(self, record) -> None:
        task = self._tasks.pop(record.name, None)
        if task is not None:
            self._progress.remove_task(task)


def _print_stages(records) -> None:
    t = Table("stage", "seconds", "RSS MiB", "peak RSS MiB", "child peak MiB", "done")
    for r in records:
        done = f"{r.done / 2**20:.0f} MiB" if r.unit == "B" and r.total else "-"
        t.add_row(r.name, f"{r.seconds:.2f}", f"{r.rss_mb:.0f}", f"{r.peak_rss_mb:.0f}", f"{r.children_peak_rss_mb:.0f}", done)
    console.print(t)


def _names(names: list[str], shown: int = 6) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


@cli.command("apply")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--plugins", "plugin_names", default="", help="Comma-separated short names, run in the order their dependencies give, whatever the order here (see 'rewrite plugins').")
@click.option("--backend", type=click.Choice(["ort", "iree"]), default="ort", show_default=True)
@click.option("--target", default=None, help="ort: cpu (default) or cuda; iree: llvm-cpu (default) or cuda.")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), help="Output folder (an earlier output folder of apply is replaced; another non-empty folder is refused); required unless --dry-run.")
@click.option("--dim", "dims", multiple=True, help="Fix a symbolic dim, NAME=INT (repeatable).")
@click.option("--opt", "opts", multiple=True, metavar="PLUGIN.KEY=VALUE", help="A plugin option, e.g. quant4.block_size=64 (repeatable).")
@click.option("--report", "report_path", type=click.Path(dir_okay=False), help="Also write the plugin report as JSON.")
@click.option("--expect", "expect", multiple=True, metavar="PLUGIN[/RULE]=N",
              help="Exit with status 3 when PLUGIN (or one rule of it) matches fewer than N times (repeatable).")
@click.option("--dry-run", is_flag=True, help="Run the plugins in memory and print the report; lower and write nothing (--report still writes the JSON).")
@click.option("--max-seq", type=int, default=None, help="kv: turn a growing (Concat) KV cache into a static one of this many positions (same as --opt kv.max_seq=N).")
@click.option("--stateful", is_flag=True, help="iree: keep the KV cache in the compiled module (one util.global); the function takes ids and position.")
@click.option("--next-token", is_flag=True, help="Also output the greedy next token (ArgMax of the last position's logits, int64 [B, 1]): "
                                                  "'rewrite generate' then keeps a stateful module's decode steps on the device, several in flight.")
@click.option("--freeze-inputs", is_flag=True, help="Make graph inputs that have an initializer default constants (they leave the interface; plugins may fold them).")
@click.option("--cuda-sm", default=None, metavar="SM", help="iree --target cuda: the SM to compile for, e.g. sm_90 (default sm_80, whose PTX runs on sm_80 and later).")
@click.option("--module-from", type=click.Path(file_okay=False, exists=True), default=None, metavar="FOLDER",
              help="iree: take the compiled module from FOLDER, an output folder of the same apply on another machine, "
                   "and write only the weights here (no IREE compiler needed).")
@click.option("--quiet", is_flag=True, help="No progress bars and no stage table (for scripts); the report table and errors stay.")
@click.option("--stages", "stages_path", type=click.Path(dir_okay=False), help="Write each stage's time and memory (load, shapes, each plugin, save, import, compile) as JSON.")
def apply_cmd(model, plugin_names, backend, target, out_dir, dims, opts, report_path, expect, dry_run, max_seq, stateful, next_token,
              freeze_inputs, cuda_sm, module_from, quiet, stages_path) -> None:
    """Rewrite MODEL with --plugins and lower it for --backend into OUT."""
    from rewrite.core.stages import Listener, recording

    _check_writable("--stages", stages_path, None if dry_run else out_dir, model)
    bars = contextlib.nullcontext(Listener()) if quiet or not sys.stderr.isatty() else _ProgressBars()
    with bars as listener, recording(listener) as rec:
        _apply(model, plugin_names, backend, target, out_dir, dims, opts, report_path, expect, dry_run, max_seq, stateful,
               next_token, freeze_inputs, cuda_sm, module_from, rec, quiet, stages_path)


class _Shortfall(Exception):
    """``apply --expect`` fell short once the plugins ran: their reports (JSON dicts) and the messages."""

    def __init__(self, report: list[dict], messages: list[str]):
        super().__init__("; ".join(messages))
        self.report, self.messages = report, messages


def _apply(model, plugin_names, backend, target, out_dir, dims, opts, report_path, expect, dry_run, max_seq, stateful,
           next_token, freeze_inputs, cuda_sm, module_from, rec, quiet, stages_path) -> None:
    from rewrite.explain import parse_expect, preview, shortfalls
    from rewrite.pipeline import apply

    expected = parse_expect(expect)
    options = _parse_opts(opts)
    _check_writable("--report", report_path, None if dry_run else out_dir, model)
    if report_path and stages_path and Path(report_path).resolve() == Path(stages_path).resolve():
        raise click.UsageError(f"--report and --stages are both {report_path}; give two files")
    if max_seq is not None:
        if options.get("kv", {}).get("max_seq", max_seq) != max_seq:
            raise click.UsageError(f"--max-seq {max_seq} and --opt kv.max_seq={options['kv']['max_seq']} disagree; give one")
        options.setdefault("kv", {})["max_seq"] = max_seq
    if cuda_sm is not None:
        if backend != "iree" or target != "cuda":
            raise click.UsageError("--cuda-sm needs --backend iree --target cuda")
        options["cuda_sm"] = cuda_sm
    if stateful:
        if backend != "iree":
            raise click.UsageError("--stateful needs --backend iree")
        options["stateful"] = True
    if next_token:
        options["next_token"] = True
    if module_from is not None:
        if backend != "iree":
            raise click.UsageError("--module-from needs --backend iree")
        options["module_from"] = module_from
    if dry_run:
        report = [r.to_json() for r in preview(model, plugin_names, dims=_parse_dims(dims), backend=backend, options=options,
                                               freeze_inputs=freeze_inputs, target=target)]
    elif out_dir is None:
        raise click.UsageError("missing option '-o' / '--out' (or use --dry-run)")
    else:
        def check_expected(reports) -> None:  # before lowering: a shortfall ends apply with nothing written
            short = shortfalls(expected, [r.to_json() for r in reports])
            if short:
                raise _Shortfall([r.to_json() for r in reports], short)

        try:
            m = apply(model, out_dir, plugins=plugin_names, backend=backend, target=target, dims=_parse_dims(dims),
                      options=options, freeze_inputs=freeze_inputs, before_lowering=check_expected if expected else None)
        except _Shortfall as e:
            _print_report(e.report)
            if report_path:
                Path(report_path).write_text(json.dumps(e.report, indent=1) + "\n")
            for msg in e.messages:
                click.echo(f"error: {msg}", err=True)
            click.echo(f"nothing lowered or written to {out_dir}" + (f" except {report_path}" if report_path else ""), err=True)
            sys.exit(3)
        report = m.report
        for option, path in (("--report", report_path), ("--stages", stages_path)):
            if _folder_file(path, out_dir):
                click.echo(f"warning: {option} {path} is a file of the output folder {out_dir}, which is written; "
                           "not overwritten with the JSON", err=True)
                report_path, stages_path = (None, stages_path) if option == "--report" else (report_path, None)
    _print_report(report)
    if report_path:
        Path(report_path).write_text(json.dumps(report, indent=1) + "\n")
    if not quiet:
        _print_stages(rec.records)
    if stages_path:
        Path(stages_path).write_text(json.dumps([r.to_json() for r in rec.records], indent=1) + "\n")
    if dry_run:
        click.echo("dry run: nothing written" + (f" except {report_path}" if report_path else ""))
    else:
        click.echo(f"wrote {out_dir} ({m.backend}/{m.target}): {', '.join(sorted(m.files.values()) or [m.model])}")
        _print_interface_notes(m)
    short = shortfalls(expected, report) if dry_run else []  # (with -o, check_expected stopped apply before lowering)
    if short:
        for msg in short:
            click.echo(f"error: {msg}", err=True)
        sys.exit(3)


@cli.command("explain")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--plugins", "plugin_names", required=True, help="Comma-separated short names, run in order as 'apply' runs them.")
@click.option("--node", default=None, help="Only attempts anchored at, or whose partial match involves, this graph node.")
@click.option("--dim", "dims", multiple=True, help="Fix a symbolic dim, NAME=INT (repeatable).")
@click.option("--all", "show_all", is_flag=True, help="Also list the rules that fired.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the explanations as JSON.")
@click.option("--freeze-inputs", is_flag=True, help="As for 'apply': inputs with initializer defaults become constants.")
@click.option("--backend", type=click.Choice(["ort", "iree"]), default=None,
              help="Run the plugins as 'apply --backend' does (default: ort, or iree when a plugin rewrites for iree only).")
def explain_cmd(model, plugin_names, node, dims, show_all, json_path, freeze_inputs, backend) -> None:
    """Why each rule of --plugins did (not) fire on MODEL: best partial match and the reason it stopped."""
    from rewrite.explain import explain

    _check_writable("--json", json_path, model=model)
    exps = explain(model, plugin_names, node=node, dims=_parse_dims(dims), freeze_inputs=freeze_inputs, backend=backend)
    for e in exps:
        if show_all or e.status != "fired" or e.refusals:  # a pass's refusals, even where its step fired
            click.echo("\n".join(e.lines()))
    fired = [e for e in exps if e.status == "fired"]
    if fired and not show_all:
        click.echo("fired: " + ", ".join(f"{e.plugin}/{e.rule} x{e.matches}" for e in fired))
    if json_path:
        Path(json_path).write_text(json.dumps([e.to_json() for e in exps], indent=1) + "\n")


@cli.command("run")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--inputs", "inputs_path", type=click.Path(dir_okay=False), help=".npz of inputs by name (default: generated).")
@click.option("--seed", default=0, show_default=True)
@click.option("--save", "save_path", type=click.Path(dir_okay=False),
              help="Write the outputs to this .npz (bfloat16 as its 2-byte bits, which --inputs reads back as bfloat16).")
@click.option("--low-memory/--no-low-memory", "low_memory", default=None,
              help="Keep an ort folder's weights memory-mapped (ONNX Runtime prepacking off: memory that does not grow "
                   "with the weights, calls about 10x slower). Default: on when the folder's files exceed 40% of the "
                   "available memory.")
def run_cmd(folder, inputs_path, seed, save_path, low_memory) -> None:
    """Run a lowered output FOLDER on its runtime and summarize the outputs."""
    from rewrite.backends import load_runner
    from rewrite.verify import default_feeds

    runner = load_runner(folder, low_memory=low_memory)
    feeds = _load_feeds(inputs_path) or default_feeds(Path(folder), seed=seed)
    outs = runner.run(feeds)
    for k, v in outs.items():
        stats = f"min={v.min():.4g} max={v.max():.4g}" if v.size and np.issubdtype(v.dtype, np.number) else ""
        click.echo(f"{k:<40} {str(v.dtype):<8} {str(list(v.shape)):<20} {stats}")
    if save_path:
        np.savez(save_path, **outs)


@cli.command("generate")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--prompt-ids", required=True, help="Comma-separated prompt token ids, e.g. 1,2,3.")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=32, show_default=True)
@click.option("--compare", "compare_model", type=click.Path(dir_okay=False), default=None,
              help="Also run this ONNX model (e.g. the source, or the quant4 model for a quant4 folder) on ONNX Runtime "
                   "at the basic level, fed the same tokens, and compare the logits of every call (exit 1 past tolerance).")
@click.option("--low-memory/--no-low-memory", "low_memory", default=None,
              help="Keep an ort folder's weights memory-mapped (ONNX Runtime prepacking off: memory that does not grow "
                   "with the weights, calls about 10x slower). Default: on when the folder's files exceed 40% of the "
                   "available memory.")
@click.option("--device-decode/--host-decode", "device_decode", default=None,
              help="A stateful IREE folder applied with --next-token: keep the decode steps on the device, several queued "
                   "ahead (default: on for GPU targets), or take each call's argmax on the host.")
def generate_cmd(folder, prompt_ids, max_new_tokens, compare_model, low_memory, device_decode) -> None:
    """Prefill --prompt-ids and decode greedily through FOLDER (stateful or not); print the new token ids."""
    import gc
    import time

    from rewrite.generate import Generator

    items = prompt_ids.split(",")
    for i, t in enumerate(items):
        t = t.strip()
        if not (t.isascii() and t.isdigit()) or int(t) > _INT64_MAX:
            raise click.BadParameter(f"item {i + 1} of {len(items)} ({t!r}): expected a token id, an integer from 0 to "
                                     "2^63 - 1, and comma-separated ids", param_hint="--prompt-ids")
    ids = [int(t) for t in items]
    from rewrite.backends import needs_low_memory

    low_memory = needs_low_memory(folder) if low_memory is None else low_memory
    gen = Generator(folder, low_memory=low_memory, device_decode=device_decode)
    t0 = time.perf_counter()
    res = gen.generate(ids, max_new_tokens, logits=compare_model is not None)  # --compare checks every call's logits
    dt = time.perf_counter() - t0
    click.echo(",".join(str(t) for t in res.tokens))
    how = "stateful" if gen.state else "stateless"
    if gen.decodes_on_device and compare_model is None and max_new_tokens > 1:
        how += ", decode steps on the device"
    elif device_decode and not getattr(gen.runner, "decodes_on_device", False):
        how += ("; --device-decode: this folder decodes on the host (it needs a stateful IREE module applied with "
                "--next-token and one token per call)")
    click.echo(f"{len(res.tokens)} tokens in {dt * 1e3:.1f} ms ({how} {gen.manifest.backend}/{gen.manifest.target})", err=True)
    if compare_model is None:
        return
    del gen  # one model in memory at a time: a full-size folder and its reference do not fit together
    gc.collect()
    ok = _compare_decoding(compare_model, folder, ids, res, low_memory)
    sys.exit(0 if ok else 1)


def _compare_decoding(model: str, folder: str, ids: list[int], res, low_memory: bool) -> bool:
    """Teacher-forced reference run of ``model`` on ``res.tokens``; prints one line per call and a verdict."""
    from rewrite.generate import Generator
    from rewrite.verify import compare, describe_comparison

    click.echo(describe_comparison(model, folder, low_memory=low_memory).replace("verify:", "compare:", 1))

    ref = Generator.reference(model, low_memory=low_memory).replay(ids, res.tokens)
    ref_tokens = [int(np.argmax(r[0, -1])) for r in ref]
    ok = True
    for k, (got, want) in enumerate(zip(res.logits, ref)):
        c = compare("logits", got, want[:, -got.shape[1]:])  # a one-token module's prefill: its last position
        ok &= c.ok
        call = "prefill" if k == 0 else f"decode {k}"
        click.echo(f"{call:9} token {res.tokens[k]:>7} reference {ref_tokens[k]:>7}  max_abs={c.max_abs:.3e} "
                   f"max_rel={c.max_rel:.3e} ({'ok' if c.ok else 'FAIL'}, {c.dtype} tolerance)")
    same = sum(a == b for a, b in zip(res.tokens, ref_tokens))
    click.echo(f"compare: {'PASS' if ok else 'FAIL'} against {model} (ONNX Runtime, basic level): "
               f"{same} of {len(ref_tokens)} tokens equal")
    return ok


@cli.command("verify")
@click.argument("model", type=click.Path(dir_okay=False))
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--inputs", "inputs_path", type=click.Path(dir_okay=False),
              help=".npz of inputs by name (default: generated: consistent decoder inputs, other symbolic dims 1, "
                   "floats N(0, 0.5^2) and integers 0..3, no NaN or infinity).")
@click.option("--rtol", type=float, default=None, callback=lambda ctx, param, v: _tolerance(v),
              help="Relative tolerance for float outputs (default by dtype: f32 1e-4, f16 1e-2).")
@click.option("--seed", default=0, show_default=True)
@click.option("--locate", is_flag=True, help="Expose intermediate values and name the first node that differs.")
@click.option("--low-memory/--no-low-memory", "low_memory", default=None,
              help="Keep an ort folder's weights memory-mapped (ONNX Runtime prepacking off: memory that does not grow "
                   "with the weights, calls about 10x slower). Default: on when the folder's files exceed 40% of the "
                   "available memory.")
@click.option("--float32-reference", "float32", is_flag=True,
              help="Also compare float16 outputs with MODEL widened to float32: beyond tolerance still passes when no "
                   "farther from it than twice MODEL's own fp16 distance (at most 5 tolerances; nothing where MODEL "
                   "overflows).")
def verify_cmd(model, folder, inputs_path, rtol, seed, locate, low_memory, float32) -> None:
    """Compare FOLDER's lowered model with MODEL on ONNX Runtime CPU (exit 1 when beyond tolerance)."""
    from rewrite import verify as v
    from rewrite.backends import needs_low_memory

    feeds = _load_feeds(inputs_path)
    low_memory = needs_low_memory(folder) if low_memory is None else low_memory
    click.echo(v.describe_comparison(model, folder, low_memory=low_memory))
    res = v.verify(model, folder, feeds=feeds, rtol=rtol, seed=seed, low_memory=low_memory, float32=float32)
    for c in res:
        click.echo(c.line())
    if float32 and not any(c.fp32_rel is not None for c in res):
        click.echo("verify: --float32-reference: no float16 output to compare with MODEL's float32 twin")
    ok = all(c.ok for c in res)
    click.echo("verify: PASS" if ok else "verify: FAIL")
    if locate:
        loc = v.locate(model, folder, feeds=feeds, rtol=rtol, seed=seed)
        click.echo(loc.line() if loc else "locate: every exposed intermediate value agrees with ONNX Runtime")
    sys.exit(0 if ok else 1)


def _exit_on_signal(signum, _frame) -> None:
    # SystemExit unwinds like any exception: staging folders are removed by their finally blocks, and a running
    # iree-compile or importer child is killed by subprocess.run on the way out
    raise SystemExit(128 + signum)


def main() -> None:
    """Console-script entry point: turns RewriteError (and OSError: a full disk, a missing permission) into
    ``error: ...`` and exit status 2; SIGTERM and SIGHUP
    end the run like Ctrl-C does (nothing half-written left behind, child processes ended), exit 128 + signal."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's ignored SIGHUP stays ignored
            signal.signal(sig, _exit_on_signal)
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as e:  # usage errors too: one 'error:' line, like every other failure
        hint = f" (see 'rewrite {e.ctx.info_name} --help')" if getattr(e, "ctx", None) is not None and e.ctx.parent is not None else ""
        click.echo(f"error: {e.format_message()}{hint}", err=True)
        sys.exit(2)
    except RewriteError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except OSError as e:  # the machine's, not the model's: a full disk, a missing permission
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
