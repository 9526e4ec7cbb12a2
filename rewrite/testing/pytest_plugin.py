"""pytest plugin (entry point ``pytest11: rewrite``): one test item per (plugin, case, check).

Options::

    pytest --rewrite-plugin=cast               # the conformance checks of plugin 'cast' (repeatable, or a,b)
    pytest --rewrite-conformance               # of every registered plugin, built-in and third-party
    pytest --rewrite-plugin=rmsnorm -k numerics

The plugin loads automatically wherever ``rewrite`` is installed; with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``
add ``-p rewrite.testing.pytest_plugin``.

Items are named ``rewrite-conformance::<plugin>/<case>/<check>`` and appended to whatever else pytest
collects, so they run alongside a package's own tests and obey ``-k``, ``-x`` and ``--lf``. The checks
are those of :mod:`rewrite.testing.conformance`; items of one case share its rewrite, and the numerics items
of one plugin their compiles.

Without either option the plugin adds nothing. Test modules can also generate the items themselves with
:func:`conformance_params` (that is how this project's own CI runs the built-in plugins).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rewrite.testing.conformance import Check, checks_for


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("rewrite", "rewrite plugin conformance kit")
    group.addoption("--rewrite-plugin", action="append", default=[], metavar="NAME",
                    help="run the conformance checks of this rewrite plugin (short name; repeatable or comma-separated)")
    group.addoption("--rewrite-conformance", action="store_true", default=False,
                    help="run the conformance checks of every registered rewrite plugin")


def _selected(config: pytest.Config) -> list:
    from rewrite.plugins.manager import available_plugins, select_plugins

    if config.getoption("rewrite_conformance"):
        return list(available_plugins().values())
    from rewrite.errors import RewriteError

    names = [n.strip() for opt in config.getoption("rewrite_plugin") for n in opt.split(",") if n.strip()]
    try:
        return select_plugins(names) if names else []
    except RewriteError as e:  # an unknown name: a usage error of one line, not pytest's INTERNALERROR traceback
        raise pytest.UsageError(f"--rewrite-plugin: {e}") from None


class ConformanceItem(pytest.Item):
    """One conformance check."""

    def __init__(self, *, check: Check, **kw):
        super().__init__(**kw)
        self.check = check

    def runtest(self) -> None:
        self.check.run()

    def repr_failure(self, excinfo, style=None):
        from rewrite.testing.conformance import ConformanceFailure

        if isinstance(excinfo.value, ConformanceFailure):
            return str(excinfo.value)  # the message says everything; no stack trace
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return Path("rewrite-conformance"), None, self.check.id


class ConformanceCollector(pytest.Collector):
    """Parent of the generated items (a collector without a file)."""

    def __init__(self, *, plugins: list, workdir: Path, **kw):
        super().__init__(**kw)
        self.plugins, self.workdir = plugins, workdir

    def collect(self):
        for p in self.plugins:
            for c in checks_for(p, self.workdir):
                yield ConformanceItem.from_parent(self, name=c.id, check=c)


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselection, so those options apply to the items
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    plugins = _selected(config)
    if not plugins:
        return
    workdir = config._tmp_path_factory.mktemp("rewrite-conformance") if hasattr(config, "_tmp_path_factory") else Path(".rewrite-conformance")
    col = ConformanceCollector.from_parent(session, name="rewrite-conformance", plugins=plugins, workdir=workdir)
    # through the collect-report hooks, so the items are counted and a plugin whose cases fail to build
    # shows as a collection error naming it
    rep = session.ihook.pytest_make_collect_report(collector=col)
    session.ihook.pytest_collectreport(report=rep)
    items.extend(x for x in rep.result if isinstance(x, pytest.Item))


def conformance_params(plugin_names: list[str], workdir: Path) -> list:
    """``pytest.param`` objects (id ``plugin/case/check``) for a parametrized test calling ``check.run()``."""
    from rewrite.plugins.manager import select_plugins

    return [pytest.param(c, id=c.id) for p in select_plugins(plugin_names) for c in checks_for(p, workdir)]
