"""Rewards from CLIP-family checkpoints on disk (transformers format, never a hub id): `clipscore`,
`pickscore` and `aesthetic`. Each is asked for as `NAME@PATH` (`--reward pickscore@/models/PickScore_v1`),
or `NAME@PATH,processor=DIR` when the processor (tokenizer and image preprocessing) lies in another
directory: PickScore's published setup pairs the model `yuvalkirstain/PickScore_v1` with the processor of
`laion/CLIP-ViT-H-14-laion2B-s32B-b79K`, so `pickscore@/models/PickScore_v1,processor=/models/CLIP-ViT-H-14`.
The model loads once per process and device, and scores in fp32 (as flow_grpo's and DiffusionNFT's
PickScore, CLIP score and aesthetic scorers do).

- clipscore: CLIP-S = 2.5 · max(cos(image, text), 0) (Hessel et al., 2021), in [0, 2.5].
- pickscore: PickScore's logit, exp(logit_scale) · cos(image, text), divided by 26 (its usual range is
  ~18–24, so the reward sits near 1; flow_grpo scales it the same way).
- aesthetic: the LAION aesthetic predictor (an MLP over the L2-normalized CLIP ViT-L/14 image embedding),
  on its own 1–10 scale. PATH holds the CLIP model and the MLP as `aesthetic_mlp.safetensors` (or the
  published `.pth`, read with `torch.load(weights_only=True)`, which refuses pickled code).
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffrl.errors import ModelLoadError
from diffrl.models.components import hub_id_hint


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def load_processor(path: str | Path, what: str = "processor"):
    """A transformers processor (or tokenizer) from a local directory, or a one-line ModelLoadError."""
    from transformers import AutoProcessor

    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"no {what} directory at {path}")
    try:
        return AutoProcessor.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise ModelLoadError(f"cannot load the {what} from {path}: {_first_line(err)}") from None


class _Clip:
    """A CLIP model and its processor, loaded from local directories (the processor's defaults to the model's)."""

    def __init__(self, path: str | Path, device: torch.device, processor: str | Path | None = None):
        from transformers import CLIPModel

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"no CLIP checkpoint at {path} (config.json missing){hub_id_hint(path)}")
        self.processor = load_processor(path if processor is None else processor)
        try:
            self.model = CLIPModel.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"cannot load the CLIP checkpoint {path}: {_first_line(err)}") from None
        self.device = torch.device(device)
        self.model.to(self.device).eval().requires_grad_(False)

    @torch.no_grad()
    def image_embeds(self, images: torch.Tensor) -> torch.Tensor:
        """Unit-norm image embeddings of images [B, 3, H, W] in [0, 1]."""
        pixels = self.processor(images=list(images.float().cpu()), return_tensors="pt", do_rescale=False)
        embeds = self.model.get_image_features(pixel_values=pixels["pixel_values"].to(self.device))
        embeds = getattr(embeds, "pooler_output", embeds)
        return torch.nn.functional.normalize(embeds.float(), dim=-1)

    @torch.no_grad()
    def text_embeds(self, prompts: list[str]) -> torch.Tensor:
        tokens = self.processor(text=list(prompts), return_tensors="pt", padding=True, truncation=True,
                                max_length=self.model.config.text_config.max_position_embeddings)
        embeds = self.model.get_text_features(input_ids=tokens["input_ids"].to(self.device),
                                              attention_mask=tokens["attention_mask"].to(self.device))
        embeds = getattr(embeds, "pooler_output", embeds)
        return torch.nn.functional.normalize(embeds.float(), dim=-1)

    def cosine(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return (self.image_embeds(images) * self.text_embeds(prompts)).sum(-1)


def clipscore(path: str, device: torch.device, processor: str | None = None):
    clip = _Clip(path, device, processor)

    def score(images, prompts, metadata=None) -> list[float]:
        return (2.5 * clip.cosine(images, list(prompts)).clamp(min=0)).tolist()

    score.modules = (clip.model,)  # what --reward-colocate moves
    return score


PICKSCORE_SCALE = 26.0


def pickscore(path: str, device: torch.device, processor: str | None = None):
    clip = _Clip(path, device, processor)

    def score(images, prompts, metadata=None) -> list[float]:
        logits = clip.model.logit_scale.exp().float() * clip.cosine(images, list(prompts))
        return (logits / PICKSCORE_SCALE).tolist()

    score.modules = (clip.model,)
    return score


def aesthetic_mlp(width: int) -> torch.nn.Sequential:
    """The LAION aesthetic predictor's head (improved-aesthetic-predictor); indices match its state dict."""
    return torch.nn.Sequential(
        torch.nn.Linear(width, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128), torch.nn.Dropout(0.2),
        torch.nn.Linear(128, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))


def _read_head(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    for name in ("aesthetic_mlp.safetensors",):
        if (path / name).is_file():
            state = load_file(str(path / name))
            break
    else:
        published = sorted(path.glob("*.pth"))
        if not published:
            raise ModelLoadError(f"{path}: no aesthetic_mlp.safetensors (or the published .pth) beside the CLIP model")
        try:
            state = torch.load(published[0], map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any unreadable file is the same error to the user
            raise ModelLoadError(f"corrupt file: {published[0]} ({err})") from None
    # The published file names the Sequential `layers`.
    return {key.removeprefix("layers."): value for key, value in state.items()}


def aesthetic(path: str, device: torch.device, processor: str | None = None):
    clip = _Clip(path, device, processor)
    head = aesthetic_mlp(clip.model.config.projection_dim)
    try:
        head.load_state_dict(_read_head(Path(path)), strict=True)
    except RuntimeError as err:
        raise ModelLoadError(f"{path}: the aesthetic head does not fit this CLIP model "
                             f"({str(err).strip().splitlines()[0]})") from None
    head.to(clip.device).eval().requires_grad_(False)

    def score(images, prompts, metadata=None) -> list[float]:
        with torch.no_grad():
            return head(clip.image_embeds(images)).squeeze(-1).tolist()

    score.modules = (clip.model, head)
    return score
