"""diffrl evaluate and diffrl compare refuse numbers no model could take, naming the flag, before any model loads
(a step count of 0 or a negative CFG scale reached the engine's request schema as a four-line pydantic error after
the model loaded; --num-seeds 0 failed with a torch traceback); and what the loaded family cannot do (its size, a
second expert's CFG) by the flag, not by the request field ('height: height=30: …', 'guidance_scale_2: … use
guidance_scale')."""

import pytest

from diffrl.cli.main import main


@pytest.mark.parametrize("argv, message", [
    (["evaluate", "--num-steps", "0"], "--num-steps must be >= 1, got 0"),
    (["evaluate", "--num-seeds", "0"], "--num-seeds must be >= 1, got 0"),
    (["compare", "--trained", "M", "--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),  # a traceback
    (["compare", "--trained", "M", "--num-prompts", "-3"], "--num-prompts must be >= 1, got -3"),  # 39 of 42 prompts
    (["evaluate", "--prompt-data", "P", "--reward", "R", "--guidance-scale", "-1"], "--guidance-scale must be >= 0, got -1.0"),
    (["compare", "--trained", "M", "--base", "M", "--prompt-data", "P", "--reward", "R", "--tie-margin", "-0.1"],
     "--tie-margin must be >= 0, got -0.1"),
    (["evaluate", "--prompt-data", "P", "--reward", "R", "--height", "64"],
     "--height and --width go together (got --height 64, --width None); --resolution N is the square N × N"),
    (["evaluate", "--prompt-data", "P", "--reward", "R", "--resolution", "30"],
     "--resolution 30: height=30: the demo model generates 64x64 images only"),
    (["evaluate", "--prompt-data", "P", "--reward", "R", "--guidance-scale", "3", "--guidance-scale-2", "2"],
     "--guidance-scale-2 2.0: the demo family has no second expert (this checkpoint); use --guidance-scale"),
])
def test_values_no_model_takes_are_refused_naming_the_flag(tiny_model_dir, tmp_path, capsys, argv, message):
    (tmp_path / "prompts.txt").write_text("a red circle\n")
    subs = {"P": str(tmp_path / "prompts.txt"), "R": "rewards_for_tests:darkness", "M": str(tiny_model_dir)}
    model = [] if argv[0] == "compare" else ["--model-path", str(tiny_model_dir)]
    out = tmp_path / "out"
    assert main([subs.get(a, a) for a in argv] + model + ["--device", "cpu", "--output-dir", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {message}"
    assert not (out / "images").exists()
