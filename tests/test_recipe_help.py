"""`diffrl train --recipe NAME --help` shows the recipe's values as the defaults."""

from __future__ import annotations

import re

import pytest

from diffrl.cli.main import main
from diffrl.recipes import recipe_config


def _default_of(help_text: str, flag: str) -> str:
    """The `(default: …)` of `flag` in the help: the first after the line that starts with the flag and its type."""
    match = re.search(rf"^[\W]*{re.escape(flag)} [A-Z]+\b.*?\(default: ([^)]*)\)", help_text, re.M | re.S)
    return match.group(1)


@pytest.mark.parametrize("recipe", [None, "shapes-nft"])
def test_help_shows_the_recipes_values_as_defaults(recipe, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as done:
        main(["train", *(["--recipe", recipe] if recipe else []), "--help"])
    assert done.value.code == 0
    captured = capsys.readouterr()
    text = captured.out + captured.err
    cfg = recipe_config(recipe)
    assert _default_of(text, "--num-rollout") == str(cfg.rollout.num_rollout)
    assert float(_default_of(text, "--lr")) == cfg.optim.lr
