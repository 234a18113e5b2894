"""FLUX.1 Kontext (the flux1 family's image-conditioned mode) against diffusers' FluxKontextPipeline, and condition
images through the whole path: prompt files, the engine, training, replay and the reward, on a tiny random
checkpoint built in code."""

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.data.condition_images import CONDITION_IMAGES_KEY
from diffrl.data.prompts import load_prompts
from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.errors import RequestError
from diffrl.models.flux1 import Flux1Family
from diffrl.models.random_checkpoints.flux1 import save_random_checkpoint
from diffrl.sampling import make_generators
from family_checks import random_png, write_conditioned_prompt_set

TOLERANCE = 1e-5  # fp32 on CPU through two code paths (measured: ≤ 8.1e-7)
HEIGHT, WIDTH = 32, 48


@pytest.fixture(scope="module")
def kontext_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "flux1-kontext-tiny", kontext=True)


@pytest.fixture(scope="module")
def kontext(kontext_dir) -> Flux1Family:
    return Flux1Family.load(kontext_dir)


def png(seed: int, size=(30, 42)) -> bytes:
    """A random RGB picture as PNG bytes (30×42 is not a multiple of the tiny model's 4 pixels: it is resized)."""
    return random_png(seed, size)


def _request(**fields) -> RolloutRequest:
    return RolloutRequest(**{"prompt": "make the cat red", "seed": 3, "num_outputs_per_prompt": 2,
                             "num_inference_steps": 2, "height": HEIGHT, "width": WIDTH, **fields})


@pytest.mark.parametrize(("negative", "cfg"), [("", 1.0), ("blurry", 3.0)], ids=["guidance-embed", "true-cfg"])
def test_engine_reproduces_flux_kontext_pipeline(kontext, negative, cfg):
    """ODE sampling through our engine gives FluxKontextPipeline's images from the same noise and source image:
    its embedded guidance alone, and with true CFG on top (the negative pass sees the source image too)."""
    source = png(0)
    engine = Engine(kontext, EngineConfig(max_outputs_per_request=4))
    outputs = engine.generate(_request(negative_prompt=negative, guidance_scale=cfg, image_path=[source]))
    ours = torch.stack([o.generated_output for o in outputs])
    noise = kontext.prepare_latents(make_generators([3, 4]), HEIGHT, WIDTH).tokens

    def pipeline(image):
        return kontext.reference_pipeline()(
            image=image, prompt="make the cat red", negative_prompt=negative if cfg > 1 else None, true_cfg_scale=cfg,
            latents=noise, num_inference_steps=2, height=HEIGHT, width=WIDTH, max_area=HEIGHT * WIDTH,
            num_images_per_prompt=2, output_type="pt", **kontext.reference_pipeline_kwargs()).images

    reference = pipeline(Image.open(io.BytesIO(source)))
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    other = pipeline(Image.open(io.BytesIO(png(1))))
    assert (other - reference).abs().max() > 30 * TOLERANCE  # the source matters (7e-4 here): the check can fail
    assert engine.image_encodes == 1  # once per request, shared by its outputs (and by CFG's negative half)


def test_condition_image_packs_into_the_conditioning_and_back(kontext):
    """The packed source travels inside the one conditioning tensor (its ids first channel 1) and on sglang's wire."""
    source = torch.from_numpy(np.array(Image.open(io.BytesIO(png(0))))).permute(2, 0, 1)
    cond = kontext.condition_on_images(kontext.encode_prompts(["make the cat red"]),
                                       kontext.encode_condition_images([source]))
    text, pooled, image, ids = kontext.unpack_conditioning(cond)
    assert text.shape[1] == kontext.settings.max_sequence_length and image.shape == (1, 7 * 10, 16)
    assert ids[:, 0].eq(1).all() and ids[-1].tolist() == [1.0, 6.0, 9.0]
    wire = kontext.cond_kwargs_to_wire(cond, torch.zeros(4, 3))
    back, _ = Flux1Family.cond_kwargs_from_wire(wire)
    assert torch.equal(back.embeds, cond.embeds) and torch.equal(back.ids, cond.ids)


