"""The HSTU mask rules, case by case, against hand-computed 0/1 matrices.

Every expected matrix below was written out by hand from HSTU_SEMANTICS.md (ids ``pi``, end of
ids ``M``); the comment above each one shows the ids used.  Row = query position ``i``, column =
key position ``j``.  A second check compares ``hstu_mask`` with a slow per-element loop written
straight from the spec text (``_helpers.spec_valid``) on random configurations.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _helpers import spec_mask, spec_valid
from hstu_inductor.reference import hstu_mask, position_ids


def mask1(n, N=None, **kw):
    """``hstu_mask`` of a single sequence of length n, as a ``[N, N]`` int matrix."""
    N = n if N is None else N
    t = kw.pop("num_targets", None)
    nt = None if t is None else torch.tensor([t])
    return hstu_mask(torch.tensor([n]), N, num_targets=nt, **kw)[0].to(torch.int64)


def M(rows):
    return torch.tensor(rows, dtype=torch.int64)


def check(got, expected):
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert torch.equal(got, expected), f"\ngot:\n{got}\nexpected:\n{expected}"


def test_plain_causal():
    check(mask1(4), M([
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 1],
    ]))


def test_output_dtype_and_shape():
    m = hstu_mask(torch.tensor([2, 3]), 5)
    assert m.dtype == torch.bool and m.shape == (2, 5, 5)


def test_padding_rows_and_cols_are_false():
    # n = 3 in a padded length of 5: rows 3, 4 and columns 3, 4 are padding.
    check(mask1(3, N=5), M([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0],
    ]))
    # Also with every feature on: padding never becomes valid.
    got = mask1(4, N=7, num_targets=1, max_attn_len=1, contextual_seq_len=2, min_full_attn_seq_len=1)
    assert not got[4:].any() and not got[:, 4:].any()
    got = mask1(3, N=6, causal=False)
    assert not got[3:].any() and not got[:, 3:].any()


def test_num_targets():
    # n = 5, t = 2: M = 3, pi = [0, 1, 2, 3, 3] (rows 3 and 4 are targets sharing id 3).
    # Targets see all history and themselves, never the other target.
    check(mask1(5, num_targets=2), M([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 0, 1],
    ]))


def test_num_targets_three_targets_and_zero_targets():
    # n = 5, t = 3: M = 2, pi = [0, 1, 2, 2, 2].
    check(mask1(5, num_targets=3), M([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 0, 1],
    ]))
    # t = 0 is plain causal.
    check(mask1(4, num_targets=0), mask1(4))


def test_all_targets():
    # n = 3, t = 3: M = 0, pi = [0, 0, 0]: every row sees only itself.
    check(mask1(3, num_targets=3), M([
        [1, 0, 0],
        [0, 1, 0],
        [0, 0, 1],
    ]))


def test_contextual():
    # n = 5, c = 2: pi = [0, 0, 1, 2, 3], M = 4.
    # Contextual rows 0, 1 (id 0) see the whole non-target history; the others see the
    # contextual prefix and their causal past.
    check(mask1(5, contextual_seq_len=2), M([
        [1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
    ]))


def test_contextual_one():
    # c = 1: pi(p) = max(p, 0) = p, M = n; only row 0 has id 0 and it sees all history.
    check(mask1(4, contextual_seq_len=1), M([
        [1, 1, 1, 1],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 1],
    ]))


def test_contextual_with_targets():
    # n = 6, c = 2, t = 2: raw ids [0, 0, 1, 2, 3, 4], M = 6 - 2 + 1 - 2 = 3,
    # pi = min(ids, 3) = [0, 0, 1, 2, 3, 3]; rows 4, 5 are targets.
    # Contextual rows see history (ids < 3) but not the targets.
    check(mask1(6, num_targets=2, contextual_seq_len=2), M([
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 1],
    ]))


def test_window():
    # n = 5, w = 2: pi = position; row i sees i-2 .. i.
    check(mask1(5, max_attn_len=2), M([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 1, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]))
    check(mask1(4, max_attn_len=1), M([
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 1, 1, 0],
        [0, 0, 1, 1],
    ]))


def test_window_larger_than_sequence_is_plain_causal():
    check(mask1(4, max_attn_len=10), mask1(4))


def test_window_with_targets_is_in_id_space():
    # n = 6, t = 2, w = 1: pi = [0, 1, 2, 3, 4, 4], M = 4.
    # Row 5 (a target, id 4) still sees row 3 (id 3, id distance 1) although their
    # raw positions are 2 apart; it sees neither row 2 nor the other target.
    check(mask1(6, num_targets=2, max_attn_len=1), M([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 1, 0, 1],
    ]))


def test_window_with_contextual_is_in_id_space():
    # n = 6, c = 2, w = 1: pi = [0, 0, 1, 2, 3, 4], M = 5.
    # Row 2 (id 1) sees both contextual rows 0 and 1 (both id 0, distance 1) even though
    # row 0 is 2 positions away. Contextual rows see everything (all ids < M).
    check(mask1(6, contextual_seq_len=2, max_attn_len=1), M([
        [1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ]))


def test_window_contextual_and_targets():
    # n = 7, c = 2, t = 2, w = 1: raw ids [0, 0, 1, 2, 3, 4, 5], M = 7 - 2 + 1 - 2 = 4,
    # pi = [0, 0, 1, 2, 3, 4, 4]; rows 5, 6 are targets (id 4), they see id 3 (row 4) and self.
    check(mask1(7, num_targets=2, contextual_seq_len=2, max_attn_len=1), M([
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1, 0, 1],
    ]))


def test_min_full_attn_seq_len():
    # n = 6, w = 1, f = 2: M = 6; rows with pi >= 4 (rows 4, 5) see everything causal.
    check(mask1(6, max_attn_len=1, min_full_attn_seq_len=2), M([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
    ]))


def test_min_full_attn_seq_len_with_targets():
    # n = 6, t = 2, w = 1, f = 1: pi = [0, 1, 2, 3, 4, 4], M = 4; rows with pi >= 3
    # (the last history row 3 and both targets) see everything causal; targets still
    # never see each other.
    check(mask1(6, num_targets=2, max_attn_len=1, min_full_attn_seq_len=1), M([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 1],
    ]))


def test_min_full_attn_without_window_has_no_effect():
    for n in (1, 3, 5):
        check(mask1(n, min_full_attn_seq_len=2), mask1(n))
        check(mask1(n, num_targets=1, min_full_attn_seq_len=2), mask1(n, num_targets=1))


def test_non_causal():
    # causal=False: every in-sequence pair is valid (library docstring); padding stays False.
    check(mask1(3, N=4, causal=False), M([
        [1, 1, 1, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 0],
        [0, 0, 0, 0],
    ]))


def test_lengths_zero_and_one_in_one_batch():
    got = hstu_mask(torch.tensor([0, 1, 3]), 3).to(torch.int64)
    check(got[0], M([[0, 0, 0], [0, 0, 0], [0, 0, 0]]))
    check(got[1], M([[1, 0, 0], [0, 0, 0], [0, 0, 0]]))
    check(got[2], M([[1, 0, 0], [1, 1, 0], [1, 1, 1]]))


def test_lengths_zero_and_one_with_features():
    nt = torch.tensor([0, 1, 1])
    got = hstu_mask(torch.tensor([0, 1, 3]), 3, num_targets=nt, max_attn_len=1).to(torch.int64)
    check(got[0], M([[0, 0, 0], [0, 0, 0], [0, 0, 0]]))
    check(got[1], M([[1, 0, 0], [0, 0, 0], [0, 0, 0]]))
    # n = 3, t = 1: pi = [0, 1, 2]; w = 1.
    check(got[2], M([[1, 0, 0], [1, 1, 0], [0, 1, 1]]))
    got = hstu_mask(torch.tensor([0, 1]), 2, causal=False).to(torch.int64)
    check(got[0], M([[0, 0], [0, 0]]))
    check(got[1], M([[1, 0], [0, 0]]))


def test_batch_rows_are_independent():
    # Each batch entry is the single-sequence mask of its own length / target count.
    lengths, nt = [5, 2, 6], [2, 0, 1]
    got = hstu_mask(torch.tensor(lengths), 6, num_targets=torch.tensor(nt), max_attn_len=2, contextual_seq_len=1)
    for b in range(3):
        alone = mask1(lengths[b], N=6, num_targets=nt[b], max_attn_len=2, contextual_seq_len=1)
        check(got[b].to(torch.int64), alone)


def test_int32_lengths_and_targets():
    a = hstu_mask(torch.tensor([5, 3], dtype=torch.int32), 5, num_targets=torch.tensor([2, 1], dtype=torch.int32))
    b = hstu_mask(torch.tensor([5, 3]), 5, num_targets=torch.tensor([2, 1]))
    assert torch.equal(a, b)


def test_query_positions_select_rows():
    # Delta attention builds only some rows: rows 3, 4 of the n = 5, t = 2 mask above.
    full = mask1(5, num_targets=2)
    got = hstu_mask(torch.tensor([5]), 5, num_targets=torch.tensor([2]), query_positions=torch.tensor([[3, 4]]))
    check(got[0].to(torch.int64), full[3:5])
    check(got[0].to(torch.int64), M([[1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]))


def test_position_ids_by_hand():
    lengths = torch.tensor([7])
    pos = torch.arange(7)

    def ids_end(nt, c):
        ids, end = position_ids(pos, lengths, nt, c)
        # ids "broadcast against lengths[:, None]": compare in the broadcast shape [B, P].
        return torch.broadcast_to(ids, (1, 7)).tolist(), end.tolist()

    assert ids_end(torch.tensor([2]), 2) == ([[0, 0, 1, 2, 3, 4, 4]], [[4]])
    assert ids_end(None, 3) == ([[0, 0, 0, 1, 2, 3, 4]], [[5]])
    assert ids_end(None, 0) == ([[0, 1, 2, 3, 4, 5, 6]], [[7]])
    assert ids_end(torch.tensor([3]), 0) == ([[0, 1, 2, 3, 4, 4, 4]], [[4]])


# ------------------------------------------------------------------------------------------------
# The slow spec loop itself reproduces the hand-computed cases (so it is a trustworthy oracle).
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [
    dict(n=5, t=2),
    dict(n=6, t=2, c=2),
    dict(n=6, c=2, w=1),
    dict(n=7, t=2, c=2, w=1),
    dict(n=6, w=1, f=2),
    dict(n=6, t=2, w=1, f=1),
])
def test_spec_loop_matches_hand_cases(case):
    n = case["n"]
    kw = dict(num_targets=case.get("t"), max_attn_len=case.get("w", 0), contextual_seq_len=case.get("c", 0),
              min_full_attn_seq_len=case.get("f", 0))
    hand = mask1(n, **kw)
    loop = torch.tensor([[int(spec_valid(i, j, n, case.get("t"), case.get("w", 0), case.get("c", 0),
                                         case.get("f", 0))) for j in range(n)] for i in range(n)])
    check(hand, loop)


# ------------------------------------------------------------------------------------------------
# Random configurations against the per-element spec loop.
# ------------------------------------------------------------------------------------------------
@st.composite
def mask_configs(draw):
    N = draw(st.integers(1, 9))
    B = draw(st.integers(1, 3))
    c = draw(st.integers(0, 3))
    lengths = draw(st.lists(st.integers(0, N), min_size=B, max_size=B))
    use_t = draw(st.booleans())
    # Targets come after the contextual prefix: t <= n - c when n >= c (else t = 0).
    nt = [draw(st.integers(0, max(n - c, 0))) for n in lengths] if use_t else None
    w = draw(st.integers(0, 4))
    f = draw(st.integers(0, 3))
    causal = draw(st.booleans()) if draw(st.integers(0, 4)) == 0 else True
    return N, lengths, nt, w, c, f, causal


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(mask_configs())
def test_mask_matches_spec_loop(cfg):
    N, lengths, nt, w, c, f, causal = cfg
    got = hstu_mask(torch.tensor(lengths), N, None if nt is None else torch.tensor(nt), w, c, f, causal)
    expected = spec_mask(lengths, N, nt, w, c, f, causal)
    assert torch.equal(got, expected), (cfg, got.int(), expected.int())
