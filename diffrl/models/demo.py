"""The `demo` family: a small text-to-image model for the shapes world, shipped in the repository.

It is the FLUX 3 architecture (diffusers' `Flux3Transformer2DModel`) at a small config, in pixel
space: a 64×64 RGB image in [-1, 1] is cut into 4×4 patches, so each token carries 48 values and
the image is 256 tokens. Condition images (image-conditioned requests, the shapes-edit world's sources: at the
model's own size) go to the transformer's reference mode as FLUX 3 Image Klein's do (`flux3_image`): patchified
the same way, position ids (0, row, column, -(i + 1)), folded into the prompt's conditioning. The text encoder is a
small T5 encoder over a word-level tokenizer built in code from the shapes vocabulary. Stored in diffusers layout:

    model_index.json            components + the `diffrl` block (family, image and patch size, shift)
    transformer/                config.json + diffusion_pytorch_model.safetensors
    text_encoder/               config.json + model.safetensors
    tokenizer/                  tokenizer.json + tokenizer_config.json
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from diffrl.assets import SHIPPED_DEMO_MODEL, SHIPPED_EDIT_MODEL, SHIPPED_OCR_MODEL  # noqa: F401  (re-exported)
from diffrl.data.ocr.glyph_grid import GlyphGrid
from diffrl.data.ocr.quotes import first_quoted
from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.base import (
    Component,
    FamilyAdapter,
    Latents,
    PromptEmbeds,
    read_json,
    register_family,
)
from diffrl.models.batch_invariance import embed_rows_one_at_a_time
from diffrl.models.flux2_vae import MAX_REFERENCE_IMAGES, fold_references, split_references
from diffrl.models.flux3_image import run_flux3_transformer
from diffrl.models.random_checkpoints.tokenizers import SPACE_IN_QUOTES
from diffrl.models.weights import load_weights, read_weights
from diffrl.sampling import make_sigmas, randn_per_sample

if TYPE_CHECKING:  # the loaders below import these lazily: diffusers' and transformers' model packages take seconds
    from diffusers import Flux3Transformer2DModel
    from transformers import PreTrainedTokenizerFast, T5EncoderModel


PREDICTIONS = ("velocity", "image")
IMAGE_PREDICTION_MIN_SIGMA = 0.05  # below it (x_t − x0)/σ would magnify the image error without bound


@dataclass
class DemoConfig:
    image_size: int = 64
    """The image's height (and its width unless `image_width` is set)."""
    image_width: int | None = None
    """A wider image's width (the OCR demo model's one-line texts); None: square."""
    patch_size: int = 4
    max_text_len: int = 16
    shift: float = 3.0
    glyph_grid: bool = False
    """The OCR world's grid layout (`diffrl.data.ocr.glyph_grid`): one conditioning token per cell of the grid,
    holding the character the prompt's quoted text puts there, ahead of the prompt's tokens and at the cell's
    place in the image."""
    prediction: str = "velocity"
    """What the transformer outputs: "velocity" (ε − x0, the shipped models') or "image" (the clean image x0, turned
    into the velocity (x_t − x0)/σ with σ held at ≥ 0.05, so that everything downstream still sees a velocity).
    A pixel-space patch of many values (an 8×8 patch: 192) is far easier to predict as the image, which lies near a
    low-dimensional set, than as noise, which fills every dimension and which a transformer no wider than the patch
    cannot carry (Li & He 2025, "Back to Basics: Let Denoising Generative Models Denoise")."""
    # Flux3Transformer2DModel keyword arguments (in_channels and joint_attention_dim are derived).
    transformer: dict = field(default_factory=lambda: {
        "num_layers": 2, "num_single_layers": 6, "attention_head_dim": 32, "num_attention_heads": 4,
        "timestep_channels": 128, "mlp_ratio": 3.0, "axes_dims_rope": (8, 8, 8, 8),
    })
    # T5Config keyword arguments (vocab_size is derived from the tokenizer).
    text_encoder: dict = field(default_factory=lambda: {
        "d_model": 128, "d_kv": 32, "d_ff": 256, "num_layers": 2, "num_heads": 4,
        "relative_attention_num_buckets": 8, "relative_attention_max_distance": 16, "dropout_rate": 0.0,
    })

    def __post_init__(self):
        if self.prediction not in PREDICTIONS:
            raise ValueError(f"prediction {self.prediction!r}: a demo model predicts one of {', '.join(PREDICTIONS)}")

    @property
    def height(self) -> int:
        return self.image_size

    @property
    def width(self) -> int:
        return self.image_width or self.image_size

    @property
    def in_channels(self) -> int:
        return 3 * self.patch_size**2


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """[B, 3, H, W] → [B, (H/p)·(W/p), 3·p·p] tokens in raster order."""
    b, c, h, w = images.shape
    x = images.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


