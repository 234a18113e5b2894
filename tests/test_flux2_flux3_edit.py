"""Reference-image editing of the flux2 family (FLUX.2 [klein] and [dev]: Flux2KleinPipeline / Flux2Pipeline with
`image`) and of flux3_image (FLUX 3 Image Klein: its modular pipeline with `image`), and condition images on the
demo family (the FLUX 3 transformer), on tiny random checkpoints built in code."""

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.errors import RequestError
from diffrl.models.flux2 import Flux2Family
from diffrl.models.flux2_vae import crop_reference, fill_reference
from diffrl.models.flux3_image import Flux3ImageFamily
from diffrl.models.random_checkpoints.flux2 import save_random_checkpoint as save_flux2, tiny as tiny_flux2
from diffrl.models.random_checkpoints.flux3_image import save_random_checkpoint as save_flux3
from diffrl.sampling import make_generators
from family_checks import random_png

TOLERANCE = 1e-5  # fp32 on CPU through two code paths
HEIGHT, WIDTH, STEPS, SEED = 32, 48, 3, 3
PROMPT = "make the cat red"


@pytest.fixture(scope="module")
def klein_dir(tmp_path_factory) -> Path:
    return save_flux2(tmp_path_factory.mktemp("models") / "flux2-klein-base-tiny", tiny_flux2("klein"))


@pytest.fixture(scope="module")
def klein(klein_dir) -> Flux2Family:
    return Flux2Family.load(klein_dir)


@pytest.fixture(scope="module")
def dev(tmp_path_factory) -> Flux2Family:
    return Flux2Family.load(save_flux2(tmp_path_factory.mktemp("models") / "flux2-dev-tiny", tiny_flux2("dev")))


@pytest.fixture(scope="module")
def flux3_dir(tmp_path_factory) -> Path:
    return save_flux3(tmp_path_factory.mktemp("models") / "flux3-image-tiny")


@pytest.fixture(scope="module")
def flux3(flux3_dir) -> Flux3ImageFamily:
    return Flux3ImageFamily.load(flux3_dir)


def png(seed: int, size=(66, 83)) -> bytes:
    """A random RGB picture as PNG bytes ((height, width); 66x83 is not a multiple of the tiny models' 4-pixel
    token: FLUX.2 and several FLUX 3 references crop it, one FLUX 3 reference is padded)."""
    return random_png(seed, size)


def _generate(family, sources, negative="", cfg=1.0):
    engine = Engine(family, EngineConfig(max_outputs_per_request=4))
    outputs = engine.generate(RolloutRequest(prompt=PROMPT, negative_prompt=negative, seed=SEED,
                                             num_outputs_per_prompt=2, num_inference_steps=STEPS, guidance_scale=cfg,
                                             height=HEIGHT, width=WIDTH, image_path=sources))
    return torch.stack([o.generated_output for o in outputs]), engine


