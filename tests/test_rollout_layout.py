"""Seed layout, microgroup splits and the batch invariant (docs/architecture.md, "Rollout contract")."""

import pytest

from diffrl.rollout import check_batch_invariant, group_seed_base, microgroups


def test_seed_base_formula_and_wrap():
    assert group_seed_base(0, 0, 16) == 0
    assert group_seed_base(7, 3, 16) == 7 + 48
    # Wraps at 2**31: the seed stays a valid 31-bit seed however long the run.
    assert group_seed_base(2**31 - 10, 1, 16) == 6
    assert group_seed_base(123, 2**31, 16) == 123
    assert group_seed_base(5, 10**12, 8) == (5 + 8 * 10**12) % 2**31
    with pytest.raises(ValueError, match="group_index"):
        group_seed_base(0, -1, 16)


def test_consecutive_groups_get_disjoint_seed_ranges():
    n = 16
    seeds = [group_seed_base(1000, g, n) + k for g in range(50) for k in range(n)]
    assert len(set(seeds)) == len(seeds)


@pytest.mark.parametrize("m,expected", [
    (8, [(0, 8), (8, 8)]),
    (5, [(0, 5), (5, 5), (10, 5), (15, 1)]),
    (1, [(k, 1) for k in range(16)]),
    (16, [(0, 16)]),
    (32, [(0, 16)]),
])
def test_microgroup_splits_for_16(m, expected):
    assert microgroups(16, m) == expected
    assert sum(size for _, size in microgroups(16, m)) == 16


def test_bad_sizes_name_the_flag():
    with pytest.raises(ValueError, match="--rollout-microgroup-size"):
        microgroups(16, 0)
    with pytest.raises(ValueError, match="--n-samples-per-prompt"):
        microgroups(0, 4)


def test_batch_invariant():
    check_batch_invariant(32, 16, 256, 2)
    with pytest.raises(ValueError) as err:
        check_batch_invariant(32, 16, 256, 3)
    for flag in ("--rollout-batch-size", "--n-samples-per-prompt", "--global-batch-size", "--num-steps-per-rollout"):
        assert flag in str(err.value)
