"""`--condition-image-size N`: each condition image sized to at most N² pixels of area before it is encoded, in place
of the pipeline's own sizing (Flow-Factory's `condition_image_size`), in training, serving and evaluation alike."""

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from family_checks import random_png, write_conditioned_prompt_set

from diffrl.cli.main import main as cli_main
from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.engine.spec import EngineSpec, load_family
from diffrl.errors import ModelLoadError
from diffrl.models.checkpoint import load_model
from diffrl.models.flux1 import Flux1Family
from diffrl.models.flux2 import Flux2Family
from diffrl.models.flux3_image import Flux3ImageFamily
from diffrl.models.qwen_image import QwenImageFamily
from diffrl.models.random_checkpoints.flux1 import save_random_checkpoint as save_flux1
from diffrl.models.random_checkpoints.flux2 import save_random_checkpoint as save_flux2, tiny as tiny_flux2
from diffrl.models.random_checkpoints.flux3_image import save_random_checkpoint as save_flux3
from diffrl.models.random_checkpoints.qwen_image import save_random_checkpoint as save_qwen
from diffrl.models.random_checkpoints.wan2_2 import save_random_checkpoint as save_wan
from diffrl.sampling import make_generators
from diffrl.serving.config import ServeConfig
from diffrl.serving.server import engine_spec as serve_spec

TOLERANCE = 1e-5  # fp32 on CPU through two code paths, as the families' own pipeline tests
HEIGHT, WIDTH = 32, 48
SOURCE_SIZE = (96, 144)  # (height, width): 13 824 pixels, above every cap below


@pytest.fixture(scope="module")
def kontext_dir(tmp_path_factory):
    return save_flux1(tmp_path_factory.mktemp("models") / "flux1-kontext-tiny", kontext=True)


def generate(family, sources: list[bytes], steps=2) -> torch.Tensor:
    engine = Engine(family, EngineConfig(max_outputs_per_request=4))
    outputs = engine.generate(RolloutRequest(prompt="make the cat red", seed=3, num_outputs_per_prompt=2,
                                             num_inference_steps=steps, guidance_scale=1.0, height=HEIGHT,
                                             width=WIDTH, image_path=sources))
    return torch.stack([o.generated_output for o in outputs])


def downscaled_png(source: bytes, area: int) -> bytes:
    """The source downscaled to `area` pixels (Lanczos, aspect kept, sides truncated): what a user resizing the
    sources beforehand would hand the engine."""
    pil = Image.open(io.BytesIO(source))
    scale = (area / (pil.width * pil.height)) ** 0.5
    buffer = io.BytesIO()
    pil.resize((int(pil.width * scale), int(pil.height * scale)), Image.Resampling.LANCZOS).save(buffer, "PNG")
    return buffer.getvalue()


def load(model: str, kontext_dir, tmp_path):
    if model == "kontext":
        return Flux1Family.load(kontext_dir)
    if model == "flux2-klein":
        return Flux2Family.load(save_flux2(tmp_path / "flux2-klein-base-tiny", tiny_flux2("klein")))
    return Flux3ImageFamily.load(save_flux3(tmp_path / "flux3-image-tiny"))


@pytest.mark.parametrize("model", ["kontext", "flux2-klein", "flux3"])
def test_a_capped_source_samples_as_the_source_downscaled_beforehand(model, kontext_dir, tmp_path):
    """FLUX.1 Kontext, FLUX.2 and FLUX 3 (several references: each cropped, as FLUX.2's) take a source at its own size
    up to their pipeline's cap: with the run's cap a large source gives what the same source downscaled to that area
    gives without it, and not what the full source gives (the check can fail)."""
    area = 80 * 96  # FLUX.2 refuses a reference under 64 pixels a side: this one keeps 71
    sources = [random_png(0, SOURCE_SIZE)] + ([random_png(2, (120, 80))] if model == "flux3" else [])
    plain = load(model, kontext_dir, tmp_path / "a")
    full = generate(plain, sources)
    beforehand = generate(plain, [downscaled_png(source, area) for source in sources])
    capped_family = load(model, kontext_dir, tmp_path / "b")
    capped_family.set_condition_image_area(area)
    capped = generate(capped_family, sources)
    torch.testing.assert_close(capped, beforehand, rtol=0, atol=TOLERANCE)
    assert (capped - full).abs().max() > 30 * TOLERANCE
    small = [random_png(1, (64, 72))] * len(sources)  # below the cap: unchanged (a cap, not a target)
    torch.testing.assert_close(generate(capped_family, small), generate(plain, small), rtol=0, atol=TOLERANCE)


