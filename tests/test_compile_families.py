"""Compiled Flow-GRPO at bf16 on the text-to-image and text-to-video families whose GPU recipes do not compile by
default yet (FLUX.2, Krea-2, Wan2.2, Cosmos3), as `test_compile_conditioned.py` runs the image-conditioned ones: the
engine samples in the trainer's compiled graph, the replay compiles no graph of its own, every kind of block ran
compiled, and the first pass replays the rollout's log-probs exactly. The mechanism a compiled-by-default recipe
rests on; the GPU figures are measured on the GPU."""

from pathlib import Path

import pytest

from test_compile import needs_compiler
from test_compile_conditioned import assert_compiled_replay_exact


def _flux2_klein(path: Path) -> Path:
    from test_flux2_flux3_edit import save_flux2, tiny_flux2

    return save_flux2(path, tiny_flux2("klein"))


def _random(family: str):
    def build(path: Path) -> Path:
        import importlib

        return importlib.import_module(f"diffrl.models.random_checkpoints.{family}").save_random_checkpoint(path)

    return build


def _steps(guidance: float) -> list[str]:
    return ["--diffusion-num-steps", "2", "--diffusion-guidance-scale", str(guidance),
            "--diffusion-sde-window-range", "0", "2", "--eval-images-per-category", "0"]


CASES = {  # checkpoint builder, the run's size and step flags (the families' own training tests' settings)
    "flux2-klein": (_flux2_klein, ["--height", "32", "--width", "48", *_steps(2.0)]),
    "krea2": (_random("krea2"), ["--resolution", "32", *_steps(2.0)]),
    "wan2.2": (_random("wan2_2"), ["--resolution", "16", "--num-frames", "5", "--diffusion-guidance-scale-2", "2.0",
                                   *_steps(4.5)]),
    "cosmos3": (_random("cosmos3"), ["--resolution", "16", "--num-frames", "5", *_steps(4.0)]),
}


@pytest.mark.slow  # about a minute of inductor per family on 2 cores
@needs_compiler
@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_replay_is_exact(case, tmp_path):
    build, flags = CASES[case]
    assert_compiled_replay_exact(build(tmp_path / f"{case}-tiny"), flags, tmp_path)
