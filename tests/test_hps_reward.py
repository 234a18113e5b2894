"""`hpsv2@PATH`: a tiny random open_clip-format checkpoint, scored against open_clip's forward written out
here with torch's own MultiheadAttention (the module open_clip's blocks use)."""

import json
import pickle

import pytest
import torch
from safetensors.torch import save_file

from diffrl.errors import ModelLoadError
from diffrl.rewards import get_reward

CFG = {"embed_dim": 16,
       "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
       "text_cfg": {"context_length": 20, "vocab_size": 54, "width": 24, "heads": 2, "layers": 2}}
PROMPTS = ["a red cat", "two dogs", "a blue square"]
IMAGES = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _blocks(state, prefix, width, layers):
    g = torch.Generator().manual_seed(len(prefix) + layers)
    for i in range(layers):
        p = f"{prefix}transformer.resblocks.{i}."
        shapes = {"ln_1.weight": (width,), "ln_1.bias": (width,), "attn.in_proj_weight": (3 * width, width),
                  "attn.in_proj_bias": (3 * width,), "attn.out_proj.weight": (width, width),
                  "attn.out_proj.bias": (width,), "ln_2.weight": (width,), "ln_2.bias": (width,),
                  "mlp.c_fc.weight": (4 * width, width), "mlp.c_fc.bias": (4 * width,),
                  "mlp.c_proj.weight": (width, 4 * width), "mlp.c_proj.bias": (width,)}
        for name, shape in shapes.items():
            state[p + name] = torch.randn(shape, generator=g) * 0.2 + (1.0 if name.startswith("ln_") and
                                                                         name.endswith("weight") else 0.0)


def tiny_state(cfg=CFG):
    """Random parameters under open_clip's CLIP names and shapes."""
    g = torch.Generator().manual_seed(0)
    vc, tc, e = cfg["vision_cfg"], cfg["text_cfg"], cfg["embed_dim"]
    w, p, grid, tw = vc["width"], vc["patch_size"], vc["image_size"] // vc["patch_size"], tc["width"]
    state = {"visual.conv1.weight": torch.randn(w, 3, p, p, generator=g) * 0.1,
             "visual.class_embedding": torch.randn(w, generator=g),
             "visual.positional_embedding": torch.randn(grid * grid + 1, w, generator=g) * 0.1,
             "visual.proj": torch.randn(w, e, generator=g) * 0.2,
             "token_embedding.weight": torch.randn(tc["vocab_size"], tw, generator=g),
             "positional_embedding": torch.randn(tc["context_length"], tw, generator=g) * 0.1,
             "text_projection": torch.randn(tw, e, generator=g) * 0.2, "logit_scale": torch.tensor(4.6)}
    for name, width in (("visual.ln_pre", w), ("visual.ln_post", w), ("ln_final", tw)):
        state[f"{name}.weight"] = 1 + 0.1 * torch.randn(width, generator=g)
        state[f"{name}.bias"] = 0.1 * torch.randn(width, generator=g)
    _blocks(state, "visual.", w, vc["layers"])
    _blocks(state, "", tw, tc["layers"])
    return state


def save_tokenizer(path):
    """CLIP's BPE format with a tiny vocabulary; start and end of text are the last ids, as in CLIP's."""
    from transformers import CLIPTokenizer

    path.mkdir(parents=True, exist_ok=True)
    vocab = {}
    for code in range(97, 123):
        vocab[chr(code)] = len(vocab)
        vocab[chr(code) + "</w>"] = len(vocab)
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = len(vocab), len(vocab) + 1
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(path / "vocab.json"), str(path / "merges.txt"))
    tokenizer.save_pretrained(path)
    return tokenizer


def _residual_blocks(x, state, prefix, layers, heads, causal):
    n = x.shape[1]
    mask = torch.full((n, n), float("-inf")).triu(1) if causal else None
    for i in range(layers):
        p = f"{prefix}transformer.resblocks.{i}."
        width = x.shape[-1]
        attn = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        attn.load_state_dict({k.removeprefix(p + "attn."): v for k, v in state.items() if k.startswith(p + "attn.")})
        h = torch.nn.functional.layer_norm(x, (width,), state[p + "ln_1.weight"], state[p + "ln_1.bias"])
        x = x + attn(h, h, h, need_weights=False, attn_mask=mask)[0]
        h = torch.nn.functional.layer_norm(x, (width,), state[p + "ln_2.weight"], state[p + "ln_2.bias"])
        h = torch.nn.functional.gelu(h @ state[p + "mlp.c_fc.weight"].T + state[p + "mlp.c_fc.bias"])
        x = x + h @ state[p + "mlp.c_proj.weight"].T + state[p + "mlp.c_proj.bias"]
    return x


