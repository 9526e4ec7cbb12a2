"""greedy_token: the index np.argmax gives for a logits row, through the f16 fast path and the float fallback."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from rewrite.generate import greedy_token

SPECIALS = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, -65504.0, 6e-8, -6e-8]


@settings(max_examples=300, deadline=None)
@given(arrays(np.float16, st.integers(1, 64), elements=st.one_of(st.floats(width=16), st.sampled_from(SPECIALS))))
def test_same_index_as_numpy(row):
    assert greedy_token(row) == int(np.argmax(row))


def test_ties_negative_rows_and_other_dtypes():
    row = np.array([-3.0, -1.0, -1.0, -2.0], np.float16)  # all negative: the flipped magnitude bits order them
    assert greedy_token(row) == 1
    assert greedy_token(np.array([-0.0, 0.0, -1.0], np.float16)) == 0  # -0.0 == 0.0: the first, as numpy
    assert greedy_token(np.array([1.0, np.nan, 2.0], np.float16)) == 1  # numpy returns the first NaN
    assert greedy_token(np.array([1.0, -np.nan, 2.0], np.float16)) == 1
    big = np.random.default_rng(0).standard_normal(151936).astype(np.float16)
    assert greedy_token(big) == int(np.argmax(big))
    assert greedy_token(big[::2]) == int(np.argmax(big[::2]))  # not contiguous
    assert greedy_token(big.astype(np.float32)) == int(np.argmax(big))
