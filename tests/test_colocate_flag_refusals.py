"""Flags that only a --colocate engine reads are refused without it (they did nothing, silently)."""

import pytest

from diffrl.cli.main import parse


@pytest.mark.parametrize("flags, named", [
    (["--engine-sleep-level", "2"], "--engine-sleep-level 2"),
    (["--engine-sleep-level", "0"], "--engine-sleep-level 0"),
    (["--update-weight-buffer-size", "4096"], "--update-weight-buffer-size 4096"),
])
def test_colocate_only_flags_without_colocate_are_refused(flags, named):
    with pytest.raises(ValueError, match=f"{named} .*add --colocate or drop it"):
        parse(["train", *flags]).check()


def test_colocate_only_flags_with_colocate_or_at_their_defaults_pass():
    parse(["train", "--colocate", "--engine-sleep-level", "0", "--update-weight-buffer-size", "4096"]).check()
    parse(["train", "--engine-sleep-level", "1"]).check()  # the default: nothing to refuse