def test_condition_images_are_refused_by_name(kontext, tmp_path):
    engine = Engine(kontext, EngineConfig(image_roots=(tmp_path / "allowed",)))
    (tmp_path / "allowed").mkdir()
    (tmp_path / "elsewhere.png").write_bytes(png(0))
    cases = {
        "is not under a directory this engine reads images from": [str(tmp_path / "elsewhere.png")],
        "not a decodable image": [b"not a picture"],
        "takes at most 1": [png(0), png(1)],
        "must be an absolute path": ["relative.png"],
        "payload is not base64": ["data:image/png;base64,@@@"],
    }
    for message, entries in cases.items():
        with pytest.raises(RequestError, match=message) as err:
            engine.generate(_request(image_path=entries))
        assert err.value.field == "image_path"
    with pytest.raises(RequestError, match="send the condition images as image_path"):
        engine.generate(_request(image="data:image/png;base64,AAAA"))
    with pytest.raises(RequestError, match="reads no images from its disk"):  # the default: no roots
        Engine(kontext).generate(_request(image_path=[str(tmp_path / "elsewhere.png")]))


def test_condition_images_are_decoded_off_the_event_loop(kontext, monkeypatch):
    """A served engine's event loop keeps answering while a request's source decodes (here made slow on purpose)."""
    import asyncio
    import time

    from diffrl.engine import engine as engine_module

    def slow(*args):
        time.sleep(1.5)  # far above the bound below: a loop blocked by it shows, a busy 2-core machine's jitter not
        return decode(*args)

    decode = engine_module.request_images
    monkeypatch.setattr(engine_module, "request_images", slow)
    engine = Engine(kontext, EngineConfig(max_outputs_per_request=4))

    async def ticks_during_a_request():
        gaps, last = [], time.monotonic()
        work = asyncio.ensure_future(engine.agenerate(_request(image_path=[png(0)])))
        while not work.done():
            await asyncio.sleep(0.01)
            gaps.append(time.monotonic() - last)
            last = time.monotonic()
        return await work, gaps

    outputs, gaps = asyncio.run(ticks_during_a_request())
    assert len(outputs) == 2 and max(gaps) < 1.0


def write_editing_set(folder: Path) -> Path:
    """A tiny editing prompt set: a .jsonl beside its PNGs (one under images/, Flow-Factory's layout)."""
    return write_conditioned_prompt_set(folder, "edits", ("make the cat red", "remove the dog"), png(0, (32, 48)),
                                        png(1, (32, 48)))


def test_prompt_rows_carry_condition_images_and_bad_ones_are_one_line_errors(tmp_path):
    path = write_editing_set(tmp_path)
    records = load_prompts(path)
    assert [r.images[0].path.name for r in records] == ["a.png", "b.png"] and records[0].metadata == {}
    assert records[1].images[0].read() == (tmp_path / "images" / "b.png").read_bytes()
    path.write_text('{"prompt": "x", "image": "a.png"}\n{"prompt": "y", "image": "gone.png"}\n')
    with pytest.raises(ValueError, match=rf"^prompt data {path}:2: condition image 'gone.png': no such file") as err:
        load_prompts(path)
    assert "\n" not in str(err.value)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    path.write_text('{"prompt": "x", "images": ["a.png", "broken.png"]}\n')
    with pytest.raises(ValueError, match=rf"^prompt data {path}:1: condition image 'broken.png' \(.*\): not a "
                                         "decodable image"):
        load_prompts(path)


SEEN = []


def closeness_to_source(images, prompts, metadata):
    """An editing reward: how close each output is to its prompt's source (the metadata's condition images)."""
    sources = [m[CONDITION_IMAGES_KEY][0] for m in metadata]
    SEEN.extend(s.shape for s in sources)
    return [1.0 - float((image - source).abs().mean()) for image, source in zip(images, sources, strict=True)]