def test_a_single_flux3_reference_fills_a_canvas_within_the_cap(tmp_path):
    """One FLUX 3 reference is kept whole and padded to a canvas of whole tokens (`fill_reference`): the cap bounds
    that canvas, as the pipeline's own 4 MP cap does."""
    family = Flux3ImageFamily.load(save_flux3(tmp_path / "flux3-image-tiny"))
    source = _tensor(random_png(0, SOURCE_SIZE))
    tokens_full = family.encode_condition_images([source])[0].shape[1]
    family.set_condition_image_area(64 * 80)
    tokens = family.encode_condition_images([source])[0].shape[1]
    assert tokens < tokens_full and tokens * family.pixels_per_token ** 2 <= 64 * 80


def test_qwen_image_edit_takes_it_as_its_reference_area_and_equals_its_pipeline_at_that_area(tmp_path):
    """Qwen-Image-Edit Plus resizes every source to its reference area (1024² in the pipelines; the tiny checkpoint's
    32²): the run's size replaces that area, up or down, and the engine still equals QwenImageEditPlusPipeline run
    at that area. What its text encoder sees (the VL area) stays."""
    family = QwenImageFamily.load(save_qwen(tmp_path / "qwen-image-edit-plus-tiny", edit="QwenImageEditPlusPipeline"))
    source = random_png(0, (30, 42))
    before = family.encode_condition_images([_tensor(source)])
    family.set_condition_image_area(64 * 64)  # up from 32²: the pipelines resize to their area either way
    after = family.encode_condition_images([_tensor(source)])
    assert family.reference_area == 64 * 64 and family.settings.vl_image_area == 32 * 32
    assert after.tokens.shape[1] > before.tokens.shape[1] and after.grids != before.grids  # more reference tokens
    assert [v.size for v in after.vision] == [v.size for v in before.vision]
    ours = generate(family, [source])
    noise = family.prepare_latents(make_generators([3, 4]), HEIGHT, WIDTH).tokens
    with family.reference_image_areas():
        reference = family.reference_pipeline()(
            image=[Image.open(io.BytesIO(source))], prompt="make the cat red", latents=noise, num_inference_steps=2,
            height=HEIGHT, width=WIDTH, num_images_per_prompt=2, output_type="pt").images
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)


def _tensor(png: bytes) -> torch.Tensor:
    return torch.from_numpy(np.array(Image.open(io.BytesIO(png)).convert("RGB"))).permute(2, 0, 1)


def test_families_that_size_their_sources_otherwise_refuse_it_by_name(tiny_family, tmp_path):
    with pytest.raises(ModelLoadError, match="^--condition-image-size: the demo model takes condition images at its "):
        tiny_family.set_condition_image_area(256)
    i2v = load_model(save_wan(tmp_path / "wan-i2v-tiny", image_to_video=True), condition_image_size=None)
    with pytest.raises(ModelLoadError, match="^--condition-image-size: .* sizes its first frame to the output"):
        i2v.set_condition_image_area(256)
    t2v = load_model(save_wan(tmp_path / "wan-t2v-tiny"), condition_image_size=None)
    with pytest.raises(ModelLoadError, match="^--condition-image-size: .* takes no condition images$"):
        t2v.set_condition_image_area(256)


def test_an_engine_spec_and_a_server_carry_it(kontext_dir):
    spec = serve_spec(ServeConfig(model_path=kontext_dir, condition_image_size=64, device="cpu",
                                  offload_text_encoder=True))
    assert EngineSpec.from_json(spec.to_json()).condition_image_size == 64  # to engine processes
    served = load_family(spec)
    assert served.condition_image_area == 64 * 64 and served.offload_text_encoders  # and the encoders' place
    assert load_family(EngineSpec(model_path=str(kontext_dir))).condition_image_area is None


