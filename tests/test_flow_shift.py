"""`--flow-shift`: a static schedule shift in place of the checkpoint's, in training, serving and evaluation alike."""

import json

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from family_checks import engine_images, run_training

from diffrl.cli.main import main as cli_main
from diffrl.engine.spec import EngineSpec, load_family
from diffrl.errors import ModelLoadError
from diffrl.models.checkpoint import load_model
from diffrl.models.components import flow_shifted_scheduler
from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint
from diffrl.models.sd3 import SD3Family
from diffrl.sampling import make_generators
from diffrl.sampling.schedule import shift_sigmas
from diffrl.serving.config import ServeConfig
from diffrl.serving.server import engine_spec as serve_spec


def shifted(unshifted: torch.Tensor, shift: float) -> torch.Tensor:
    """The static shift of a schedule computed at shift 1 (the terminal 0 stays 0)."""
    return shift * unshifted / (1 + (shift - 1) * unshifted)


def euler_sigmas(scheduler, steps=6, **kw) -> torch.Tensor:
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), **kw)
    return scheduler.sigmas.float()


def test_a_static_euler_scheduler_takes_the_new_shift():
    base = FlowMatchEulerDiscreteScheduler(shift=3.0)
    one = euler_sigmas(flow_shifted_scheduler("x", base, 1.0))
    assert torch.allclose(one[:-1], torch.linspace(1.0, 1 / 6, 6, dtype=torch.float64).float(), atol=1e-6)
    assert torch.allclose(euler_sigmas(flow_shifted_scheduler("x", base, 5.0)), shifted(one, 5.0), atol=1e-6)
    assert base.config.shift == 3.0  # the original is left as it was


def test_a_resolution_dependent_schedule_becomes_static():
    dynamic = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    static = flow_shifted_scheduler("x", dynamic, 2.0)
    assert not static.config.use_dynamic_shifting
    one = euler_sigmas(flow_shifted_scheduler("x", dynamic, 1.0), mu=1.1)
    for mu in (0.5, 1.15):  # the pipeline's μ no longer moves the schedule
        assert torch.allclose(euler_sigmas(static, mu=mu), shifted(one, 2.0), atol=1e-6)


def test_a_unipc_flow_scheduler_takes_it_as_its_flow_shift():
    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    reshifted = flow_shifted_scheduler("wan2_2", unipc, 3.0)
    assert reshifted.config.flow_shift == 3.0 and type(reshifted) is UniPCMultistepScheduler
    reshifted.set_timesteps(8)
    unipc.set_timesteps(8)
    assert not torch.allclose(reshifted.sigmas.float(), unipc.sigmas.float())


def test_schedulers_without_a_flow_shift_and_bad_shifts_are_refused():
    with pytest.raises(ModelLoadError, match="takes no flow shift"):
        flow_shifted_scheduler("x", UniPCMultistepScheduler(), 3.0)  # not a flow-sigma UniPC
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ModelLoadError, match="must be > 0"):
            flow_shifted_scheduler("x", FlowMatchEulerDiscreteScheduler(), bad)


def test_the_demo_family_samples_with_the_new_shift(tiny_family):
    one = tiny_family.sigmas(5, 16, 16)
    tiny_family.set_flow_shift(1.0)
    unshifted = tiny_family.sigmas(5, 16, 16)
    assert not torch.equal(one, unshifted)
    tiny_family.set_flow_shift(4.0)
    expected = torch.cat([shift_sigmas(unshifted[:-1], 4.0), unshifted.new_zeros(1)])
    assert torch.allclose(tiny_family.sigmas(5, 16, 16), expected)


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "sd3-tiny")


def test_sd3_with_a_new_shift_still_reproduces_diffusers_pipeline_with_that_shift(sd3_dir):
    family = SD3Family.load(sd3_dir)
    own = family.sigmas(4, 64, 64)
    family.set_flow_shift(1.5)
    assert not torch.allclose(family.sigmas(4, 64, 64), own)
    # The pipeline runs a copy of the family's scheduler: the reshifted one, whose σ's are the engine's.
    ours = engine_images(family, "a cat", "", 1.0, seed=3, steps=4, height=64, width=64)
    noise = family.prepare_latents(make_generators([3, 4]), 64, 64).tokens
    pipe = family.reference_pipeline()
    assert pipe.scheduler.config.shift == 1.5
    theirs = pipe(prompt="a cat", guidance_scale=1.0, latents=noise, num_inference_steps=4, height=64, width=64,
                  num_images_per_prompt=2, output_type="pt").images
    assert (ours - theirs).abs().max() < 1e-5


def test_an_engine_spec_and_a_server_carry_the_shift(tiny_model_dir):
    plain = load_family(EngineSpec(model_path=str(tiny_model_dir)))
    spec = serve_spec(ServeConfig(model_path=tiny_model_dir, flow_shift=1.25, device="cpu"))
    assert spec.flow_shift == 1.25 and EngineSpec.from_json(spec.to_json()).flow_shift == 1.25  # to engine processes
    served = load_family(spec)
    plain.set_flow_shift(1.25)
    assert torch.equal(served.sigmas(6, 16, 16), plain.sigmas(6, 16, 16))


def test_a_run_trains_with_the_shift_and_its_checkpoint_samples_with_it(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    records = run_training(tiny_model_dir, run, "flow_grpo", lora=True, guidance=1.0,
                           extra_flags=("--flow-shift", "1.5"))
    assert records and json.loads((run / "config.json").read_text())["flags"]["flow_shift"] == 1.5
    checkpoint = run / "checkpoints" / "rollout-00001"
    expected = load_model(tiny_model_dir, flow_shift=1.5).sigmas(6, 16, 16)
    assert torch.equal(load_model(tiny_model_dir, checkpoint).sigmas(6, 16, 16), expected)  # the run's shift
    own = load_model(tiny_model_dir, checkpoint, flow_shift=None).sigmas(6, 16, 16)
    assert not torch.equal(own, expected)
    assert torch.equal(load_model(tiny_model_dir).sigmas(6, 16, 16), own)  # the base alone keeps its own


def test_a_shift_that_is_not_positive_is_refused_by_name(tiny_model_dir, tmp_path, capsys):
    assert cli_main(["train", "--model-path", str(tiny_model_dir), "--flow-shift", "0", "--output-dir",
                     str(tmp_path / "r"), "--device", "cpu"]) == 2
    assert "--flow-shift must be > 0, got 0.0" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