def _train(model_dir, prompts, out, loss_type, num_rollout=2, reward_fn=None, **flags):
    from diffrl.train.config import TrainConfig
    from diffrl.train.trainer import Trainer

    cfg = TrainConfig.flat(
        output_dir=out, model_path=model_dir, prompt_data=prompts, loss_type=loss_type, num_rollout=num_rollout,
        rollout_batch_size=2, n_samples_per_prompt=2, rollout_microgroup_size=2, global_batch_size=4,
        num_steps_per_rollout=1, micro_batch_size=4, diffusion_num_steps=2, height=HEIGHT, width=WIDTH,
        diffusion_guidance_scale=2.0 if loss_type == "flow_grpo" else 1.0, lr=1e-3, device="cpu", use_lora=True,
        lora_rank=2, reward="jpeg_compressibility", eval_images_per_category=0, checkpoint_interval=10,
        **({"diffusion_sde_window_range": (0, 2)} if loss_type == "flow_grpo" else {}), **flags)
    trainer = Trainer(cfg, reward_fn=reward_fn or closeness_to_source)
    trainer.train()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records, [p.detach().clone() for p in trainer.policy.params]


def test_reward_worker_batches_carry_the_condition_images():
    """What `--reward-workers` sends a worker process: the condition images as tensors, bit for bit, beside the
    metadata's JSON (a group's samples share their source)."""
    from diffrl.rewards.workers import decode_batch, encode_batch

    source, images = torch.rand(3, 5, 6), torch.rand(3, 3, 8, 8)
    metadata = [{"seed": 1, CONDITION_IMAGES_KEY: [source]}, {"seed": 2, CONDITION_IMAGES_KEY: [source]}, {"seed": 3}]
    got, prompts, meta = decode_batch(*encode_batch(images, ["a", "b", "c"], metadata))
    assert torch.equal(got, images) and prompts == ["a", "b", "c"] and meta[2] == {"seed": 3}
    assert all(torch.equal(m[CONDITION_IMAGES_KEY][0], source) and m["seed"] == k + 1 for k, m in enumerate(meta[:2]))


@pytest.mark.parametrize("loss_type", ["flow_grpo", "nft"])
def test_training_on_an_editing_prompt_set(kontext_dir, tmp_path, loss_type):
    """Two rollouts of Flow-GRPO (true CFG with the source in both halves) and of DiffusionNFT on edits; the reward
    sees each prompt's source image, and the trainer replays the engine's steps from the packed conditioning."""
    SEEN.clear()
    records, _ = _train(kontext_dir, write_editing_set(tmp_path), tmp_path / "run", loss_type)
    trained = [r for r in records if "train/loss" in r]
    assert len(trained) == 2 and all(np.isfinite(r["train/loss"]) for r in trained)
    if loss_type == "flow_grpo":
        assert trained[-1]["train/log_prob_mean_abs_diff"] < 1e-4
    assert SEEN and all(shape == (3, 32, 48) for shape in SEEN)


def test_sources_of_different_sizes_in_one_rollout_are_refused_naming_the_cause(kontext_dir, tmp_path):
    prompts = write_editing_set(tmp_path / "data")
    (tmp_path / "data" / "images" / "b.png").write_bytes(png(1, (40, 48)))  # 40x48 against a.png's 32x48

    def constant(images, prompts, metadata):
        return [0.0] * len(images)

    with pytest.raises(ValueError, match="sources of different sizes give different lengths.*give every condition "
                                         "image of the prompt set the same width and height"):
        _train(kontext_dir, prompts, tmp_path / "run", "flow_grpo", num_rollout=1, reward_fn=constant)


