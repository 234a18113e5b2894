"""The qwen_image21 family (Qwen-Image 2.1) against diffusers' QwenImage21Pipeline, on a tiny random checkpoint built
in code, and each row at its own text length."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from family_checks import assert_sample_k_is_the_same_in_any_microgroup, run_training

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.base import Latents, PromptEmbeds
from diffrl.models.qwen_image import QwenImageFamily
from diffrl.models.qwen_image21 import QwenImage21Family, composite_over_white
from diffrl.models.random_checkpoints.qwen_image21 import save_random_checkpoint
from diffrl.models.registry import resolve_family
from diffrl.sampling import make_generators

TOLERANCE = 1e-5  # fp32 on CPU through two code paths (measured: ≤ 8.1e-7)
HEIGHT, WIDTH = 64, 96  # latents 4 × 6 at 16x: six image slots of 2 × 2 tokens


@pytest.fixture(scope="module")
def q21_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "qwen-image-2.1-tiny")


@pytest.fixture(scope="module")
def q21(q21_dir) -> QwenImage21Family:
    return QwenImage21Family.load(q21_dir)


@pytest.mark.parametrize(("negative", "guidance"), [("", 1.0), ("blurry", 3.0)], ids=["no-cfg", "true-cfg"])
def test_engine_reproduces_the_diffusers_pipeline(q21, negative, guidance):
    """ODE sampling through our engine gives QwenImage21Pipeline's images (RGBA, composited over white as ours) from
    the same noise, without CFG (2.1's default) and with true CFG."""
    engine = Engine(q21, EngineConfig(max_outputs_per_request=4))
    outputs = engine.generate(RolloutRequest(prompt="a red cat", negative_prompt=negative, seed=3,
                                             num_outputs_per_prompt=2, num_inference_steps=3, guidance_scale=guidance,
                                             height=HEIGHT, width=WIDTH))
    ours = torch.stack([o.generated_output for o in outputs])
    noise = q21.prepare_latents(make_generators([3, 4]), HEIGHT, WIDTH).tokens

    def pipeline(prompt):
        return composite_over_white(q21.reference_pipeline()(
            prompt=prompt, negative_prompt=negative if guidance > 1 else None, true_cfg_scale=guidance, latents=noise,
            num_inference_steps=3, height=HEIGHT, width=WIDTH, num_images_per_prompt=2, output_type="pt").images)

    reference = pipeline("a red cat")
    assert ours.shape == reference.shape == (2, 3, HEIGHT, WIDTH)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    assert (pipeline("a green dog") - reference).abs().max() > 100 * TOLERANCE  # the comparison can fail


def test_each_row_runs_at_its_own_text_length(q21):
    """Prompts of different lengths in one batch: every row's velocity is the one it has alone (the transformer's
    positions and causal text would otherwise make it depend on the longest prompt beside it)."""
    prompts = ["a red cat", "a big blue dog on a green square"]
    cond = q21.encode_prompts(prompts)
    lengths = cond.embeds[:, 0, 0].tolist()
    assert lengths[0] < lengths[1]
    latents = q21.prepare_latents(make_generators([1, 2]), HEIGHT, WIDTH)
    sigma = torch.tensor([0.7, 0.4])
    together = q21.run_transformer(q21.transformer, latents, sigma, cond)
    for k, prompt in enumerate(prompts):
        alone = q21.run_transformer(q21.transformer, Latents(latents.tokens[k : k + 1], latents.ids), sigma[k : k + 1],
                                    q21.encode_prompts([prompt]))
        assert torch.equal(together[k : k + 1], alone)


def test_sample_k_is_the_same_in_any_microgroup(q21):
    assert_sample_k_is_the_same_in_any_microgroup(q21, guidance_scale=3.0, height=HEIGHT, width=WIDTH)


def test_the_conditioning_round_trips_the_wire(q21):
    cond = q21.encode_prompts(["a red cat"])
    image_ids = q21.prepare_latents(make_generators([0]), HEIGHT, WIDTH).ids
    wire = q21.cond_kwargs_to_wire(cond, image_ids)
    assert wire["img_shapes"] == [[[1, 4, 6]]] and wire["txt_seq_lens"] == [int(cond.embeds[0, 0, 0])]
    back, ids = QwenImage21Family.cond_kwargs_from_wire(wire)
    assert torch.equal(back.embeds, cond.embeds) and torch.equal(ids, image_ids)


def test_the_family_is_found_by_name_and_class_beside_qwen_image(q21_dir, tmp_path):
    """"qwen-image-2.1" holds Qwen-Image's name too: the transformer class decides between them."""
    assert resolve_family(None, q21_dir) is QwenImage21Family
    from diffrl.models.random_checkpoints.qwen_image import save_random_checkpoint as save_qwen

    assert resolve_family(None, save_qwen(tmp_path / "qwen-image-tiny")) is QwenImageFamily


def test_bad_requests_and_checkpoints_are_refused(q21, q21_dir, tmp_path):
    engine = Engine(q21, EngineConfig(max_outputs_per_request=4))
    with pytest.raises(RequestError, match="height=48: Qwen-Image 2.1 needs a positive multiple of 32"):
        engine.generate(RolloutRequest(prompt="a cat", height=48, width=64, num_inference_steps=2))
    with pytest.raises(RequestError, match="takes no condition images|image"):
        engine.generate(RolloutRequest(prompt="a cat", height=64, width=64, num_inference_steps=2,
                                       image_path=["/nowhere.png"]))
    fixed = tmp_path / "qwen-image-2.1-fixed"
    shutil.copytree(q21_dir, fixed)
    index = fixed / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "sample_sigmas": [1.0, 0.5]}))
    two_steps = QwenImage21Family.load(fixed)
    assert two_steps.sigmas(2, HEIGHT, WIDTH).shape == (3,)
    with pytest.raises(RequestError, match="samples its configured 2 steps"):
        two_steps.sigmas(4, HEIGHT, WIDTH)
    index.write_text(json.dumps({**json.loads(index.read_text()), "_class_name": "QwenImagePipeline"}))
    with pytest.raises(ModelLoadError, match="runs QwenImage21Pipeline checkpoints"):
        QwenImage21Family.load(fixed)