def _flux2_pipeline(family, images, negative, cfg, noise):
    pipe, kwargs = family.reference_pipeline(), family.reference_pipeline_kwargs()
    if family.settings.variant == "klein":
        kwargs["guidance_scale"] = cfg
        if cfg > 1:
            kwargs["negative_prompt_embeds"] = pipe.encode_prompt(
                negative, max_sequence_length=kwargs["max_sequence_length"],
                text_encoder_out_layers=kwargs["text_encoder_out_layers"])[0]
    grid = noise.transpose(1, 2).reshape(len(noise), -1, HEIGHT // family.pixels_per_token,
                                         WIDTH // family.pixels_per_token)
    return pipe(image=images, prompt=PROMPT, latents=grid, num_inference_steps=STEPS, height=HEIGHT, width=WIDTH,
                num_images_per_prompt=len(noise), output_type="pt", **kwargs).images


@pytest.mark.parametrize(("variant", "negative", "cfg", "count"), [
    ("klein", "blurry", 4.0, 1), ("klein", "", 1.0, 1), ("klein", "blurry", 4.0, 2), ("klein", "", 1.0, 2),
    ("dev", "", 1.0, 1), ("dev", "", 1.0, 2),  # dev: its embedded guidance
], ids=["klein-cfg-1", "klein-1", "klein-cfg-2", "klein-2", "dev-1", "dev-2"])
def test_flux2_engine_reproduces_the_pipeline_with_reference_images(request, variant, negative, cfg, count):
    """ODE sampling through the engine gives the pipeline's images from the same noise and references (two of
    different sizes: each its own t offset); the references matter, and are encoded once per request."""
    family = request.getfixturevalue(variant)
    sources = [png(0), png(1, (70, 64))][:count]
    ours, engine = _generate(family, sources, negative, cfg)
    noise = family.prepare_latents(make_generators([SEED, SEED + 1]), HEIGHT, WIDTH).tokens
    pictures = [Image.open(io.BytesIO(s)) for s in sources]
    reference = _flux2_pipeline(family, pictures, negative, cfg, noise)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    other = _flux2_pipeline(family, [Image.open(io.BytesIO(png(5)))] + pictures[1:], negative, cfg, noise)
    assert (other - reference).abs().max() > 10 * TOLERANCE  # the comparison can fail
    assert engine.image_encodes == 1


def _flux3_pipeline(family, images, negative, cfg, noise):
    pipe = family.reference_pipeline()
    pipe.update_components(guider=pipe.guider.new(guidance_scale=cfg, enabled=cfg > 1))
    grid = noise.transpose(1, 2).reshape(len(noise), -1, HEIGHT // 4, WIDTH // 4)
    return pipe(image=images if len(images) > 1 else images[0], prompt=PROMPT,
                negative_prompt=negative if cfg > 1 else None, latents=grid, num_inference_steps=STEPS,
                height=HEIGHT, width=WIDTH, num_images_per_prompt=len(noise), output="images", output_type="pt",
                **family.reference_pipeline_kwargs())


@pytest.mark.parametrize(("negative", "cfg", "count"), [("blurry", 3.5, 1), ("", 1.0, 1), ("blurry", 3.5, 2),
                                                       ("", 1.0, 2)], ids=["cfg-1", "1", "cfg-2", "2"])
def test_flux3_engine_reproduces_the_modular_pipeline_with_reference_images(flux3, negative, cfg, count):
    """FLUX 3 Image Klein editing: one reference (padded to its canvas) or two (cropped, l = -1, -2) through the
    transformer's reference-token mode equal diffusers' modular pipeline given `image` and the output size."""
    sources = [png(0), png(1, (70, 64))][:count]
    ours, engine = _generate(flux3, sources, negative, cfg)
    noise = flux3.prepare_latents(make_generators([SEED, SEED + 1]), HEIGHT, WIDTH).tokens
    pictures = [Image.open(io.BytesIO(s)) for s in sources]
    reference = _flux3_pipeline(flux3, pictures, negative, cfg, noise)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    other = _flux3_pipeline(flux3, [Image.open(io.BytesIO(png(5)))] + pictures[1:], negative, cfg, noise)
    assert (other - reference).abs().max() > 5 * TOLERANCE  # another first reference: ≥ 9.5e-5 apart here
    assert engine.image_encodes == 1


@pytest.mark.parametrize("size", [(1100, 1000), (66, 83), (40, 17), (3000, 90)])
def test_reference_sizing_is_the_image_processors(size):
    """`crop_reference` / `fill_reference` give the pixels of Flux2ImageProcessor's and Flux3ImageProcessor's
    preprocessing (downscaled above the area cap, cropped or reflect-padded to the token grid)."""
    from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    pixels = np.random.default_rng(0).integers(0, 256, (*size, 3), dtype=np.uint8)
    image = torch.from_numpy(pixels).permute(2, 0, 1)

    def as_uint8(tensor):  # the processors' [-1, 1] floats back to the pixels they hold
        return ((tensor[0] + 1) / 2 * 255).round().to(torch.uint8)

    for step in (4, 16):
        flux3 = Flux3ImageProcessor(vae_scale_factor=step)
        padded, _ = flux3.preprocess(Image.fromarray(pixels), resize_mode="fill")
        assert torch.equal(fill_reference(image, step), as_uint8(padded))
        if min(size) >= step:
            cropped, _ = flux3.preprocess(Image.fromarray(pixels), resize_mode="crop")
            assert torch.equal(crop_reference(image, step), as_uint8(cropped))
            flux2 = Flux2ImageProcessor(vae_scale_factor=step)
            picture = Image.fromarray(pixels)
            if picture.width * picture.height > 1024 * 1024:
                picture = flux2._resize_to_target_area(picture, 1024 * 1024)
            w, h = picture.width // step * step, picture.height // step * step
            assert torch.equal(crop_reference(image, step), as_uint8(flux2.preprocess(picture, height=h, width=w,
                                                                                      resize_mode="crop")))


def write_editing_set(folder: Path) -> Path:
    """A tiny editing prompt set (FLUX.2 takes references of 64 pixels a side or more)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, seed in (("a.png", 0), ("b.png", 1)):
        (folder / name).write_bytes(png(seed, (64, 96)))
    rows = [{"prompt": "make the cat red", "image": "a.png"}, {"prompt": "remove the dog", "images": ["b.png"]}]
    path = folder / "edits.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


SEEN = []


def brightness_like_source(images, prompts, metadata):
    """An editing reward that reads each sample's source (metadata['condition_images'])."""
    sources = [m["condition_images"][0] for m in metadata]
    SEEN.extend(s.shape for s in sources)
    return [1.0 - abs(float(image.mean() - source.mean())) for image, source in zip(images, sources, strict=True)]


@pytest.mark.parametrize("loss_type", ["flow_grpo", "nft"])
@pytest.mark.parametrize("model", ["klein", "flux3"])
def test_training_on_an_editing_prompt_set(request, tmp_path, model, loss_type):
    """Two rollouts of Flow-GRPO (CFG with the references in both halves) and of DiffusionNFT on edits: the trainer
    replays the engine's steps from the folded conditioning, the reward sees each prompt's source."""
    from test_flux1_kontext import _train

    SEEN.clear()
    model_dir = request.getfixturevalue(f"{model}_dir")
    records, _ = _train(model_dir, write_editing_set(tmp_path / "data"), tmp_path / "run", loss_type,
                        reward_fn=brightness_like_source)
    trained = [r for r in records if "train/loss" in r]
    assert len(trained) == 2 and all(np.isfinite(r["train/loss"]) for r in trained)
    if loss_type == "flow_grpo":
        assert trained[-1]["train/log_prob_mean_abs_diff"] < 1e-4
    assert SEEN and all(shape == (3, 64, 96) for shape in SEEN)


def test_bad_reference_images_are_refused_by_name(klein, flux3):
    with pytest.raises(RequestError, match=r"image_path\[1\] is 40x64 pixels; FLUX.2 takes references of at least 64"):
        _generate(klein, [png(0), png(1, (64, 40))])
    with pytest.raises(RequestError, match="takes at most 10"):
        _generate(flux3, [png(0)] * 11)


def test_demo_family_takes_condition_images_in_the_flux3_reference_mode():
    """The demo model (the FLUX 3 transformer in pixel space): a condition image at its size goes to the
    transformer's reference mode (the forward equals a direct call with `image_cond_hidden_states`), changes the
    samples, and another size is refused by name. No diffusers pipeline exists for it: self-consistency."""
    from diffrl.models.demo import patchify
    from diffrl.models.random_checkpoints.demo import random_family, tiny

    family = random_family(tiny())
    size = (family.config.height, family.config.width)
    source = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (3, *size), dtype=np.uint8))
    cond = family.encode_prompts(["a red circle"])
    folded = family.condition_on_images(cond, family.encode_condition_images([source]))
    latents = family.prepare_latents(make_generators([1]), *size)
    sigma = torch.tensor([0.7])
    ours = family.run_transformer(family.transformer, latents, sigma, folded)
    ids = family.prepare_ids()
    ids[:, 3] = -1
    direct = family.transformer(hidden_states=latents.tokens, encoder_hidden_states=cond.embeds, timestep=sigma,
                                img_ids=latents.ids, txt_ids=cond.ids, return_dict=False,
                                image_cond_hidden_states=patchify(source.float()[None] / 255 * 2 - 1, 4),
                                image_cond_ids=ids)[0]
    assert torch.equal(ours, direct)
    assert not torch.allclose(ours, family.run_transformer(family.transformer, latents, sigma, cond))
    buffer = io.BytesIO()
    Image.fromarray(source.permute(1, 2, 0).numpy()).save(buffer, format="PNG")
    engine = Engine(family)
    request = dict(prompt="a red circle", seed=1, num_outputs_per_prompt=2, num_inference_steps=2, height=size[0],
                   width=size[1], guidance_scale=2.0)
    edited = engine.generate(RolloutRequest(**request, image_path=[buffer.getvalue()]))
    plain = engine.generate(RolloutRequest(**request))
    assert not torch.allclose(edited[0].generated_output, plain[0].generated_output)
    with pytest.raises(RequestError, match="the demo model takes condition images of its own"):
        engine.generate(RolloutRequest(**request, image_path=[png(0)]))


def test_flux2_dev_edit_recipe_is_flow_factorys_i2i_setting(tmp_path):
    from diffrl.cli.main import parse

    model_dir = save_flux2(tmp_path / "flux2-dev-tiny", tiny_flux2("dev"))
    cfg = parse(["train", "--recipe", "flux2-dev-edit-grpo-pickscore", "--model-path", str(model_dir),
                 "--prompt-data", str(write_editing_set(tmp_path / "data"))])
    m, r, o = cfg.model, cfg.rollout, cfg.optim
    assert (m.diffusion_model_family, cfg.algorithm.loss_type, m.size()) == ("flux2", "flow_grpo", (384, 384))
    assert (r.diffusion_num_steps, r.diffusion_noise_level, r.diffusion_sde_window_range) == (10, 1.0, (1, 4))
    assert (r.rollout_batch_size, r.n_samples_per_prompt, o.num_steps_per_rollout, o.lr) == (48, 16, 2, 3e-4)
    assert (m.condition_image_size, cfg.eval.eval_condition_image_size) == (384, 512)