def test_replay_of_an_editing_rollout_equals_the_live_run(kontext_dir, tmp_path):
    prompts = write_editing_set(tmp_path / "data")
    live, live_state = _train(kontext_dir, prompts, tmp_path / "live", "flow_grpo", num_rollout=1,
                              save_rollout_data=tmp_path / "records")
    replayed, state = _train(kontext_dir, prompts, tmp_path / "replay", "flow_grpo", num_rollout=1,
                             load_rollout_data=tmp_path / "records")
    assert all(torch.equal(a, b) for a, b in zip(state, live_state, strict=True))
    keys = ("train/loss", "train/grad_norm", "rollout/reward/raw_mean")
    assert [[r.get(k) for k in keys] for r in live] == [[r.get(k) for k in keys] for r in replayed]
    (tmp_path / "data" / "images" / "b.png").write_bytes(png(5, (32, 48)))  # another source: refused
    with pytest.raises(ValueError, match="other condition images"):
        _train(kontext_dir, prompts, tmp_path / "again", "flow_grpo", num_rollout=1,
               load_rollout_data=tmp_path / "records")


def test_condition_images_survive_the_http_wire_bit_for_bit(kontext_dir, tmp_path):
    """On an engine built as `diffrl serve --image-roots DIR` builds it: bytes (a data: URL in a JSON request, raw in
    a msgpack one: HttpEngineClient sends the first, then the second once the server has answered in msgpack) and
    sglang's `image_path` naming a file under the root give the in-process outputs and conditioning, to the bit; a
    path outside the root is an HTTP 400 naming the field."""
    import asyncio

    import httpx

    from diffrl.rollout.clients import HttpEngineClient, request_fields
    from diffrl.serving import sglang
    from diffrl.serving.wire import MEDIA_TYPE, decode_outputs, decode_request, encode_request
    from diffrl.cli.main import parse
    from diffrl.serving.server import build_engine, create_app, serving_in_thread

    (tmp_path / "roots").mkdir()
    source = tmp_path / "roots" / "source.png"
    source.write_bytes(png(2))
    (tmp_path / "outside.png").write_bytes(png(2))
    cfg = parse(["serve", "--model-path", str(kontext_dir), "--device", "cpu", "--max-outputs-per-request", "4",
                 "--image-roots", str(tmp_path / "roots")])
    engine = build_engine(cfg)
    fields = {"negative_prompt": "blurry", "guidance_scale": 2.0, "rollout": True,
              "rollout_return_denoising_env": True, "rollout_return_dit_trajectory": True}
    request = _request(image_path=[source.read_bytes()], **fields)
    local = engine.generate(request)

    def same(outputs):
        assert all(torch.equal(a.generated_output, b.generated_output) for a, b in zip(outputs, local, strict=True))
        env, want = outputs[0].denoising_env, local[0].denoising_env
        assert all(torch.equal(env[k], want[k]) for k in ("prompt_embeds", "text_ids", "negative_prompt_embeds"))

    with serving_in_thread(create_app(engine)) as url:
        client = HttpEngineClient(url)

        async def twice():
            first = await client.generate(request)
            assert client._sends_compact  # negotiated: the next request goes as msgpack
            return first, await client.generate(request)
        try:
            for outputs in asyncio.run(twice()):
                same(outputs)
        finally:
            client.close()
        compact = encode_request(request_fields(request, image_bytes=True))
        assert RolloutRequest.model_validate(decode_request(compact)).image_path == request.image_path
        answer = httpx.post(f"{url}/rollout/generate", content=compact, timeout=60,
                            headers={"content-type": MEDIA_TYPE, "accept": MEDIA_TYPE})
        same(decode_outputs(answer.content))
        by_path = _request(image_path=[str(source)], **fields)
        answer = httpx.post(f"{url}/rollout/generate", json=by_path.model_dump(exclude_none=True), timeout=60)
        same(sglang.decode_response(answer.content, by_path, engine.family))
        refused = httpx.post(f"{url}/rollout/generate", timeout=60,
                             json=_request(image_path=[str(tmp_path / "outside.png")]).model_dump(exclude_none=True))
        assert refused.status_code == 400 and "image_path" in refused.text and "image roots" in refused.text