def test_a_run_trains_with_it_and_its_checkpoint_samples_with_it(kontext_dir, tmp_path):
    from test_flux1_kontext import _train

    prompts = write_conditioned_prompt_set(tmp_path / "data", "edits", ("make the cat red", "remove the dog"),
                                           random_png(0, SOURCE_SIZE), random_png(1, SOURCE_SIZE))
    run = tmp_path / "run"
    seen = []

    def reward(images, prompts, metadata):
        seen.extend(tuple(m["condition_images"][0].shape) for m in metadata)
        return [float(image.mean()) for image in images]

    records, _ = _train(kontext_dir, prompts, run, "flow_grpo", num_rollout=1, reward_fn=reward,
                        condition_image_size=64)
    assert [r for r in records if "train/loss" in r][0]["train/log_prob_mean_abs_diff"] < 1e-4
    assert set(seen) == {(3, *SOURCE_SIZE)}  # the reward judges against the source as given
    assert json.loads((run / "config.json").read_text())["flags"]["condition_image_size"] == 64
    checkpoint = run / "checkpoints" / "rollout-00001"
    assert load_model(kontext_dir, checkpoint).condition_image_area == 64 * 64  # the run's
    assert load_model(kontext_dir, checkpoint, condition_image_size=80).condition_image_area == 80 * 80
    assert load_model(kontext_dir, checkpoint, condition_image_size=None).condition_image_area is None


def test_a_size_below_flux3s_smallest_canvas_is_refused_by_name(kontext_dir, tmp_path, capsys):
    assert cli_main(["train", "--model-path", str(kontext_dir), "--condition-image-size", "48", "--output-dir",
                     str(tmp_path / "r"), "--device", "cpu"]) == 2
    assert "--condition-image-size must be at least 64 pixels, got 48" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_the_held_out_evaluation_sizes_its_sources_apart_from_the_rollouts(kontext_dir, tmp_path, monkeypatch):
    """--eval-condition-image-size: the run's evaluation encodes its sources at that size, its rollouts at
    --condition-image-size, and the family keeps the rollouts' size after evaluating. --eval-batch-size 1 denoises
    the held-out samples one at a time (Qwen-Image-Edit's recipe, for 1024² outputs from 1024² references)."""
    from diffrl.evaluation import sampling
    from test_flux1_kontext import HEIGHT as H, WIDTH as W

    from diffrl.train.config import TrainConfig
    from diffrl.train.trainer import Trainer

    prompts = write_conditioned_prompt_set(tmp_path / "data", "edits", ("make the cat red", "remove the dog"),
                                           random_png(0, SOURCE_SIZE), random_png(1, SOURCE_SIZE))
    cfg = TrainConfig.flat(
        output_dir=tmp_path / "run", model_path=kontext_dir, prompt_data=prompts, eval_prompt_data=prompts,
        loss_type="nft", num_rollout=1, rollout_batch_size=2, n_samples_per_prompt=2, rollout_microgroup_size=2,
        global_batch_size=4, num_steps_per_rollout=1, micro_batch_size=4, diffusion_num_steps=2, height=H, width=W,
        diffusion_guidance_scale=1.0, device="cpu", lora_rank=2, reward="jpeg_compressibility", eval_interval=1,
        eval_num_prompts=2, eval_images_per_category=0, condition_image_size=64, eval_condition_image_size=80,
        eval_batch_size=1)
    batches, build_engine = [], sampling.build_engine
    monkeypatch.setattr(sampling, "build_engine", lambda spec, **kw: (batches.append(spec.max_batch_outputs),
                                                                      build_engine(spec, **kw))[1])
    trainer = Trainer(cfg)
    family, areas = trainer.engine.family, []
    encode = family.encode_condition_images

    def spy(images):
        areas.append(family.condition_image_area)
        return encode(images)

    family.encode_condition_images = spy
    trainer.train()
    assert areas[0] == 80 * 80 and 64 * 64 in areas and areas[-1] == 80 * 80  # evaluations first and last
    assert family.condition_image_area == 64 * 64
    assert batches == [1] * 4  # two evaluations of two held-out samples, one at a time


def test_an_evaluation_size_on_a_family_without_condition_images_is_refused_at_start(tiny_model_dir, tmp_path,
                                                                                     capsys):
    assert cli_main(["train", "--model-path", str(tiny_model_dir), "--eval-condition-image-size", "128",
                     "--output-dir", str(tmp_path / "r"), "--device", "cpu", "--num-rollout", "1"]) == 2
    assert "--condition-image-size: the demo model takes condition images at its own size" in capsys.readouterr().err


