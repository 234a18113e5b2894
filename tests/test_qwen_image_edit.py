"""Qwen-Image-Edit and Qwen-Image-Edit Plus (the qwen_image family's image-conditioned mode) against diffusers'
QwenImageEditPipeline and QwenImageEditPlusPipeline, on tiny random checkpoints built in code (their Qwen2.5-VL text
encoder runs its vision tower on the condition images), and editing runs through the trainer."""

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_flux1_kontext import SEEN, closeness_to_source, png, write_editing_set

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.errors import RequestError
from diffrl.models.base import Latents, PromptEmbeds
from diffrl.models.qwen_image import QwenImageFamily
from diffrl.models.random_checkpoints.qwen_image import save_random_checkpoint
from diffrl.models.registry import resolve_family
from diffrl.sampling import make_generators

TOLERANCE = 1e-5  # fp32 on CPU through two code paths (measured: ≤ 3.0e-7, Edit and Plus, with and without CFG)
HEIGHT, WIDTH = 32, 48


@pytest.fixture(scope="module")
def edit_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "qwen-image-edit-tiny",
                                  edit="QwenImageEditPipeline")


@pytest.fixture(scope="module")
def plus_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "qwen-image-edit-plus-tiny",
                                  edit="QwenImageEditPlusPipeline")


@pytest.fixture(scope="module")
def edit(edit_dir) -> QwenImageFamily:
    return QwenImageFamily.load(edit_dir)


@pytest.fixture(scope="module")
def plus(plus_dir) -> QwenImageFamily:
    return QwenImageFamily.load(plus_dir)


def _request(**fields) -> RolloutRequest:
    return RolloutRequest(**{"prompt": "make the cat red", "seed": 3, "num_outputs_per_prompt": 2,
                             "num_inference_steps": 2, "height": HEIGHT, "width": WIDTH, **fields})


def _engine_and_pipeline(family, sources, negative, cfg):
    engine = Engine(family, EngineConfig(max_outputs_per_request=4))
    outputs = engine.generate(_request(negative_prompt=negative, guidance_scale=cfg, image_path=sources))
    ours = torch.stack([o.generated_output for o in outputs])
    noise = family.prepare_latents(make_generators([3, 4]), HEIGHT, WIDTH).tokens

    def pipeline(images):
        pictures = [Image.open(io.BytesIO(s)) for s in images]
        with family.reference_image_areas():
            return family.reference_pipeline()(
                image=pictures if family.settings.edit == "edit_plus" else pictures[0], prompt="make the cat red",
                negative_prompt=negative if cfg > 1 else None, true_cfg_scale=cfg, latents=noise,
                num_inference_steps=2, height=HEIGHT, width=WIDTH, num_images_per_prompt=2, output_type="pt").images

    return engine, ours, pipeline


@pytest.mark.parametrize(("negative", "cfg"), [("", 1.0), ("blurry", 4.0)], ids=["no-cfg", "true-cfg"])
def test_engine_reproduces_qwen_image_edit_pipeline(edit, negative, cfg):
    """ODE sampling through our engine gives QwenImageEditPipeline's images from the same noise and source image
    (30x42: resized to the reference area), without CFG and with true CFG (the negative prompt sees the image too)."""
    engine, ours, pipeline = _engine_and_pipeline(edit, [png(0)], negative, cfg)
    reference = pipeline([png(0)])
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    other = pipeline([png(1)])
    assert (other - reference).abs().max() > 30 * TOLERANCE  # the source matters: the check can fail
    assert engine.image_encodes == 1  # once per request, shared by its outputs and by CFG's negative prompt


@pytest.mark.parametrize(("negative", "cfg"), [("", 1.0), ("blurry", 4.0)], ids=["no-cfg", "true-cfg"])
def test_engine_reproduces_qwen_image_edit_plus_pipeline_with_two_images(plus, negative, cfg):
    """Plus with two input images of different aspect ratios: each named "Picture k" to the text encoder at its own
    area, both reference images after the noisy tokens with their own img_shapes."""
    sources = [png(0), png(2, (16, 48))]  # reference images of 32x32 and 64x32 pixels
    _, ours, pipeline = _engine_and_pipeline(plus, sources, negative, cfg)
    reference = pipeline(sources)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    swapped = pipeline(sources[::-1])  # the order matters (Picture 1, Picture 2)
    assert (swapped - reference).abs().max() > 30 * TOLERANCE