def test_kontext_recipe_is_flow_factorys_setting(kontext_dir, tmp_path):
    from diffrl.cli.main import parse
    from diffrl.train.trainer import validate_config

    prompts = write_editing_set(tmp_path)
    cfg = parse(["train", "--recipe", "flux1-kontext-grpo-pickscore", "--model-path", str(kontext_dir),
                 "--prompt-data", str(prompts)])
    m, r, o = cfg.model, cfg.rollout, cfg.optim
    assert (m.diffusion_model_family, cfg.algorithm.loss_type, m.size()) == ("flux1", "flow_grpo", (384, 384))
    assert (r.diffusion_num_steps, r.diffusion_noise_level, r.diffusion_sde_window_range) == (10, 0.9, (1, 4))
    assert (r.rollout_batch_size, r.n_samples_per_prompt, o.num_steps_per_rollout, o.lr) == (48, 16, 2, 3e-4)
    assert (m.condition_image_size, cfg.eval.eval_condition_image_size) == (384, 512)
    validate_config(cfg)


def test_held_out_evaluation_samples_from_each_prompts_source(kontext, tmp_path):
    """Evaluation sends each record's source (two records with the same instruction stay apart) and the reward sees
    it; the same record's sample equals an engine request with that source."""
    from diffrl.evaluation.reward_eval import evaluate_with_reward

    path = write_editing_set(tmp_path)
    path.write_text('{"prompt": "make the cat red", "image": "a.png"}\n'
                    '{"prompt": "make the cat red", "image": "images/b.png"}\n')
    SEEN.clear()
    result = evaluate_with_reward(kontext, load_prompts(path), closeness_to_source, seeds_per_prompt=1, seed=7,
                                  num_steps=2, guidance_scale=1.0, height=HEIGHT, width=WIDTH)
    assert len(SEEN) == 2 and not torch.equal(result.images[0], result.images[1])
    alone = Engine(kontext).generate(_request(seed=result.rows[1]["seed"], num_outputs_per_prompt=1,
                                              generator_device="cpu",
                                              image_path=[(tmp_path / "images" / "b.png").read_bytes()]))
    torch.testing.assert_close(result.images[1], alone[0].generated_output, rtol=0, atol=1e-6)


def test_compare_sends_each_records_source_and_its_grids_show_source_then_outputs(kontext_dir, tmp_path):
    """`diffrl compare --prompt-data` on an editing set: every column's samples see their record's source (as the
    reward does), and the side-by-side grid and each column's evaluation grid start a row with the source."""
    from diffrl.cli.compare import compare
    from diffrl.cli.main import parse

    path = write_editing_set(tmp_path)
    SEEN.clear()
    out = tmp_path / "compare"
    compare(parse(["compare", "--base", str(kontext_dir), "--trained", str(kontext_dir), "--prompt-data", str(path),
                   "--reward", "test_flux1_kontext:closeness_to_source", "--num-steps", "2", "--height", str(HEIGHT),
                   "--width", str(WIDTH), "--guidance-scale", "2", "--device", "cpu", "--output-dir", str(out)]))
    assert len(SEEN) == 3 * 2  # three columns, two records, each with its source
    source = np.asarray(Image.open(tmp_path / "a.png").convert("RGB"))
    first_cell = source.repeat(2, axis=0).repeat(2, axis=1)  # save_grid: 2x nearest, 2 px of padding

    def cells(grid_path):
        grid = np.asarray(Image.open(grid_path).convert("RGB"))
        return grid, grid[2 : 2 + 2 * HEIGHT, 2 : 2 + 2 * WIDTH]

    grid, cell = cells(out / "side_by_side.png")
    assert np.array_equal(cell, first_cell) and grid.shape[1] == 2 + 4 * (2 * WIDTH + 2)  # source + 3 columns
    grid, cell = cells(out / "trained" / "grid.png")
    assert np.array_equal(cell, first_cell) and grid.shape[1] == 2 + 8 * (2 * WIDTH + 2)  # source, output, ...
