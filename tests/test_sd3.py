"""The sd3 family against diffusers' StableDiffusion3Pipeline, on a tiny random checkpoint built in code."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from family_checks import assert_sample_k_is_the_same_in_any_microgroup, run_training

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint
from diffrl.models.registry import resolve_family
from diffrl.models.sd3 import SD3Family
from diffrl.sampling import make_generators

TOLERANCE = 1e-5  # fp32 on CPU through two code paths (measured: ≤ 1.3e-6)


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "sd3-tiny")


@pytest.fixture(scope="module")
def sd3(sd3_dir) -> SD3Family:
    return SD3Family.load(sd3_dir)


def _diffusers_images(family, prompt, negative, guidance, noise, steps, height, width):
    return family.reference_pipeline()(prompt=prompt, negative_prompt=negative if guidance > 1 else None, latents=noise,
                num_inference_steps=steps, guidance_scale=guidance, height=height, width=width,
                num_images_per_prompt=len(noise), output_type="pt").images


@pytest.mark.parametrize(("negative", "guidance", "with_t5"), [("blurry", 4.5, True), ("", 1.0, True), ("", 4.5, False)],
                         ids=["cfg", "no-cfg", "no-t5"])
def test_engine_reproduces_the_diffusers_pipeline(sd3, sd3_dir, tmp_path, negative, guidance, with_t5):
    """ODE sampling through our engine gives StableDiffusion3Pipeline's images from the same noise."""
    family = sd3
    if not with_t5:  # T5 left out: diffusers conditions on zeros in its place, and so do we
        family = SD3Family.load(save_random_checkpoint(tmp_path / "sd3-no-t5", with_t5=False))
    height, width, steps, seed = 32, 48, 4, 3
    engine = Engine(family, EngineConfig(max_outputs_per_request=4))
    outputs = engine.generate(RolloutRequest(prompt="a red cat", negative_prompt=negative, seed=seed,
                                             num_outputs_per_prompt=2, num_inference_steps=steps,
                                             guidance_scale=guidance, height=height, width=width))
    ours = torch.stack([o.generated_output for o in outputs])
    noise = family.prepare_latents(make_generators([seed, seed + 1]), height, width).tokens
    reference = _diffusers_images(family, "a red cat", negative, guidance, noise, steps, height, width)
    assert ours.shape == reference.shape == (2, 3, height, width)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    other = _diffusers_images(family, "a green dog", negative, guidance, noise, steps, height, width)
    assert (other - reference).abs().max() > 100 * TOLERANCE  # the comparison can fail


@pytest.mark.parametrize(("model", "dual_layers"), [("large", ()), ("medium", (0,))])
def test_sd35_large_and_medium_are_sizes_of_sd3(tmp_path, model, dual_layers):
    """SD3.5's structures at tiny size, QK RMSNorm with no dual-attention layers (Large, `real("large")`) or with
    dual attention in the first blocks (Medium's first 13): the registry picks sd3 by the transformer class, and the
    engine equals StableDiffusion3Pipeline with CFG. Nothing else of the pipeline differs between the sizes."""
    from diffrl.models.random_checkpoints.sd3 import real, tiny

    published = real(model).transformer
    assert published["qk_norm"] == "rms_norm" and bool(published["dual_attention_layers"]) == bool(dual_layers)
    sizes = tiny()
    sizes.transformer.update(qk_norm="rms_norm", dual_attention_layers=dual_layers)
    folder = save_random_checkpoint(tmp_path / "my-model", sizes)  # no family's name: the transformer class decides
    assert resolve_family(None, folder) is SD3Family
    family = SD3Family.load(folder)
    blocks = family.transformer.transformer_blocks
    assert blocks[0].attn.norm_q is not None and [b.attn2 is not None for b in blocks] == [
        i in dual_layers for i in range(len(blocks))]
    height, width, steps, seed = 32, 32, 3, 5
    outputs = Engine(family, EngineConfig(max_outputs_per_request=4)).generate(RolloutRequest(
        prompt="a red cat", negative_prompt="blurry", seed=seed, num_outputs_per_prompt=2, num_inference_steps=steps,
        guidance_scale=3.5, height=height, width=width))
    noise = family.prepare_latents(make_generators([seed, seed + 1]), height, width).tokens
    reference = _diffusers_images(family, "a red cat", "blurry", 3.5, noise, steps, height, width)
    torch.testing.assert_close(torch.stack([o.generated_output for o in outputs]), reference, rtol=0, atol=TOLERANCE)