def test_the_text_encoder_sees_the_images_and_the_conditioning_keeps_them_apart_from_the_text(edit):
    """The prompt's tokens depend on the image (Qwen2.5-VL's vision input): its image tokens sit in the text; the
    reference tokens sit before the text, so padding the text at the end never touches them."""
    source = torch.from_numpy(np.array(Image.open(io.BytesIO(png(0))))).permute(2, 0, 1)
    images = edit.encode_condition_images([source])
    cond = edit.encode_prompts_with_images(["make the cat red"], images)
    length, rows, count, h, w = (int(v) for v in cond.embeds[0, 0, :5])
    assert (count, h, w) == (1, 8, 8) and images.tokens.shape == (1, 64, 16) and rows == 64 * 16 // 32
    assert cond.embeds.shape[1] == 1 + rows + length and length > 16 + 5  # 16 image tokens, the instruction, the end
    other = edit.encode_condition_images([torch.flip(source, dims=[1])])
    other.tokens = images.tokens  # the same reference tokens, another picture for the text encoder
    text = cond.embeds[0, 1 + rows :]
    moved = edit.encode_prompts_with_images(["make the cat red"], other).embeds[0, 1 + rows :]
    assert (moved - text).abs().max() > 1e-3
    padded = edit.pair_conditionings(edit.encode_prompts_with_images([""], images), cond)
    torch.testing.assert_close(padded.embeds[1], cond.embeds[0])  # the longer one unchanged, the other padded
    wire = edit.cond_kwargs_to_wire(cond, torch.zeros(4, 3))
    assert wire["img_shapes"][0][1] == [1, 8, 8] and wire["condition_latents"].shape == (64, 16)
    back, _ = QwenImageFamily.cond_kwargs_from_wire(wire)
    assert torch.equal(back.embeds, cond.embeds)


def test_the_edit_mode_comes_from_the_model_index_and_requests_without_an_image_are_refused(edit, edit_dir, plus):
    assert resolve_family(None, edit_dir) is QwenImageFamily
    assert (edit.settings.edit, edit.max_condition_images, plus.settings.edit, plus.max_condition_images) == (
        "edit", 1, "edit_plus", 3)
    assert type(edit.reference_pipeline()).__name__ == "QwenImageEditPipeline"
    assert type(plus.reference_pipeline()).__name__ == "QwenImageEditPlusPipeline"
    engine = Engine(edit)
    with pytest.raises(RequestError, match="edits images: send the condition image in image_path"):
        engine.generate(_request())
    with pytest.raises(RequestError, match="takes at most 1"):
        engine.generate(_request(image_path=[png(0), png(1)]))


def test_a_batch_with_reference_images_of_different_sizes_runs_one_forward_per_size(plus):
    """Rows whose sources differ in aspect ratio (so in reference size) share a velocity call: each size runs alone,
    and each row equals its own forward."""
    sources = [torch.from_numpy(np.array(Image.open(io.BytesIO(png(k, size))))).permute(2, 0, 1)
               for k, size in ((0, (30, 42)), (1, (16, 48)))]
    images = [plus.encode_condition_images([s]) for s in sources]
    assert [i.grids for i in images] == [[(8, 8)], [(8, 16)]]
    conds = [plus.encode_prompts_with_images(["make the cat red"], i) for i in images]
    longest = max(c.embeds.shape[1] for c in conds)
    both = torch.cat([torch.nn.functional.pad(c.embeds, (0, 0, 0, longest - c.embeds.shape[1])) for c in conds])
    latents = plus.prepare_latents(make_generators([1, 2]), HEIGHT, WIDTH)
    sigma = torch.full((2,), 0.7)
    together = plus.velocity(plus.transformer, latents, sigma, PromptEmbeds(both, torch.zeros(longest, 1)), None, 1.0)
    for k, cond in enumerate(conds):
        alone = plus.velocity(plus.transformer, Latents(latents.tokens[k : k + 1], latents.ids), sigma[:1], cond,
                              None, 1.0)
        torch.testing.assert_close(together[k : k + 1], alone, rtol=0, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["flow_grpo", "nft"])
