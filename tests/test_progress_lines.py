"""Progress bars written to a file or a pipe come out line by line, not as one line of carriage returns."""

import io

from diffrl.utils.progress import tqdm


def test_a_bar_written_to_a_file_is_whole_lines():
    out = io.StringIO()
    for _ in tqdm(range(3), desc="sampling", file=out, mininterval=0, miniters=1):
        pass
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) >= 2 and all(line.startswith("sampling") for line in lines) and "3/3" in lines[-1]


def test_commands_show_no_third_party_loading_bars(tiny_model_dir, tmp_path, capfd):
    from diffrl.cli.main import main

    assert main(["evaluate", "--model-path", str(tiny_model_dir), "--num-steps", "1", "--num-seeds", "1",
                 "--max-prompts-per-category", "1", "--device", "cpu", "--output-dir", str(tmp_path / "e")]) == 0
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "Writing model shards" not in err
