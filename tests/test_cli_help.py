"""The CLI explains itself: subcommands listed with one line each, every option of every subcommand described, the
recipes and rewards listed, and `diffrl --help` answered without loading the models' libraries."""

import dataclasses
import subprocess
import sys
import typing

import pytest

from tyro import _docstrings

from diffrl.cli.main import SUBCOMMAND_SUMMARIES, _subcommands, main
from diffrl.recipes import recipe_names


def _undescribed(kind) -> list[str]:
    """The flags of `kind`'s fields (nested sections' too: `train`'s tree, bench-train's `train`) that tyro would
    print without a description: neither a docstring under the field nor a comment above it."""
    hints = typing.get_type_hints(kind)
    flags = []
    for f in dataclasses.fields(kind):
        if dataclasses.is_dataclass(hints[f.name]):
            flags += _undescribed(hints[f.name])
        elif not _docstrings.get_field_docstring(kind, f.name, ()):
            flags.append(f"--{f.name.replace('_', '-')}")
    return flags


def test_every_option_of_every_subcommand_has_a_description():
    undescribed = {name: flags for name, kind in _subcommands().items() if (flags := _undescribed(kind))}
    assert undescribed == {}


def test_the_description_check_sees_nested_sections_and_missing_docstrings():
    @dataclasses.dataclass
    class Inner:
        described: int = 0
        """Described."""
        bare: int = 0

    @dataclasses.dataclass
    class Outer:
        inner: Inner = dataclasses.field(default_factory=Inner)
        also_bare: bool = False

    assert _undescribed(Outer) == ["--bare", "--also-bare"]


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


@pytest.mark.parametrize("argv", [["train", "--recipe", "sd3-grpo", "--help"],
                                  ["train", "--recipe", "shapes-nft", "--device", "cpu", "--help"],
                                  ["bench-train", "--recipe", "shapes-grpo", "--help"]])
def test_help_with_a_recipe_loads_no_torch(argv):
    """The recipe's size (GPU or CPU) for --device auto comes from a look at the driver's files, not from
    torch.cuda.is_available(): importing torch made `diffrl train --recipe NAME --help` take ~2 s instead of ~0.5."""
    assert _loaded_by(argv) == []


def test_help_shows_the_recipe_size_a_run_on_that_device_would_use(monkeypatch):
    from diffrl.cli import main as cli
    from diffrl.recipes import SIZED, recipe_config

    for name in SIZED:
        for device in ("cpu", "cuda", "cuda:1"):
            assert cli._recipe_for_help(name, device, "diffrl train")[0] == recipe_config(name, device), (name, device)
        for seen, device in ((True, "cuda"), (False, "cpu")):
            monkeypatch.setattr(cli, "cuda_device_seen", lambda seen=seen: (seen, "as the test says"))
            shown, note = cli._recipe_for_help(name, "auto", "diffrl train")
            assert shown == recipe_config(name, device), (name, device)
            if SIZED[name]["gpu"] != SIZED[name]["cpu"]:  # the note names the size shown and how to see the other
                size, other, flag = ("GPU", "CPU", "--device cpu") if seen else ("CPU", "GPU", "--device cuda")
                assert f"defaults below are its {size} size" in note and "as the test says" in note
                assert f"diffrl train --recipe {name} {flag} --help` shows its {other} size" in note
            else:  # one size: nothing to explain
                assert note == ""


def test_sd3_grpo_help_names_the_size_it_shows(capsys, monkeypatch):
    from diffrl.cli import main as cli

    monkeypatch.setattr(cli, "cuda_device_seen", lambda: (True, "/dev/nvidia0 exists"))
    with pytest.raises(SystemExit):
        main(["train", "--recipe", "sd3-grpo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "The defaults below are its GPU size: --device auto, and a CUDA device seems present: /dev/nvidia0" in out
    assert "--recipe sd3-grpo --device cpu --help` shows its CPU size" in out
    assert "differ in --compile, --detach-uncond, --gradient-checkpointing, --micro-batch-size." in out


@pytest.mark.parametrize("visible", ["", "-1", " -1,0", "none"])
def test_cuda_visible_devices_hiding_every_device_means_none(monkeypatch, visible):
    from diffrl.cli.main import cuda_device_seen

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert cuda_device_seen() == (False, f"CUDA_VISIBLE_DEVICES={visible!r} hides every device")


def test_every_subcommand_is_checked():
    assert sorted(_subcommands()) == sorted(CHECKED)


def test_serve_config_is_the_servers():
    """The server's module re-exports the flags' dataclass (code and tests import it from there)."""
    from diffrl.serving import config, server

    assert server.ServeConfig is config.ServeConfig
    assert server.ServeConfig().engine_config().max_prompt_chars == config.ServeConfig().max_prompt_chars
