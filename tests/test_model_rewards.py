"""Rewards scored by models from local checkpoints (tiny random CLIPs built here) and the JPEG rewards."""

import json
import pickle

import pytest
import torch
from safetensors.torch import save_file

from diffrl.errors import ModelLoadError
from diffrl.rewards import get_reward
from diffrl.rewards.clip_scores import aesthetic_mlp


def _save_tiny_clip(path, processor_path=None):
    """A tiny random CLIP and its processor, saved to `path` (the processor to `processor_path` if given)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    processor_path = processor_path or path
    path.mkdir(parents=True)
    processor_path.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for code in range(97, 123):
        vocab[chr(code)] = len(vocab)
        vocab[chr(code) + "</w>"] = len(vocab)
    (processor_path / "vocab.json").write_text(json.dumps(vocab))
    (processor_path / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(processor_path / "vocab.json"), str(processor_path / "merges.txt"))
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        projection_dim=16))
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                 crop_size={"height": 32, "width": 32}),
                              tokenizer=tokenizer)
    model.save_pretrained(path)
    processor.save_pretrained(processor_path)
    return model, processor


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "clip"
    model, processor = _save_tiny_clip(path)
    return path, model.eval(), processor


IMAGES = torch.rand(3, 3, 48, 48, generator=torch.Generator().manual_seed(1))
PROMPTS = ["a red cat", "two dogs", "a blue square"]


def _reference_logits(model, processor):
    """CLIP's own forward: logits_per_image[i, i] = exp(logit_scale) · cos(image i, prompt i)."""
    inputs = processor(text=PROMPTS, images=list(IMAGES), return_tensors="pt", padding=True, do_rescale=False)
    with torch.no_grad():
        return model(**inputs).logits_per_image.diagonal()


def test_pickscore_is_clips_logit_over_26(tiny_clip):
    path, model, processor = tiny_clip
    scores = get_reward(f"pickscore@{path}")(IMAGES, PROMPTS)
    assert scores == pytest.approx((_reference_logits(model, processor) / 26).tolist(), rel=1e-5)


def test_clipscore_is_clip_s(tiny_clip):
    path, model, processor = tiny_clip
    cosine = _reference_logits(model, processor) / model.logit_scale.exp()
    scores = get_reward(f"clipscore@{path}")(IMAGES, PROMPTS)
    assert scores == pytest.approx((2.5 * cosine.clamp(min=0)).tolist(), rel=1e-5, abs=1e-6)
    assert len(set(scores)) > 1  # the images score differently: the comparison above can fail


def test_aesthetic_reads_the_published_head_and_refuses_pickled_code(tiny_clip, tmp_path):
    import shutil

    path, model, processor = tiny_clip
    torch.manual_seed(2)
    head = aesthetic_mlp(16).eval()
    published = tmp_path / "aesthetic"
    shutil.copytree(path, published)
    torch.save({f"layers.{k}": v for k, v in head.state_dict().items()}, published / "sac+logos+ava1-l14-linearMSE.pth")
    inputs = processor(images=list(IMAGES), return_tensors="pt", do_rescale=False)
    with torch.no_grad():
        embeds = torch.nn.functional.normalize(model(**inputs, input_ids=torch.zeros(3, 1, dtype=torch.long)).image_embeds, dim=-1)
        want = head(embeds).squeeze(-1).tolist()
    assert get_reward(f"aesthetic@{published}")(IMAGES, PROMPTS) == pytest.approx(want, rel=1e-5)
    converted = tmp_path / "aesthetic-safetensors"  # the same head as aesthetic_mlp.safetensors
    shutil.copytree(path, converted)
    save_file(head.state_dict(), str(converted / "aesthetic_mlp.safetensors"))
    assert get_reward(f"aesthetic@{converted}")(IMAGES, PROMPTS) == pytest.approx(want, rel=1e-5)

    hostile = tmp_path / "hostile"
    shutil.copytree(path, hostile)
    (hostile / "head.pth").write_bytes(pickle.dumps(print))  # a pickle that would call code
    with pytest.raises(ModelLoadError, match="corrupt file"):
        get_reward(f"aesthetic@{hostile}")


def test_model_reward_needs_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="pickscore@/path/to/checkpoint"):
        get_reward("pickscore")
    with pytest.raises(ModelLoadError, match="config.json missing"):
        get_reward(f"clipscore@{tmp_path}")
    with pytest.raises(ValueError, match="unknown model reward 'nope'"):
        get_reward(f"nope@{tmp_path}")


def test_jpeg_rewards_prefer_flat_or_busy_images():
    flat = torch.full((1, 3, 64, 64), 0.5)
    noise = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    busy, calm = get_reward("jpeg_incompressibility")(torch.cat([noise, flat]), ["", ""])
    assert busy > 3 * calm > 0  # kB of JPEG at quality 95
    assert get_reward("jpeg_compressibility")(torch.cat([noise, flat]), ["", ""]) == [-busy, -calm]