def unpatchify(tokens: torch.Tensor, height: int, width: int, patch: int) -> torch.Tensor:
    b = tokens.shape[0]
    x = tokens.reshape(b, height // patch, width // patch, 3, patch, patch)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, 3, height, width)


def image_position_ids(height_tokens: int, width_tokens: int, device=None) -> torch.Tensor:
    """(t, h, w, l) ids of the image tokens: t = l = 0, (h, w) the patch grid."""
    h = torch.arange(height_tokens, device=device).repeat_interleave(width_tokens)
    w = torch.arange(width_tokens, device=device).repeat(height_tokens)
    zeros = torch.zeros_like(h)
    return torch.stack([zeros, h, w, zeros], dim=-1)


def text_position_ids(length: int, device=None) -> torch.Tensor:
    """(t, h, w, l) ids of the text tokens: only l, the token index, varies."""
    l = torch.arange(length, device=device)
    zeros = torch.zeros_like(l)
    return torch.stack([zeros, zeros, zeros, l], dim=-1)


def glyph_grid_ids(config: DemoConfig, device=None) -> torch.Tensor:
    """(t, h, w, l) ids of a glyph-grid model's cell tokens: (h, w) each cell's centre in the image ids' units (patch k
    has id k and its centre at pixel p·k + p/2), so a cell and the patches it covers are near in RoPE."""
    centres = GlyphGrid(config.width).patch_centres(config.patch_size)
    hw = torch.tensor(centres, dtype=torch.float32, device=device)
    zeros = torch.zeros(len(centres), 1, device=device)
    return torch.cat([zeros, hw, zeros], dim=-1)


def tokenize_prompts(tokenizer, config: DemoConfig, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts → (token ids, attention mask) `[B, L]`; a glyph-grid model's cell tokens first (`_grid_tokens`)."""
    batch = tokenizer(list(prompts), padding="max_length", truncation=True, max_length=config.max_text_len,
                      return_tensors="pt")
    if not config.glyph_grid:
        return batch["input_ids"], batch["attention_mask"]
    cells, mask = _grid_tokens(tokenizer, config, prompts)
    return torch.cat([cells, batch["input_ids"]], 1), torch.cat([mask, batch["attention_mask"]], 1)


def _grid_tokens(tokenizer, config: DemoConfig, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt's glyph-grid cells as token ids (a character's own token, `▁` for a space) and a mask that is
    0 on empty cells, which the text encoder then skips and which carry nothing (zeroed, as padding is)."""
    grid = GlyphGrid(config.width)
    layouts = [grid.layout(first_quoted(p)) for p in prompts]
    pad, space = tokenizer.pad_token_id, tokenizer.convert_tokens_to_ids(SPACE_IN_QUOTES)
    ids = [[pad if c is None else space if c == " " else tokenizer.convert_tokens_to_ids(c) for c in cells]
           for cells in layouts]
    mask = [[0 if c is None else 1 for c in cells] for cells in layouts]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


def _load_transformer(folder: Path, dtype: torch.dtype) -> Flux3Transformer2DModel:
    """Built from its config, then every weight loaded strictly (a missing or extra name names the file)."""
    from diffusers import Flux3Transformer2DModel  # lazy: diffusers' transformer package takes seconds to import

    transformer = Flux3Transformer2DModel.from_config(read_json(folder / "config.json"))
    load_weights(transformer, folder / "diffusion_pytorch_model.safetensors")
    return transformer if dtype == torch.float32 else transformer.to(dtype=dtype)


def _load_text_encoder(folder: Path, dtype: torch.dtype) -> T5EncoderModel:
    from transformers import T5EncoderModel  # lazy: transformers' model classes take seconds to import

    read_weights(folder / "model.safetensors")  # names the file when it is missing or corrupt
    # from_pretrained restores the tied input embedding that save_pretrained leaves out.
    return T5EncoderModel.from_pretrained(str(folder), local_files_only=True).to(dtype=dtype)


def _load_tokenizer(folder: Path, dtype: torch.dtype) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast  # lazy: as above

    return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)


@register_family
class DemoFamily(FamilyAdapter):
    name = "demo"
    name_patterns = ("demo",)
    default_guidance_scale = 3.0
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0", "linear_in", "linear_out")
    block_lists = ("mode_blocks", "txt_mode_blocks", "single_transformer_blocks")
    components = (
        Component("transformer", _load_transformer, class_name="Flux3Transformer2DModel"),
        Component("tokenizer", _load_tokenizer, kind="tokenizer", config_file="tokenizer.json"),
        Component("text_encoder", _load_text_encoder, text_encoder=True),
    )
    settings_class = DemoConfig
    model_index_required = True
    # Condition images through the FLUX 3 transformer's reference mode (module docstring); the shipped models were
    # pretrained without them, so their reference blocks are untrained until an editing demo model is pretrained.
    accepts_image_conditioning = True
    max_condition_images = MAX_REFERENCE_IMAGES

    def __init__(
        self,
        config: DemoConfig,
        transformer: Flux3Transformer2DModel,
        text_encoder: T5EncoderModel | None,
        tokenizer: PreTrainedTokenizerFast,
        *,
        batch_invariant: bool = True,
    ):
        self.config = config
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        if batch_invariant:  # off only for pretraining, where every row has its own timestep
            embed_rows_one_at_a_time(transformer.timestep_embedder)

    # ---------------------------------------------------------------- save, load
    def save(self, path: str | Path, weights_dtype: torch.dtype | None = None) -> None:
        """The model in diffusers layout at `path`. `weights_dtype` (e.g. bfloat16, half the bytes of a shipped
        model): the weights' files in that dtype; loading casts them back to the dtype asked for."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.text_encoder is None:
            raise ValueError("cannot save a demo model loaded without its text encoder")
        for name, module in (("transformer", self.transformer), ("text_encoder", self.text_encoder)):
            module.save_pretrained(path / name, safe_serialization=True)
            if weights_dtype is not None:
                for file in (path / name).glob("*.safetensors"):
                    tensors = {k: v.to(weights_dtype) if v.is_floating_point() else v
                               for k, v in read_weights(file, check_finite=False).items()}
                    save_file(tensors, file, metadata={"format": "pt"})
        self.tokenizer.save_pretrained(path / "tokenizer")
        index = {
            "_class_name": "DiffrlDemoPipeline",
            "_diffusers_version": "0.42.1",
            "transformer": ["diffusers", "Flux3Transformer2DModel"],
            "text_encoder": ["transformers", "T5EncoderModel"],
            "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
            "diffrl": {"family": self.name, **asdict(self.config)},
        }
        (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")

    @classmethod
    def from_components(cls, root, parts, settings, *, batch_invariant: bool = True) -> DemoFamily:
        return cls(settings, parts["transformer"], parts["text_encoder"], parts["tokenizer"],
                   batch_invariant=batch_invariant)

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        return self.config.height, self.config.width

    def check_size(self, height: int, width: int) -> None:
        h, w = self.config.height, self.config.width
        for name, value, size in (("height", height, h), ("width", width, w)):
            if value != size:
                raise RequestError(name, f"{name}={value}: the demo model generates {h}x{w} images only")

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        return make_sigmas(num_steps, shift=self.config.shift, device=self.device)

    def set_flow_shift(self, shift: float) -> None:
        if not shift > 0:
            raise ModelLoadError(f"demo: a flow shift must be > 0, got {shift}")
        self.config = replace(self.config, shift=float(shift))  # a full finetune saved after samples so too

    @property
    def text_length(self) -> int:
        """Conditioning tokens per prompt: the prompt's window, after the glyph grid's cells for a grid model."""
        cells = GlyphGrid(self.config.width).slots if self.config.glyph_grid else 0
        return cells + self.config.max_text_len

    def tokenize(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        return tokenize_prompts(self.tokenizer, self.config, prompts)

    def prompt_tokenizer(self) -> Callable[[Sequence[str]], tuple[torch.Tensor, torch.Tensor]]:
        """`tokenize` without the family's models: picklable, for data-loader workers."""
        return functools.partial(tokenize_prompts, self.tokenizer, self.config)

    def encode_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PromptEmbeds:
        """Token ids → conditioning; differentiable, so pretraining can train the encoder with it."""
        if self.text_encoder is None:
            raise RuntimeError("this demo model was loaded without its text encoder")
        device = next(self.text_encoder.parameters()).device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        hidden = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        # Padding positions are zeroed: the transformer has no text mask, so they must carry nothing.
        hidden = hidden * attention_mask.unsqueeze(-1).to(hidden.dtype)
        if not self.config.glyph_grid:
            return PromptEmbeds(hidden, text_position_ids(hidden.shape[1], device=device))
        cells = glyph_grid_ids(self.config, device)
        prompt = text_position_ids(hidden.shape[1] - len(cells), device=device).float()
        return PromptEmbeds(hidden, torch.cat([cells, prompt]))

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        return self.encode_tokens(*self.tokenize(prompts))

    def prepare_ids(self, device=None) -> torch.Tensor:
        patch = self.config.patch_size
        return image_position_ids(self.config.height // patch, self.config.width // patch, device=device or self.device)

    def prepare_latents(self, generators, height, width) -> Latents:
        self.check_size(height, width)
        noise = randn_per_sample((len(generators), 3, height, width), generators, device=self.device)
        return Latents(patchify(noise, self.config.patch_size), self.prepare_ids())

    def check_condition_image_area(self) -> None:
        raise ModelLoadError("--condition-image-size: the demo model takes condition images at its own size "
                             f"({self.config.width}x{self.config.height})")

    def encode_condition_images(self, images) -> tuple[torch.Tensor, torch.Tensor]:
        """Condition images `uint8 [3, H, W]` at the model's size → their tokens `[1, S, 3·p·p]` and ids `[S, 4]`."""
        tokens, ids = [], []
        for i, image in enumerate(images):
            height, width = image.shape[1:]
            if (height, width) != (self.config.height, self.config.width):
                raise RequestError("image_path", f"image_path[{i}] is {width}x{height} pixels; the demo model "
                                                 "takes condition images of its own "
                                                 f"{self.config.width}x{self.config.height}")
            tokens.append(patchify((image.float() / 255 * 2 - 1)[None].to(self.device), self.config.patch_size))
            position = self.prepare_ids()
            position[:, 3] = -(i + 1)
            ids.append(position)
        return torch.cat(tokens, dim=1), torch.cat(ids)

    def condition_on_images(self, cond: PromptEmbeds, encoded: tuple[torch.Tensor, torch.Tensor]) -> PromptEmbeds:
        return fold_references(cond, encoded)

    def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
        """The same diffusers transformer class as flux3_image, with the condition images' tokens in its reference
        mode when the conditioning holds them."""
        cond, references = split_references(cond, self.config.in_channels, (self.text_length,))
        out = run_flux3_transformer(self, transformer, latents, sigma, cond, references)
        if self.config.prediction == "velocity":
            return out
        sigma = sigma.float().clamp(min=IMAGE_PREDICTION_MIN_SIGMA).view(-1, *(1,) * (out.dim() - 1))
        return (latents.tokens.float() - out) / sigma

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        images = unpatchify(latents.float(), height, width, self.config.patch_size)
        return ((images + 1) / 2).clamp(0, 1)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] → clean latents x0 (the inverse of `decode`, for flow-matching SFT)."""
        return patchify(images * 2 - 1, self.config.patch_size)