def test_training_on_an_editing_prompt_set(edit_dir, tmp_path, loss_type):
    """Two rollouts of Flow-GRPO (true CFG, the source in both halves) and of DiffusionNFT on edits; the reward sees
    each prompt's source, and the trainer's forward (the engine's) replays the steps from the padded conditioning."""
    from test_flux1_kontext import _train

    SEEN.clear()
    records, _ = _train(edit_dir, write_editing_set(tmp_path), tmp_path / "run", loss_type,
                        reward_fn=closeness_to_source)
    trained = [r for r in records if "train/loss" in r]
    assert len(trained) == 2 and all(np.isfinite(r["train/loss"]) for r in trained)
    if loss_type == "flow_grpo":
        assert trained[-1]["train/log_prob_mean_abs_diff"] < 1e-4
    assert SEEN and all(shape == (3, 32, 48) for shape in SEEN)


def test_sources_of_different_aspect_ratios_train_in_one_rollout(edit_dir, tmp_path):
    """Unlike FLUX.1 Kontext, one rollout may hold sources whose reference images differ in size: the trainer pads
    the text after the reference tokens, and its forward (one per reference size) replays the engine's steps."""
    from test_flux1_kontext import _train

    prompts = write_editing_set(tmp_path / "data")
    (tmp_path / "data" / "images" / "b.png").write_bytes(png(1, (16, 48)))  # a 64x32 reference against a.png's 32x32

    def brightness(images, prompts, metadata):
        return [float(image.mean()) for image in images]

    records, _ = _train(edit_dir, prompts, tmp_path / "run", "flow_grpo", num_rollout=1, reward_fn=brightness)
    trained = [r for r in records if "train/loss" in r]
    assert len(trained) == 1 and trained[0]["train/log_prob_mean_abs_diff"] < 1e-4


def test_qwen_image_edit_recipe_is_flow_factorys_setting(plus_dir, tmp_path):
    from diffrl.cli.main import parse
    from diffrl.train.trainer import validate_config

    prompts = write_editing_set(tmp_path)
    cfg = parse(["train", "--recipe", "qwen-image-edit-grpo-pickscore", "--model-path", str(plus_dir),
                 "--prompt-data", str(prompts)])
    m, r, o = cfg.model, cfg.rollout, cfg.optim
    assert (m.diffusion_model_family, cfg.algorithm.loss_type, m.size()) == ("qwen_image", "flow_grpo", (384, 384))
    assert (r.diffusion_num_steps, r.diffusion_guidance_scale, r.diffusion_noise_level) == (10, 4.0, 1.0)
    assert (r.diffusion_sde_window_range, r.diffusion_num_sde_steps) == ((1, 4), 1)
    assert (r.rollout_batch_size, r.n_samples_per_prompt, o.num_steps_per_rollout, o.lr) == (48, 16, 2, 3e-4)
    assert (m.condition_image_size, cfg.eval.eval_condition_image_size) == (384, 1024)  # its references
    assert cfg.eval.eval_batch_size == 1  # its evaluation's per_device_batch_size
    assert (cfg.engine.engine_max_batch_outputs, cfg.engine.engine_concurrency) == (16, 2)  # fits 80 GB (recipes.py)
    validate_config(cfg)


