"""--input-key picks the prompt of a .jsonl file; given for .txt prompt files only (one prompt per line, no keys) it
would be ignored, so it is refused in one line naming the flag."""

import json

import pytest

from diffrl.cli.main import main, parse
from diffrl.tasks import build_task


@pytest.fixture
def files(tmp_path):
    (tmp_path / "prompts.txt").write_text("a red cat\na blue dog\n")
    (tmp_path / "held_out.jsonl").write_text(json.dumps({"caption": "a green bird"}) + "\n")
    d = tmp_path / "flow_grpo"
    d.mkdir()
    (d / "train.txt").write_text("a red cat\n")
    (d / "test.txt").write_text("a green bird\n")
    return tmp_path


def _task(*flags):
    return build_task(parse(["train", "--recipe", "shapes-nft", "--device", "cpu", "--reward", "jpeg_compressibility",
                             *map(str, flags)]))


def test_input_key_for_txt_files_only_is_refused(files):
    for data in (files / "prompts.txt", files / "flow_grpo"):
        with pytest.raises(ValueError, match=rf"^--input-key caption: --prompt-data {data} reads .*\.txt"):
            _task("--prompt-data", data, "--input-key", "caption")
    # A .jsonl file read beside the .txt one gives the flag its meaning.
    task = _task("--prompt-data", files / "prompts.txt", "--eval-prompt-data", files / "held_out.jsonl",
                 "--input-key", "caption")
    assert [r.prompt for r in task.eval_records] == ["a green bird"]
    assert len(_task("--prompt-data", files / "prompts.txt").train.records) == 2  # the default key: nothing said


@pytest.mark.parametrize("command", [["evaluate"], ["compare", "--trained", "diffrl/assets/demo-shapes"]])
def test_evaluate_and_compare_refuse_input_key_for_a_txt_file(files, capsys, command):
    argv = [*command, "--prompt-data", str(files / "flow_grpo"), "--reward", "jpeg_compressibility",
            "--input-key", "caption", "--output-dir", str(files / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --input-key caption: --prompt-data") and "test.txt" in err
    assert len(err.splitlines()) == 1 and not (files / "out").exists()