@torch.no_grad()
def reference_cosine(state, cfg, pixels, token_ids):
    """open_clip's CLIP forward on normalized pixels and token ids; the cosine of the two embeddings."""
    vc, tc = cfg["vision_cfg"], cfg["text_cfg"]
    w = vc["width"]
    x = torch.nn.functional.conv2d(pixels, state["visual.conv1.weight"], stride=vc["patch_size"])
    x = x.flatten(2).transpose(1, 2)
    x = torch.cat([state["visual.class_embedding"].expand(x.shape[0], 1, w), x], 1) + state["visual.positional_embedding"]
    x = torch.nn.functional.layer_norm(x, (w,), state["visual.ln_pre.weight"], state["visual.ln_pre.bias"])
    x = _residual_blocks(x, state, "visual.", vc["layers"], w // vc["head_width"], causal=False)
    image = torch.nn.functional.layer_norm(x[:, 0], (w,), state["visual.ln_post.weight"], state["visual.ln_post.bias"])
    image = image @ state["visual.proj"]

    t = state["token_embedding.weight"][token_ids] + state["positional_embedding"][:token_ids.shape[1]]
    t = _residual_blocks(t, state, "", tc["layers"], tc["heads"], causal=True)
    t = torch.nn.functional.layer_norm(t, (tc["width"],), state["ln_final.weight"], state["ln_final.bias"])
    text = t[torch.arange(len(t)), token_ids.argmax(-1)] @ state["text_projection"]  # at end of text: the top id
    return torch.nn.functional.cosine_similarity(image, text, dim=-1)


def _normalized(images):
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    return (images - mean) / std


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A directory like HPSv2.1's release: the wrapped state dict, plus a config and the tokenizer."""
    path = tmp_path_factory.mktemp("hps") / "hps"
    tokenizer = save_tokenizer(path)
    state = tiny_state()
    torch.save({"state_dict": state, "epoch": 1}, path / "HPS_v2.1_tiny.pt")
    (path / "open_clip_config.json").write_text(json.dumps({"model_cfg": CFG, "preprocess_cfg": {}}))
    return path, state, tokenizer


def _want(state, tokenizer, images=IMAGES, prompts=PROMPTS):
    ids = tokenizer(prompts, return_tensors="pt", padding=True)["input_ids"]
    return reference_cosine(state, CFG, _normalized(images), ids)


def test_hpsv2_is_the_cosine_of_open_clips_embeddings(checkpoint):
    path, state, tokenizer = checkpoint
    want = _want(state, tokenizer)
    scores = get_reward(f"hpsv2@{path}", device="cpu")(IMAGES, PROMPTS)
    assert scores == pytest.approx(want.tolist(), abs=1e-5)
    assert len({round(s, 4) for s in scores}) == 3  # distinct scores: the comparison can fail
    # The weights file itself, and the same weights as safetensors without the wrapper.
    assert get_reward(f"hpsv2@{path / 'HPS_v2.1_tiny.pt'}", device="cpu")(IMAGES, PROMPTS) == pytest.approx(scores)


def test_hpsv2_reads_safetensors_and_a_separate_tokenizer(checkpoint, tmp_path):
    path, state, tokenizer = checkpoint
    weights = tmp_path / "weights"
    weights.mkdir()
    save_file(state, str(weights / "hps.safetensors"))
    (weights / "open_clip_config.json").write_text((path / "open_clip_config.json").read_text())
    with pytest.raises(ModelLoadError, match="tokenizer"):
        get_reward(f"hpsv2@{weights}", device="cpu")
    scores = get_reward(f"hpsv2@{weights},processor={path}", device="cpu")(IMAGES, PROMPTS)
    assert scores == pytest.approx(_want(state, tokenizer).tolist(), abs=1e-5)


def test_hpsv2_pads_the_shorter_side_black(checkpoint):
    from diffrl.rewards.hps import HPSv2

    path, state, tokenizer = checkpoint
    model = HPSv2(path, torch.device("cpu"))
    tall = torch.rand(1, 3, 64, 32, generator=torch.Generator().manual_seed(3))  # longer side 64 → 32
    pixels = model.preprocess(tall)
    assert pixels.shape == (1, 3, 32, 32)
    black = _normalized(torch.zeros(1, 3, 1, 1))
    assert torch.allclose(pixels[..., :8], black.expand(1, 3, 32, 8))
    assert torch.allclose(pixels[..., 24:], black.expand(1, 3, 32, 8))
    resized = torch.nn.functional.interpolate(tall, size=(32, 16), mode="bicubic", antialias=True)
    assert torch.allclose(pixels[..., 8:24], _normalized(resized), atol=1e-5)


def test_hpsv2_video_is_the_mean_over_frames(checkpoint):
    path, state, tokenizer = checkpoint
    reward = get_reward(f"hpsv2@{path}", device="cpu")
    video = torch.rand(2, 3, 3, 32, 32, generator=torch.Generator().manual_seed(4))  # [B, C, F, H, W]
    per_frame = [reward(video[:, :, f], PROMPTS[:2]) for f in range(3)]
    assert len({round(v[0], 4) for v in per_frame}) == 3  # the frames score differently
    want = [sum(v[i] for v in per_frame) / 3 for i in range(2)]
    assert reward(video, PROMPTS[:2]) == pytest.approx(want, abs=1e-6)


def test_hpsv2_bad_checkpoints_are_named(checkpoint, tmp_path):
    path, state, tokenizer = checkpoint
    with pytest.raises(ModelLoadError, match=f"no checkpoint at {tmp_path / 'missing'}"):
        get_reward(f"hpsv2@{tmp_path / 'missing'}", device="cpu")
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a checkpoint")
    with pytest.raises(ModelLoadError, match=f"corrupt file: {corrupt}") as err:
        get_reward(f"hpsv2@{corrupt},processor={path}", device="cpu")
    assert "\n" not in str(err.value)
    hostile = tmp_path / "hostile.pt"
    hostile.write_bytes(pickle.dumps(print))  # a pickle that would call code
    with pytest.raises(ModelLoadError, match=f"corrupt file: {hostile}"):
        get_reward(f"hpsv2@{hostile},processor={path}", device="cpu")
    wrong = tmp_path / "wrong"  # weights of another architecture than the config says
    save_tokenizer(wrong)
    bigger = dict(CFG, text_cfg=dict(CFG["text_cfg"], layers=3))
    (wrong / "open_clip_config.json").write_text(json.dumps({"model_cfg": bigger}))
    torch.save(state, wrong / "hps.pt")
    with pytest.raises(ModelLoadError, match=f"{wrong / 'hps.pt'}: the weights do not fit"):
        get_reward(f"hpsv2@{wrong}", device="cpu")