def test_fixed_sample_sigmas_are_the_pipelines(q21, q21_dir, tmp_path):
    fixed = tmp_path / "qwen-image-2.1-sigmas"
    shutil.copytree(q21_dir, fixed)
    index = fixed / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "sample_sigmas": [1.0, 0.8, 0.3]}))
    family = QwenImage21Family.load(fixed)
    pipe = family.reference_pipeline()
    outputs = Engine(family).generate(RolloutRequest(prompt="a cat", seed=1, num_inference_steps=3, height=HEIGHT,
                                                     width=WIDTH))
    noise = family.prepare_latents(make_generators([1]), HEIGHT, WIDTH).tokens
    reference = composite_over_white(pipe(prompt="a cat", latents=noise, height=HEIGHT, width=WIDTH,
                                          output_type="pt").images)
    torch.testing.assert_close(outputs[0].generated_output[None], reference, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize(("loss_type", "lora"), [("flow_grpo", True), pytest.param("nft", False, marks=pytest.mark.slow)],
                         ids=["grpo-lora", "nft-full"])
def test_training_run_on_qwen_image21(q21_dir, tmp_path, loss_type, lora):
    run_training(q21_dir, tmp_path / "run", loss_type, lora, guidance=3.0,
                 extra_flags=("--resolution", "64"))


def test_velocity_with_true_cfg_pairs_lengths_in_one_batch(q21):
    """CFG's halves of different lengths share the velocity call and still run each at its own length."""
    latents = q21.prepare_latents(make_generators([5]), HEIGHT, WIDTH)
    cond, uncond = q21.encode_prompts(["a big blue dog on a green square"]), q21.encode_prompts([""])
    sigma = torch.tensor([0.6])
    guided = q21.velocity(q21.transformer, latents, sigma, cond, uncond, 3.0)
    v_c = q21.run_transformer(q21.transformer, latents, sigma, cond)
    v_u = q21.run_transformer(q21.transformer, latents, sigma, uncond)
    torch.testing.assert_close(guided, v_u + 3.0 * (v_c - v_u), rtol=1e-6, atol=1e-6)
    assert isinstance(cond, PromptEmbeds)


def test_the_first_pass_replays_prompts_of_different_lengths_exactly(q21_dir, tmp_path):
    """Flow-GRPO with true CFG on two prompts of different lengths: the trainer pads them to one tensor and each row
    still runs at its own length, so the replay's log-probs are the rollout's, bit for bit (eager, CPU)."""
    from diffrl.cli.main import parse
    from diffrl.train.trainer import Trainer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\na big blue dog on a green square\n")
    cfg = parse(["train", "--model-path", str(q21_dir), "--loss-type", "flow_grpo", "--num-rollout", "1",
                 "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-microgroup-size", "2",
                 "--global-batch-size", "4", "--num-steps-per-rollout", "1", "--micro-batch-size", "4", "--use-lora",
                 "--lora-rank", "2", "--lr", "1e-3", "--device", "cpu", "--reward", "jpeg_compressibility",
                 "--prompt-data", str(prompts), "--resolution", "64", "--diffusion-num-steps", "2",
                 "--diffusion-guidance-scale", "3.0", "--diffusion-sde-window-range", "0", "2",
                 "--eval-images-per-category", "0", "--output-dir", str(tmp_path / "run")])
    record = Trainer(cfg).rollout_and_update(0)
    assert record["train/log_prob_mean_abs_diff"] == 0.0 and record["train/first_pass_clipfrac"] == 0.0