def test_model_rewards_combine_in_multi(tiny_clip):
    import asyncio

    path, model, processor = tiny_clip
    total = asyncio.run(get_reward(f"multi:pickscore@{path}=2,jpeg_compressibility=0.5")(IMAGES, PROMPTS))
    pick = get_reward(f"pickscore@{path}")(IMAGES, PROMPTS)
    jpeg = get_reward("jpeg_compressibility")(IMAGES, PROMPTS)
    assert total == pytest.approx([2 * p + 0.5 * j for p, j in zip(pick, jpeg)])


def test_pickscore_takes_the_processor_from_another_directory(tmp_path):
    """PickScore's published setup: the model from one directory, the processor from another."""
    import asyncio

    alone, elsewhere = tmp_path / "PickScore_v1", tmp_path / "CLIP-ViT-H-14"
    model, processor = _save_tiny_clip(alone, processor_path=elsewhere)
    assert not (alone / "vocab.json").exists()
    with pytest.raises(ModelLoadError, match=f"cannot load the processor from {alone}"):
        get_reward(f"pickscore@{alone}")
    want = (_reference_logits(model, processor) / 26).tolist()
    assert get_reward(f"pickscore@{alone},processor={elsewhere}")(IMAGES, PROMPTS) == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="'tokenizer=x' is not an option; known: processor=DIR"):
        get_reward(f"pickscore@{alone},tokenizer=x")
    # In multi: the option stays with its reward, with or without a weight after it.
    spec = f"multi:pickscore@{alone},processor={elsewhere}=2,jpeg_compressibility=0.5,clipscore@{alone},processor={elsewhere}"
    total = asyncio.run(get_reward(spec)(IMAGES, PROMPTS))
    jpeg = get_reward("jpeg_compressibility")(IMAGES, PROMPTS)
    clip = get_reward(f"clipscore@{alone},processor={elsewhere}")(IMAGES, PROMPTS)
    assert total == pytest.approx([2 * p + 0.5 * j + c for p, j, c in zip(want, jpeg, clip)], rel=1e-5)


@pytest.mark.parametrize("name", ["pickscore", "clipscore", "aesthetic"])
def test_a_video_scores_as_the_mean_over_its_frames(tiny_clip, tmp_path, name):
    path, model, processor = tiny_clip
    if name == "aesthetic":
        import shutil

        torch.manual_seed(2)
        shutil.copytree(path, tmp_path / "aesthetic")
        path = tmp_path / "aesthetic"
        save_file(aesthetic_mlp(16).state_dict(), str(path / "aesthetic_mlp.safetensors"))
    reward = get_reward(f"{name}@{path}")
    video = torch.stack([IMAGES.roll(f, 0) for f in range(3)], dim=2)  # [B, C, F, H, W]: frame f of video i is image i - f
    per_frame = [reward(video[:, :, f], PROMPTS) for f in range(3)]
    assert any(len({round(v[i], 5) for v in per_frame}) == 3 for i in range(3))  # frames that score differently
    want = [sum(v[i] for v in per_frame) / 3 for i in range(3)]
    assert reward(video, PROMPTS) == pytest.approx(want, rel=1e-5, abs=1e-6)  # batch size changes float sums
    with pytest.raises(ValueError, match="3 videos but 1 prompts"):
        reward(video, PROMPTS[:1])


def test_model_rewards_load_on_the_device_asked_for(tiny_clip, monkeypatch):
    from diffrl.rewards import _model_reward, clip_scores

    path, model, processor = tiny_clip
    devices = []
    real = clip_scores.clipscore
    monkeypatch.setattr(clip_scores, "clipscore", lambda p, device, **options: devices.append(device) or real(p, device))
    _model_reward.cache_clear()
    on_cpu = get_reward(f"clipscore@{path}", device="cpu")
    assert get_reward(f"clipscore@{path}", device="cpu") is on_cpu  # loaded once per (path, device)
    default = get_reward(f"clipscore@{path}")  # None: CUDA when available, else the CPU
    assert devices == [torch.device("cpu"), torch.device("cuda" if torch.cuda.is_available() else "cpu")]
    assert on_cpu(IMAGES, PROMPTS) == pytest.approx(default(IMAGES, PROMPTS), rel=1e-5)
    with pytest.raises(ValueError, match="reward device 'nowhere'"):
        get_reward(f"clipscore@{path}", device="nowhere")


def test_a_hub_id_as_reward_path_says_that_only_local_directories_are_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for spec, name in (("pickscore@yuvalkirstain/PickScore_v1", "no CLIP checkpoint at"),
                       ("hpsv2@xswu/HPSv2", "hpsv2: no checkpoint at")):
        with pytest.raises(ModelLoadError, match=rf"^{name} .*a hub id\? diffrl reads local directories only"):
            get_reward(spec, device="cpu")
