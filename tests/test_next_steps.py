"""A finished `diffrl train` (and so `make demo`) ends with the commands that take its run folder next."""

from __future__ import annotations

import shlex
from pathlib import Path

from test_trainer import tiny_config

from diffrl.cli.main import parse
from diffrl.train.next_steps import next_commands
from diffrl.train.trainer import Trainer


def test_a_finished_run_prints_what_to_run_next(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    Trainer(tiny_config(tiny_model_dir, out, num_rollout=1, eval_images_per_category=0)).train()
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[-4] == "next:"
    commands = [line.split("#")[0].split() for line in lines[-3:]]
    assert [c[:3] for c in commands] == [["diffrl", "evaluate", "--checkpoint"], ["diffrl", "compare", "--trained"],
                                         ["diffrl", "serve", "--checkpoint"]]
    assert all(c[3] == str(out) for c in commands)
    for command in commands:  # each one is a command line the CLI takes as it is
        assert parse(command[1:]) is not None


def test_a_prompt_data_run_names_its_prompts_and_reward():
    text = next_commands(Path("runs/my run"), prompt_data=Path("data/prompts.txt"), reward="ocr")
    evaluate, compare, serve = [shlex.split(line.split("  #")[0]) for line in text.splitlines()[1:]]
    assert evaluate == ["diffrl", "evaluate", "--checkpoint", "runs/my run", "--prompt-data", "data/prompts.txt",
                        "--reward", "ocr"]
    assert compare[:4] == ["diffrl", "compare", "--trained", "runs/my run"] and "--reward" in compare
    assert serve == ["diffrl", "serve", "--checkpoint", "runs/my run"]
