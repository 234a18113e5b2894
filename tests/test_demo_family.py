"""The demo family: save/load in diffrl's diffusers layout, load errors, CFG, packing, registry."""

import json

import pytest
import torch

from diffrl.models import ModelLoadError, get_family, resolve_family
from diffrl.models.demo import DemoFamily, patchify, unpatchify
from diffrl.sampling import make_generators


def _velocity_inputs(family, batch=3):
    gens = make_generators(range(batch))
    latents = family.prepare_latents(gens, 64, 64)
    cond = family.encode_prompts(["a red circle", "two squares", "a blue square above a red circle"][:batch])
    uncond = family.encode_prompts([""]).repeat(batch)
    return latents, cond, uncond


def test_save_load_roundtrip_gives_identical_velocity(tiny_family, tiny_model_dir):
    loaded = DemoFamily.load(tiny_model_dir)
    latents, cond, uncond = _velocity_inputs(tiny_family)
    sigma = torch.tensor([1.0, 0.5, 0.1])
    with torch.no_grad():
        expected = tiny_family.velocity(tiny_family.transformer, latents, sigma, cond, uncond, 3.0)
        got = loaded.velocity(loaded.transformer, latents, sigma, loaded.encode_prompts(
            ["a red circle", "two squares", "a blue square above a red circle"]), loaded.encode_prompts([""]).repeat(3), 3.0)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_shared_timestep_skips_the_host_sync_and_changes_nothing(tiny_family, monkeypatch):
    """A step's σ expanded over the batch (how the denoising loop passes it) runs the timestep MLP once,
    without torch.unique (a device-to-host sync); the velocity is bit for bit the one a per-row σ gives."""
    latents, cond, uncond = _velocity_inputs(tiny_family)
    per_row = torch.full((3,), 0.7)  # one value, but a real per-row tensor: the general path
    with torch.no_grad():
        expected = {g: tiny_family.velocity(tiny_family.transformer, latents, per_row, cond, uncond, g) for g in (1.0, 3.0)}

        def no_unique(*args, **kwargs):
            raise AssertionError("torch.unique called for a shared timestep")

        monkeypatch.setattr(torch, "unique", no_unique)
        for sigma in (torch.tensor(0.7).expand(3), torch.tensor(0.7), 0.7):
            for g in (1.0, 3.0):
                got = tiny_family.velocity(tiny_family.transformer, latents, sigma, cond, uncond, g)
                assert torch.equal(got, expected[g])
        with pytest.raises(AssertionError, match="torch.unique"):  # distinct rows still take the general path
            tiny_family.velocity(tiny_family.transformer, latents, torch.tensor([1.0, 0.5, 0.1]), cond, None, 1.0)


@pytest.mark.parametrize("relpath", [
    "model_index.json", "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors",
    "text_encoder/model.safetensors", "tokenizer/tokenizer.json",
])
def test_missing_or_corrupt_file_is_named_in_one_line(tiny_model_dir, relpath):
    target = tiny_model_dir / relpath
    target.write_bytes(b"\x00garbage{")
    with pytest.raises(ModelLoadError) as corrupt:
        DemoFamily.load(tiny_model_dir)
    assert str(target) in str(corrupt.value) and "\n" not in str(corrupt.value)
    target.unlink()
    with pytest.raises(ModelLoadError, match="missing file") as missing:
        DemoFamily.load(tiny_model_dir)
    assert str(target) in str(missing.value)


def test_weights_that_do_not_fit_the_config_are_refused(tiny_model_dir):
    config_path = tiny_model_dir / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["num_single_layers"] += 1
    config_path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="do not fit the config"):
        DemoFamily.load(tiny_model_dir)


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        DemoFamily.load(tmp_path / "nope")


