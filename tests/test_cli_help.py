"""The CLI explains itself: subcommands listed with one line each, every train option described, the recipes and
rewards listed, and `diffrl --help` answered without loading the models' libraries."""

import dataclasses
import subprocess
import sys

import pytest

from tyro import _docstrings

from diffrl.cli.main import SUBCOMMAND_SUMMARIES, _subcommands, main
from diffrl.recipes import recipe_names
from diffrl.train.config import _SECTIONS, TrainConfig


def test_every_train_option_has_a_description():
    undescribed = [f"--{f.name.replace('_', '-')}" for kind in (TrainConfig, *_SECTIONS.values())
                   for f in dataclasses.fields(kind)
                   if f.name not in _SECTIONS and not _docstrings.get_field_docstring(kind, f.name, ())]
    assert undescribed == []


def test_top_help_lists_every_subcommand_with_one_line(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in [*_subcommands(), "recipes", "rewards"]:
        assert any(line.split()[:1] == [name] and len(line.split()) > 3 for line in out.splitlines()), name
    assert set(SUBCOMMAND_SUMMARIES) == {*_subcommands(), "recipes", "rewards"}


def test_recipes_and_rewards_are_listed(capsys):
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[0] for line in lines] == recipe_names() and all(len(line.split()) > 2 for line in lines)
    assert main(["rewards"]) == 0
    out = capsys.readouterr().out
    for name in ("shapes", "ocr", "jpeg_compressibility", "pickscore", "clipscore", "aesthetic", "hpsv2"):
        assert f"  {name} " in out
    assert "fn(images, prompts, metadata)" in out


def test_unknown_reward_lists_model_rewards_and_the_custom_signature():
    import pytest

    from diffrl.rewards import get_reward

    with pytest.raises(ValueError) as err:
        get_reward("pickscor")
    assert "pickscore@PATH" in str(err.value) and "hpsv2@PATH" in str(err.value)
    assert "fn(images, prompts, metadata)" in str(err.value)


def test_top_help_loads_no_model_library():
    code = ("import sys; from diffrl.cli.main import main; main(['--help']); "
            "print(sorted(m for m in ('torch', 'diffusers', 'transformers', 'tyro') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


# What building a subcommand's parser and printing its help may not import: torch alone took ~2.3 s of the ~5 s
# `diffrl train --help` took, httpx (the remote rewards' and engines' client) another 0.3 s; `diffrl serve --help`
# took ~3 s while its flags lived in the server's module (torch and fastapi), now in serving/config.py.
HELP_MAY_NOT_LOAD = ("torch", "httpx", "diffusers", "transformers", "fastapi")


def _loaded_by(argv: list[str]) -> list[str]:
    code = ("import sys\nfrom diffrl.cli.main import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            f"print(' '.join(['loaded:', *(m for m in {HELP_MAY_NOT_LOAD!r} if m in sys.modules)]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{argv[0]} [-h]" in done.stdout  # its help was printed
    return done.stdout.splitlines()[-1].split()[1:]  # after the help text


CHECKED = ["train", "bench-train", "pretrain", "evaluate", "compare", "bench", "serve"]


@pytest.mark.parametrize("subcommand", CHECKED)
def test_subcommand_help_loads_no_torch(subcommand):
    assert _loaded_by([subcommand, "--help"]) == []


def test_train_help_with_a_config_file_loads_no_torch(tmp_path):
    (tmp_path / "run.yaml").write_text("lr: 0.001\nloss_type: nft\n")
    assert _loaded_by(["train", "--config", str(tmp_path / "run.yaml"), "--help"]) == []


def test_every_subcommand_is_checked():
    assert sorted(_subcommands()) == sorted(CHECKED)


def test_serve_config_is_the_servers():
    """The server's module re-exports the flags' dataclass (code and tests import it from there)."""
    from diffrl.serving import config, server

    assert server.ServeConfig is config.ServeConfig
    assert server.ServeConfig().engine_config().max_prompt_chars == config.ServeConfig().max_prompt_chars