def test_diffrl_eval_samples_an_editing_set_at_the_size_it_is_given(kontext_dir, tmp_path):
    """`diffrl eval --prompt-data … --condition-image-size N` judges the model on sources sized to N²: its images are
    those of the same set with its sources downscaled beforehand, not those of the full sources."""
    from test_flux1_kontext import HEIGHT as H, WIDTH as W

    sources = [random_png(0, SOURCE_SIZE), random_png(1, SOURCE_SIZE)]
    full = write_conditioned_prompt_set(tmp_path / "full", "edits", ("make the cat red", "remove the dog"), *sources)
    small = write_conditioned_prompt_set(tmp_path / "small", "edits", ("make the cat red", "remove the dog"),
                                         *(downscaled_png(s, 64 * 64) for s in sources))

    def images(prompts, *flags) -> torch.Tensor:
        out = tmp_path / f"eval-{len(list(tmp_path.iterdir()))}"
        assert cli_main(["evaluate", "--model-path", str(kontext_dir), "--prompt-data", str(prompts), "--reward",
                         "jpeg_compressibility", "--num-steps", "2", "--height", str(H), "--width", str(W),
                         "--guidance-scale", "1", "--device", "cpu", "--output-dir", str(out), *flags]) == 0
        files = sorted((out / "images").glob("*.png"))
        assert len(files) == 2
        return torch.stack([torch.from_numpy(np.array(Image.open(f))).float() for f in files])

    capped = images(full, "--condition-image-size", "64")
    same, other = (capped - images(small)).abs(), (capped - images(full)).abs()
    # 8-bit PNGs of one tiny model's 2-step samples: the source moves a third of the values by 1-2 (measured: 33%),
    # the same samples none (at most a rounding step on a few)
    assert same.max() <= 1 and (same > 0).float().mean() < 0.01
    assert (other > 0).float().mean() > 0.1


def test_a_runs_held_out_protocol_is_its_evaluation_size_and_sources():
    """What `diffrl eval RUN` and `diffrl compare RUN` repeat: the run's held-out size, frames and source size where
    it set them apart from its rollouts', else the rollouts'."""
    from pathlib import Path

    from diffrl.cli.runs import Run, held_out_protocol

    own = held_out_protocol(Run(Path("r"), None, {"resolution": 384, "condition_image_size": 384, "num_frames": 5}))
    assert (own["resolution"], own["condition_image_size"], own["num_frames"]) == (384, 384, 5)
    apart = held_out_protocol(Run(Path("r"), None, {
        "resolution": 384, "eval_resolution": 1024, "condition_image_size": 384, "eval_condition_image_size": 1024,
        "num_frames": 5, "eval_num_frames": 21}))
    assert (apart["resolution"], apart["condition_image_size"], apart["num_frames"]) == (1024, 1024, 21)
    wide = held_out_protocol(Run(Path("r"), None, {"resolution": 384, "eval_height": 512, "eval_width": 768}))
    assert (wide["resolution"], wide["height"], wide["width"]) == (None, 512, 768)


def test_compare_judges_base_and_trained_on_one_source_size(kontext_dir, tmp_path, monkeypatch):
    """`diffrl compare RUN --prompt-data …`: both columns load with the run's held-out source size (not the base at
    the pipeline's and the trained model at its run's), or with --condition-image-size when given."""
    from test_flux1_kontext import _train

    from diffrl.cli import compare as compare_module

    prompts = write_conditioned_prompt_set(tmp_path / "data", "edits", ("make the cat red", "remove the dog"),
                                           random_png(0, SOURCE_SIZE), random_png(1, SOURCE_SIZE))
    run = tmp_path / "run"
    _train(kontext_dir, prompts, run, "nft", num_rollout=1, condition_image_size=64, eval_condition_image_size=80,
           reward_fn=lambda images, prompts, metadata: [float(image.mean()) for image in images])
    loads, load = [], compare_module.load_model
    monkeypatch.setattr(compare_module, "load_model",
                        lambda *a, **kw: (loads.append(kw.get("condition_image_size", "run")), load(*a, **kw))[1])
    common = ["compare", str(run), "--prompt-data", str(prompts), "--reward", "jpeg_compressibility",
              "--num-steps", "1", "--guidance-scale", "2", "--device", "cpu"]
    assert cli_main([*common, "--output-dir", str(tmp_path / "c1")]) == 0
    assert loads == [80, 80]  # the run's held-out size for both columns
    loads.clear()
    assert cli_main([*common, "--condition-image-size", "96", "--output-dir", str(tmp_path / "c2")]) == 0
    assert loads == [96, 96]
