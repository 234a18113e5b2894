"""The held-out CFG of a two-expert model (Wan2.2): `--eval-guidance-scale-2` beside `--eval-guidance-scale`, read the
same way by the trainer's evaluation and by `diffrl evaluate RUN` (which repeats the run's protocol)."""

from pathlib import Path

import pytest

from diffrl.cli.runs import held_out_protocol
from diffrl.tasks.base import EvalSettings
from diffrl.train.config import TrainConfig
from diffrl.utils.run_folders import Run

ROLLOUT = dict(diffusion_guidance_scale=4.0, diffusion_guidance_scale_2=3.0)


@pytest.mark.parametrize(("flags", "want"), [
    ({}, (4.0, 3.0)),                                                     # the rollouts' pair
    ({"eval_guidance_scale": 5.0}, (5.0, None)),                          # one scale for both experts
    ({"eval_guidance_scale": 5.0, "eval_guidance_scale_2": 1.0}, (5.0, 1.0)),
    ({"eval_guidance_scale_2": 1.0}, (4.0, 1.0)),                         # the second expert's alone
])
def test_trainer_and_evaluate_take_the_same_held_out_pair(flags, want):
    cfg = TrainConfig.flat(**ROLLOUT, **flags)
    cfg.check()
    settings = EvalSettings.from_config(cfg)
    assert (settings.guidance_scale, settings.guidance_scale_2) == want
    protocol = held_out_protocol(Run(folder=Path("run"), checkpoint=None, flags=cfg.as_flat_dict()))
    assert (protocol["guidance_scale"], protocol["guidance_scale_2"]) == want


def test_a_negative_second_scale_is_refused_by_name():
    with pytest.raises(ValueError, match="--eval-guidance-scale-2 must be >= 0, got -1"):
        TrainConfig.flat(eval_guidance_scale_2=-1.0).check()