def test_cfg_off_runs_one_conditional_forward(tiny_family):
    latents, cond, uncond = _velocity_inputs(tiny_family)
    sigma = torch.full((3,), 0.7)
    batches = []
    handle = tiny_family.transformer.register_forward_pre_hook(
        lambda m, args, kwargs: batches.append(kwargs["hidden_states"].shape[0]), with_kwargs=True)
    with torch.no_grad():
        v_off = tiny_family.velocity(tiny_family.transformer, latents, sigma, cond, None, 1.0)
        v_on = tiny_family.velocity(tiny_family.transformer, latents, sigma, cond, uncond, 4.0)
    handle.remove()
    assert batches == [3, 6]  # CFG off: one forward of B; CFG on: uncond and cond batched in one forward
    with torch.no_grad():
        v_uncond = tiny_family.velocity(tiny_family.transformer, latents, sigma, uncond, None, 1.0)
    torch.testing.assert_close(v_on, v_uncond + 4.0 * (v_off - v_uncond), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unconditional"):
        tiny_family.velocity(tiny_family.transformer, latents, sigma, cond, None, 4.0)


def test_packing_roundtrips(tiny_family):
    images = torch.rand(2, 3, 64, 64)
    tokens = patchify(images, 4)
    assert tokens.shape == (2, 256, 48)
    assert torch.equal(unpatchify(tokens, 64, 64, 4), images)
    torch.testing.assert_close(tiny_family.decode(tiny_family.encode_images(images), 64, 64), images)
    # Token (h, w) holds exactly the pixels of patch (h, w).
    assert torch.equal(tokens[0, 1 * 16 + 2].reshape(3, 4, 4), images[0, :, 4:8, 8:12])


def test_unsupported_size_names_the_field(tiny_family):
    with pytest.raises(ValueError, match="height=32"):
        tiny_family.prepare_latents(make_generators([0]), 32, 64)
    with pytest.raises(ValueError, match="width=80"):
        tiny_family.check_size(64, 80)


def test_unknown_words_map_to_unk_and_padding_is_zeroed(tiny_family):
    ids, mask = tiny_family.tokenize(["a red zebra"])
    assert ids[0, 2].item() == tiny_family.tokenizer.unk_token_id
    assert mask[0].sum().item() == 4  # three words and </s>
    embeds = tiny_family.encode_prompts(["a red zebra"]).embeds
    assert embeds[0, 4:].abs().sum() == 0 and embeds[0, :4].abs().sum() > 0


def test_registry_resolution_order(tmp_path, monkeypatch):
    monkeypatch.delenv("DIFFRL_MODEL_FAMILY", raising=False)
    assert resolve_family(None, tmp_path / "my-demo-model") is get_family("demo")
    assert resolve_family("demo", tmp_path / "unrelated") is get_family("demo")
    with pytest.raises(ModelLoadError, match="model directory not found: .*unrelated"):  # a typo: said so first
        resolve_family(None, tmp_path / "unrelated")
    (tmp_path / "unrelated").mkdir()
    with pytest.raises(ValueError, match="cannot tell the model family"):
        resolve_family(None, tmp_path / "unrelated")
    monkeypatch.setenv("DIFFRL_MODEL_FAMILY", "demo")
    assert resolve_family(None, tmp_path / "unrelated") is get_family("demo")
    monkeypatch.setenv("DIFFRL_MODEL_FAMILY", "nonesuch")
    with pytest.raises(ValueError, match="unknown model family 'nonesuch'"):
        resolve_family(None, tmp_path / "my-demo-model")
    # The explicit flag wins over the environment.
    assert resolve_family("demo", tmp_path / "x") is get_family("demo")


def test_a_checkpoint_whose_name_says_nothing_is_found_by_its_transformer_class(tmp_path, monkeypatch):
    """Last, after the name patterns: `transformer/config.json`'s `_class_name`, else the `transformer` entry of
    `model_index.json`. A class two families load (demo and flux3_image) is not guessed."""
    import json

    monkeypatch.delenv("DIFFRL_MODEL_FAMILY", raising=False)

    def checkpoint(name, config=None, index=None):
        root = tmp_path / name
        (root / "transformer").mkdir(parents=True)
        if config:
            (root / "transformer" / "config.json").write_text(json.dumps({"_class_name": config}))
        if index:
            (root / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline",
                                                               "transformer": ["diffusers", index]}))
        return root

    qwen = checkpoint("qwen-tiny", config="QwenImageTransformer2DModel")
    assert resolve_family(None, qwen) is get_family("qwen_image")
    assert resolve_family(None, checkpoint("my-ckpt", index="QwenImageTransformer2DModel")) is get_family("qwen_image")
    assert resolve_family(None, checkpoint("sd", config="SD3Transformer2DModel",
                                           index="QwenImageTransformer2DModel")) is get_family("sd3")
    # The flag, the environment and the name patterns still come first.
    assert resolve_family("demo", qwen) is get_family("demo")
    assert resolve_family(None, checkpoint("a-demo", config="QwenImageTransformer2DModel")) is get_family("demo")
    monkeypatch.setenv("DIFFRL_MODEL_FAMILY", "sd3")
    assert resolve_family(None, qwen) is get_family("sd3")
    monkeypatch.delenv("DIFFRL_MODEL_FAMILY")
    with pytest.raises(ValueError, match=r"holds Flux3Transformer2DModel, which several families load "
                                         r"\(demo, flux3_image\); pass --diffusion-model-family$"):
        resolve_family(None, checkpoint("klein", config="Flux3Transformer2DModel"))
    for name, config in (("unknown", "SomeOtherTransformer"), ("bare", None)):
        with pytest.raises(ValueError, match="cannot tell the model family"):
            resolve_family(None, checkpoint(name, config=config))
    odd = checkpoint("odd")  # a model index whose transformer entry is not [library, class]
    (odd / "model_index.json").write_text(json.dumps({"transformer": "QwenImageTransformer2DModel"}))
    with pytest.raises(ValueError, match="cannot tell the model family"):
        resolve_family(None, odd)