def test_edit_2511_zero_cond_t_runs_as_plus(plus_dir, tmp_path):
    """Qwen-Image-Edit-2511 is a Plus checkpoint whose transformer sets zero_cond_t (the reference tokens modulated at
    timestep 0): the engine equals QwenImageEditPlusPipeline with true CFG; the option is refused on an Edit
    checkpoint (whose pipeline predates it)."""
    import shutil

    from diffrl.errors import ModelLoadError

    folder = tmp_path / "qwen-image-edit-2511-tiny"
    shutil.copytree(plus_dir, folder)
    config = folder / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "zero_cond_t": True}))
    family = QwenImageFamily.load(folder)
    sources = [png(0), png(2, (16, 48))]
    _, ours, pipeline = _engine_and_pipeline(family, sources, "blurry", 4.0)
    reference = pipeline(sources)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    _, without, _ = _engine_and_pipeline(QwenImageFamily.load(plus_dir), sources, "blurry", 4.0)
    assert (without - ours).abs().max() > 30 * TOLERANCE  # zero_cond_t changes the images: the check can fail
    index = folder / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "_class_name": "QwenImageEditPipeline"}))
    with pytest.raises(ModelLoadError, match="zero_cond_t"):
        QwenImageFamily.load(folder)


def test_replay_of_an_editing_rollout_equals_the_live_run(edit_dir, tmp_path):
    from test_flux1_kontext import _train

    prompts = write_editing_set(tmp_path / "data")
    live, live_state = _train(edit_dir, prompts, tmp_path / "live", "flow_grpo", num_rollout=1,
                              save_rollout_data=tmp_path / "records")
    replayed, state = _train(edit_dir, prompts, tmp_path / "replay", "flow_grpo", num_rollout=1,
                             load_rollout_data=tmp_path / "records")
    assert all(torch.equal(a, b) for a, b in zip(state, live_state, strict=True))
    keys = ("train/loss", "train/grad_norm", "rollout/reward/raw_mean")
    assert [[r.get(k) for k in keys] for r in live] == [[r.get(k) for k in keys] for r in replayed]


def test_sample_k_is_the_same_in_any_microgroup(edit):
    """On CPU an edit's sample k is bit-identical whether its request asks for 1, 2 or 3 outputs."""
    outputs = {n: Engine(edit, EngineConfig(max_outputs_per_request=4)).generate(
        _request(num_outputs_per_prompt=n, image_path=[png(0)], negative_prompt="blurry", guidance_scale=4.0))
        for n in (1, 3)}
    assert torch.equal(outputs[1][0].generated_output, outputs[3][0].generated_output)


def test_an_edit_survives_the_http_wire_bit_for_bit(edit_dir, tmp_path):
    """Served as `diffrl serve --image-roots DIR` serves it: diffrl's client (bytes) and sglang's `image_path` naming a
    file under the root (its cond kwargs: the text, img_shapes with the reference grid, condition_latents) give the
    in-process outputs and conditioning to the bit."""
    import asyncio

    import httpx

    from diffrl.cli.main import parse
    from diffrl.rollout.clients import HttpEngineClient
    from diffrl.serving import sglang
    from diffrl.serving.server import build_engine, create_app, serving_in_thread

    (tmp_path / "roots").mkdir()
    source = tmp_path / "roots" / "source.png"
    source.write_bytes(png(2))
    engine = build_engine(parse(["serve", "--model-path", str(edit_dir), "--device", "cpu",
                                 "--max-outputs-per-request", "4", "--image-roots", str(tmp_path / "roots")]))
    fields = {"negative_prompt": "blurry", "guidance_scale": 4.0, "rollout": True,
              "rollout_return_denoising_env": True, "rollout_return_dit_trajectory": True}
    local = engine.generate(_request(image_path=[source.read_bytes()], **fields))

    def same(outputs):
        assert all(torch.equal(a.generated_output, b.generated_output) for a, b in zip(outputs, local, strict=True))
        env, want = outputs[0].denoising_env, local[0].denoising_env
        assert all(torch.equal(env[k], want[k]) for k in ("prompt_embeds", "negative_prompt_embeds"))

    with serving_in_thread(create_app(engine)) as url:
        client = HttpEngineClient(url)
        try:
            same(asyncio.run(client.generate(_request(image_path=[source.read_bytes()], **fields))))
        finally:
            client.close()
        by_path = _request(image_path=[str(source)], **fields)
        answer = httpx.post(f"{url}/rollout/generate", json=by_path.model_dump(exclude_none=True), timeout=60)
        same(sglang.decode_response(answer.content, by_path, engine.family))
