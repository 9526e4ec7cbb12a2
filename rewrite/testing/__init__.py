"""Testing support for plugins: declared cases (:mod:`rewrite.testing.cases`) and the conformance kit."""

from rewrite.testing.cases import Case, bad_input, negative, positive

__all__ = ["Case", "bad_input", "negative", "positive"]
