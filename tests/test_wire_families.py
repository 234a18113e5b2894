"""Each family's mapping of its conditioning to sglang-diffusion's cond kwargs and back (no weights)."""

from types import SimpleNamespace

import torch

from diffrl.models.base import PromptEmbeds
from diffrl.models.demo import DemoFamily, image_position_ids, text_position_ids
from diffrl.models.qwen_image import QwenImageFamily
from diffrl.models.qwen_image import image_position_ids as qwen_image_ids
from diffrl.models.sd3 import SD3Family
from diffrl.models.wan2_2 import Wan22Family


def _bare(cls, **attrs):
    """An adapter object without loaded components (the mapping reads at most its config)."""
    family = object.__new__(cls)
    family.__dict__.update(attrs)
    return family


def test_qwen_image_sends_sglangs_names_and_rebuilds_its_header_token():
    text = torch.randn(3, 8)
    padded = torch.zeros(1, 1 + 5, 8)  # a prompt of 3 tokens padded to a batch's 5
    padded[0, 0, 0] = 3
    padded[0, 1:4] = text
    ids = qwen_image_ids(2, 4)
    wire = _bare(QwenImageFamily).cond_kwargs_to_wire(PromptEmbeds(padded, torch.zeros(6, 1)), ids)
    assert set(wire) == {"encoder_hidden_states", "txt_seq_lens", "img_shapes"}
    assert torch.equal(wire["encoder_hidden_states"][0], text) and wire["txt_seq_lens"] == [3]
    assert wire["img_shapes"] == [[[1, 2, 4]]]
    cond, image_ids = QwenImageFamily.cond_kwargs_from_wire(wire)
    assert torch.equal(cond.embeds, padded[:, :4]) and cond.ids.shape == (4, 1)
    assert torch.equal(image_ids, ids)


def test_sd3_sends_pooled_projections_unpadded():
    tokens, pooled = torch.randn(5, 8), torch.randn(6)
    packed = torch.cat([tokens, torch.nn.functional.pad(pooled, (0, 2))[None]])[None]
    family = _bare(SD3Family, transformer=SimpleNamespace(config=SimpleNamespace(pooled_projection_dim=6)))
    wire = family.cond_kwargs_to_wire(PromptEmbeds(packed, torch.zeros(6, 1)), torch.zeros(0, 1))
    assert torch.equal(wire["pooled_projections"], pooled) and torch.equal(wire["encoder_hidden_states"][0], tokens)
    cond, image_ids = SD3Family.cond_kwargs_from_wire(wire)
    assert torch.equal(cond.embeds, packed) and image_ids.shape == (0, 1)
    bare_tensor = {**wire, "encoder_hidden_states": tokens}  # sglang's SD3 sends the tensor itself
    assert torch.equal(SD3Family.cond_kwargs_from_wire(bare_tensor)[0].embeds, packed)


def test_wan_and_the_flux_style_default_round_trip():
    tokens = torch.randn(7, 8)
    wan = _bare(Wan22Family)
    wan.max_sequence_length = 7  # the text's rows; image-to-video's condition rows would follow them
    wire = wan.cond_kwargs_to_wire(PromptEmbeds(tokens[None], torch.zeros(7, 1)), torch.zeros(0, 1))
    assert list(wire) == ["encoder_hidden_states"]
    cond, _ = Wan22Family.cond_kwargs_from_wire(wire)
    assert torch.equal(cond.embeds, tokens[None]) and torch.equal(cond.ids, torch.zeros(7, 1))
    ids, img = text_position_ids(7), image_position_ids(4, 4)
    wire = _bare(DemoFamily).cond_kwargs_to_wire(PromptEmbeds(tokens[None], ids), img)
    cond, image_ids = DemoFamily.cond_kwargs_from_wire(wire)
    assert torch.equal(cond.embeds, tokens[None]) and torch.equal(cond.ids, ids) and torch.equal(image_ids, img)
