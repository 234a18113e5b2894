"""An --output-dir that is a file (or lies under one) is refused in one line naming the flag, by every command that
writes a folder, before any work: pretrain failed with a NotADirectoryError traceback, evaluate and compare after
sampling every image."""

import pytest

from diffrl.cli.main import main


@pytest.mark.parametrize("command", [
    ["pretrain", "--steps", "1"],
    ["evaluate", "--num-seeds", "1"],
    ["evaluate", "--prompt-data", "PROMPTS", "--reward", "jpeg_compressibility"],
    ["compare", "--trained", "diffrl/assets/demo-shapes"],
    ["train", "--recipe", "shapes-nft", "--device", "cpu", "--num-rollout", "1"],
])
@pytest.mark.parametrize("under_a_file", [False, True])
def test_an_output_dir_that_is_a_file_is_refused_in_one_line(tmp_path, capsys, command, under_a_file):
    taken = tmp_path / "notes"
    taken.write_text("notes\n")
    (tmp_path / "prompts.txt").write_text("a red cat\n")
    out = taken / "run" if under_a_file else taken
    argv = [str(tmp_path / "prompts.txt") if a == "PROMPTS" else a for a in command]
    assert main([*argv, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --output-dir {out}") and "is a file" in err and len(err.splitlines()) == 1
    if under_a_file:
        assert f": {taken} is a file" in err
    assert taken.read_text() == "notes\n"
