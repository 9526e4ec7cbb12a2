"""The plugin case declarations, where plugins' test kits have always found them (defined in
:mod:`rewrite.core.cases`, below the plugins, so a plugin declaring cases need not import the test kit)."""

from rewrite.core.cases import Case, bad_input, negative, positive

__all__ = ["Case", "bad_input", "negative", "positive"]