def test_cfg_compares_position_ids_once_per_pair_of_conditionings(tiny_family, monkeypatch):
    """Comparing position ids waits for the device on a GPU; a denoising loop passes the same pair every step."""
    cond, uncond = tiny_family.encode_prompts(["a red circle"]), tiny_family.encode_prompts([""])
    compared = []
    equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: compared.append(1) or equal(a, b))
    for _ in range(5):
        assert tiny_family.pair_conditionings(uncond, cond) is not None
    assert len(compared) == 1
    other = tiny_family.encode_prompts(["a blue square"])  # a new pair is compared again
    assert tiny_family.pair_conditionings(uncond, other) is not None and len(compared) == 2


def test_true_cfg_scale_switches_cfg_as_sglang_does(tiny_family):
    """sglang-diffusion accepts `true_cfg_scale` for every model: above 1 it switches CFG on, at the family's own
    `guidance_scale`; at 1 or below it switches CFG off (`Req.validate`, `get_classifier_free_guidance_scale`)."""
    from diffrl.engine.engine import Engine
    from diffrl.engine.protocol import RolloutRequest
    from diffrl.errors import RequestError

    engine = Engine(tiny_family)

    def image(**fields):
        return engine.generate(RolloutRequest(prompt="a red circle", num_inference_steps=2, seed=3,
                                              **fields))[0].generated_output

    guided, unguided = image(guidance_scale=3.0), image(guidance_scale=1.0)
    assert not torch.equal(guided, unguided)
    assert torch.equal(image(guidance_scale=3.0, true_cfg_scale=4.0), guided)  # on: the family's own scale
    assert torch.equal(image(guidance_scale=3.0, true_cfg_scale=1.0), unguided)  # off
    with pytest.raises(RequestError) as err:  # on at a scale below 1 would blend toward the unconditional branch
        image(guidance_scale=0.5, true_cfg_scale=4.0)
    assert err.value.field == "guidance_scale"
