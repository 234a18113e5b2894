"""Evaluation samples through the engine: its images are the engine's ODE outputs for the same seeds."""

import torch

from diffrl.engine.engine import Engine
from diffrl.engine.protocol import RolloutRequest
from diffrl.evaluation.sampling import generate, request_runs


def test_a_run_of_one_prompt_at_consecutive_seeds_is_one_request():
    prompts = ["a", "a", "a", "b", "b", "a"]
    seeds = [5, 6, 8, 9, 10, 11]
    assert request_runs(prompts, seeds, 0, 6) == [(0, 2), (2, 3), (3, 5), (5, 6)]
    assert request_runs(prompts, seeds, 1, 4) == [(1, 2), (2, 3), (3, 4)]


def test_evaluation_images_are_the_engines_ode_outputs(tiny_family):
    prompts, seeds = ["a red circle", "a red circle", "two blue squares"], [7, 8, 3]
    images = generate(tiny_family, prompts, seeds, num_steps=2, guidance_scale=3.0, batch_size=2,
                      negative_prompt="blurry")
    engine = Engine(tiny_family)
    request = {"num_inference_steps": 2, "guidance_scale": 3.0, "negative_prompt": "blurry", "generator_device": "cpu"}
    expected = [o.generated_output for o in engine.generate(RolloutRequest(prompt=prompts[0], seed=7,
                                                                           num_outputs_per_prompt=2, **request))]
    expected += [engine.generate(RolloutRequest(prompt=prompts[2], seed=3, **request))[0].generated_output]
    assert torch.equal(images, torch.stack(expected))