def test_schedule_is_the_schedulers_own(sd3):
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    torch.testing.assert_close(sd3.sigmas(10, 32, 32), scheduler.sigmas.float())
    assert sd3.sigmas(10, 32, 32)[-1] == 0 and len(sd3.sigmas(10, 32, 32)) == 11


def test_sample_k_is_the_same_in_any_microgroup(sd3):
    assert_sample_k_is_the_same_in_any_microgroup(sd3, guidance_scale=4.5, height=32, width=32)


def test_family_is_found_by_directory_name(sd3_dir):
    assert resolve_family(None, sd3_dir) is SD3Family


def test_bad_requests_and_checkpoints_are_refused(sd3, sd3_dir, tmp_path):
    engine = Engine(sd3, EngineConfig(max_outputs_per_request=4))
    with pytest.raises(RequestError, match="height=30"):
        engine.generate(RolloutRequest(prompt="a cat", height=30, width=32))
    with pytest.raises(RequestError) as err:
        engine.generate(RolloutRequest(prompt="a cat", image="data:image/png;base64,AAAA", height=32, width=32))
    assert err.value.field == "image"
    dynamic = tmp_path / "sd3-dynamic"
    shutil.copytree(sd3_dir, dynamic)
    config = dynamic / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "use_dynamic_shifting": True}))
    with pytest.raises(ModelLoadError, match="dynamic shifting"):
        SD3Family.load(dynamic)
    (dynamic / "vae" / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="missing file: .*vae/config.json"):
        SD3Family.load(dynamic)


# NFT full finetunes are covered on the demo, flux3, qwen_image and krea2 families in the default run.
@pytest.mark.parametrize(("loss_type", "lora"), [("flow_grpo", True), pytest.param("nft", False, marks=pytest.mark.slow)], ids=["grpo-lora", "nft-full"])
def test_training_run_on_sd3(sd3_dir, tmp_path, loss_type, lora):
    run_training(sd3_dir, tmp_path / "run", loss_type, lora, guidance=4.5)


