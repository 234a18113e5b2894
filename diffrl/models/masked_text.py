"""A text conditioning of each prompt's own length, the mask as its last channel: what Z-Image (`z_image.py`) and
CogView4 (`cogview4.py`) share.

Both transformers take each prompt's real text tokens and nothing else (Z-Image a list of captions, CogView4 one
call per text length), so a conditioning row is the prompt's tokens `[n, D]` plus a channel of 1s, then zero rows:
prompts of different lengths share a batch zero-padded at the end (the families' `pads_text`), and the mask channel
tells each row's length. On the wire a prompt travels as its own tokens alone (no mask channel, no padding), under
`encoder_hidden_states`, and no position ids travel (the transformers position text and image themselves). Kept in
one place so the two families cannot drift apart in how a row, its length and its wire form are read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffrl.models.base import PromptEmbeds, wire_text_tokens


def text_lengths(embeds: torch.Tensor) -> torch.Tensor:
    """Each row's number of real text tokens (the mask channel's sum) `[B]`."""
    return (embeds[..., -1] > 0.5).sum(dim=1)


def with_mask_channel(tokens: torch.Tensor) -> torch.Tensor:
    """One prompt's real tokens `[n, D]` → its conditioning rows `[n, D + 1]`: the mask channel of 1s appended."""
    return torch.cat([tokens, tokens.new_ones(tokens.shape[0], 1)], dim=1)


def pad_to(embeds: torch.Tensor, length: int) -> torch.Tensor:
    """A conditioning `[B, L, D + 1]` zero-padded (at the end, masked out) to `length` tokens."""
    return torch.nn.functional.pad(embeds, (0, 0, 0, length - embeds.shape[1]))


def pad_rows(texts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Rows `[n_i, D + 1]` zero-padded at the end into one `[B, max n_i, D + 1]` batch."""
    longest = max(t.shape[0] for t in texts)
    return torch.stack([pad_to(t[None], longest)[0] for t in texts])


def masked_text_conditioning(texts: Sequence[torch.Tensor]) -> PromptEmbeds:
    """Prompts encoded one at a time (`[n_i, D + 1]` each) as one batch, zero-padded to the longest, with the
    all-zero text position ids `[L, 1]` of a transformer that has none."""
    embeds = pad_rows(texts)
    return PromptEmbeds(embeds, torch.zeros(embeds.shape[1], 1, device=embeds.device))


class MaskedTextWire:
    """The wire form of a masked text conditioning, for a `FamilyAdapter` (listed before it in the bases)."""

    def cond_kwargs_to_wire(self, cond: PromptEmbeds, image_ids: torch.Tensor) -> dict:
        """The prompt's own text tokens (no mask channel, no padding) as the transformer's `encoder_hidden_states`
        (sglang-diffusion's name for Z-Image; the diffusers forward's for CogView4, which sglang does not serve)."""
        length = int(text_lengths(cond.embeds[:1])[0])
        return {"encoder_hidden_states": [cond.embeds[0, :length, :-1]]}

    @classmethod
    def cond_kwargs_from_wire(cls, kwargs: dict) -> tuple[PromptEmbeds, torch.Tensor | None]:
        embeds = with_mask_channel(wire_text_tokens(kwargs))[None]
        return PromptEmbeds(embeds, torch.zeros(embeds.shape[1], 1)), None