def test_resolution_sets_the_rollout_and_evaluation_size(sd3_dir, tmp_path):
    """--resolution reaches the rollout requests and the held-out evaluation; a size the family cannot
    make is refused before anything runs, naming the flag."""
    from diffrl.evaluation.shapes import evaluate_prompts
    from diffrl.train.config import TrainConfig
    from diffrl.train.trainer import Trainer

    sizes = []

    def reward(images, prompts, metadata=None):
        sizes.extend(tuple(image.shape[-2:]) for image in images)
        return [1.0 - float(image.mean()) for image in images]

    flags = dict(model_path=sd3_dir, num_rollout=1, rollout_batch_size=1, n_samples_per_prompt=2,
                 rollout_microgroup_size=2, global_batch_size=2, num_steps_per_rollout=1, micro_batch_size=2,
                 diffusion_num_steps=2, diffusion_sde_window_range=(0, 2), device="cpu", use_lora=False)
    assert SD3Family.load(sd3_dir).default_size() == (32, 32)
    trainer = Trainer(TrainConfig.flat(output_dir=tmp_path / "run", resolution=16, **flags), reward_fn=reward)
    record = trainer.rollout_and_update(0)
    assert sizes == [(16, 16)] * 2 and record["train/pairs"] == 4
    _, images = evaluate_prompts(trainer.policy.family, ["a red circle"], num_seeds=1, num_steps=2, resolution=16)
    assert images.shape[-2:] == (16, 16)
    with pytest.raises(ValueError, match="--resolution 18: height=18: SD3 needs a positive multiple of 4"):
        Trainer(TrainConfig.flat(output_dir=tmp_path / "refused", resolution=18, **flags))


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_chunked_decode_equals_one_image_per_call(sd3, monkeypatch, batch):
    """The GPU's decode path (chunks of DECODE_PIXELS_PER_CALL pixels, here 2 images of 32² per call)
    gives every image, in order, equal to decoding it alone, also for a single image."""
    from diffrl.models import batch_invariance

    monkeypatch.setattr(batch_invariance, "DECODE_PIXELS_PER_CALL", 2 * 32 * 32)
    latents = sd3.prepare_latents(make_generators(range(batch)), 32, 32).tokens
    calls = []

    def decode(rows):
        calls.append(len(rows))
        return sd3.vae.decode(rows, return_dict=False)[0]

    chunked = batch_invariance.decode_rows(decode, latents, chunked=True)
    assert calls == [1, *([2] * ((batch - 1) // 2)), *([1] if (batch - 1) % 2 else [])]
    alone = batch_invariance.decode_rows(decode, latents, chunked=False)
    assert chunked.shape == (batch, 3, 32, 32)
    torch.testing.assert_close(chunked, alone, rtol=0, atol=1e-5)


def test_sd3_grpo_recipe_is_flow_grpos_setting_and_flags_override_it(sd3_dir):
    from diffrl.cli.main import parse
    from diffrl.train.trainer import validate_config

    cfg = parse(["train", "--recipe", "sd3-grpo", "--model-path", str(sd3_dir), "--lora-rank", "16"])
    m, r = cfg.model, cfg.rollout
    assert (m.resolution, r.diffusion_num_steps, r.diffusion_guidance_scale) == (512, 10, 4.5)
    assert m.use_lora and m.lora_rank == 16 and r.diffusion_num_sde_steps == 9
    assert cfg.eval.eval_images_per_category == 0 and m.model_path == sd3_dir
    validate_config(cfg)  # its batch sizes are consistent


def test_a_checkpoint_of_another_family_is_refused_naming_both(sd3_dir, tmp_path, capsys):
    """A recipe's family on another family's checkpoint (sd35-grpo-ocr on a Qwen-Image directory) is one line
    naming the checkpoint's transformer class and its family, before anything loads: it said "missing file:
    …/tokenizer_2/tokenizer_config.json", and the Qwen-Image family on an SD3 directory loaded random
    weights for the transformer (a warning) and failed in the VAE with a diffusers shape error."""
    from diffrl.cli.main import main as cli_main
    from diffrl.models.qwen_image import QwenImageFamily
    from diffrl.models.random_checkpoints.qwen_image import save_random_checkpoint as save_qwen

    with pytest.raises(ModelLoadError, match=r"sd3-tiny is a checkpoint of the sd3 family \(transformer/ holds "
                                             r"SD3Transformer2DModel\), not of Qwen-Image \(which loads "
                                             r"QwenImageTransformer2DModel\): pass --diffusion-model-family sd3$"):
        QwenImageFamily.load(sd3_dir)
    qwen_dir = save_qwen(tmp_path / "qwen-tiny")
    data = tmp_path / "prompts.txt"
    data.write_text('a sign that says "OPEN"\n')
    out = tmp_path / "run"
    capsys.readouterr()
    assert cli_main(["train", "--recipe", "sd35-grpo-ocr", "--model-path", str(qwen_dir), "--prompt-data", str(data),
                     "--device", "cpu", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "QwenImageTransformer2DModel" in err and "qwen_image" in err, err
    assert not out.exists()


def test_a_size_beyond_the_position_embedding_names_the_flag_and_the_largest_size(sd3_dir, tmp_path, capsys):
    """A size the checkpoint's position embedding does not cover was diffusers' "Height (128) cannot be greater than
    pos_embed_max_size: 32" from inside the first rollout; it is one line naming --resolution and the largest side."""
    from diffrl.cli.main import main

    largest = 32 * 2 * SD3Family.load(sd3_dir).vae_scale
    out = tmp_path / "run"
    assert main(["train", "--model-path", str(sd3_dir), "--resolution", str(2 * largest), "--device", "cpu",
                 "--output-dir", str(out), "--num-rollout", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: --resolution {2 * largest}: height={2 * largest}: this SD3 checkpoint makes at most "
                          f"{largest} pixels a side") and not out.exists()
