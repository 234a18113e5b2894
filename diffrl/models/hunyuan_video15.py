"""The `hunyuan_video15` family: HunyuanVideo 1.5 text to video (diffusers' `HunyuanVideo15Pipeline`) and image to
video (`HunyuanVideo15ImageToVideoPipeline`).

A checkpoint is a local diffusers-format directory: `transformer/` (`HunyuanVideo15Transformer3DModel`), `vae/`
(`AutoencoderKLHunyuanVideo15`: 16× in space, 4× in time), `text_encoder/` (`Qwen2_5_VLTextModel`) and `tokenizer/`
(Qwen2's, with its chat template), `text_encoder_2/` (a ByT5 `T5EncoderModel`) and `tokenizer_2/` (`ByT5Tokenizer`),
`scheduler/` (`FlowMatchEulerDiscreteScheduler`) and `guider/` (`ClassifierFreeGuidance`: its scale is the family's
default CFG scale).

What this adapter reproduces of `HunyuanVideo15Pipeline` (`tests/test_hunyuan_video15.py`, ODE sampling from the
same noise, with and without CFG):
- conditioning: the pipeline's own encoders (its static `_get_mllm_prompt_embeds` and `_get_byt5_prompt_embeds`): the
  prompt in the system/user chat template, Qwen2.5-VL's third-to-last hidden state over `text_tokens` (1000) tokens
  after the template's first 108, with the tokenizer's mask; and the prompt's quoted texts (glyphs) through ByT5 over
  `glyph_tokens` (256), zeros and an empty mask when the prompt quotes nothing. One conditioning row holds both,
  each token followed by its mask value (`pack_text`), so a prompt and its negative share one CFG forward;
- latents `[B, 32, (F − 1)/4 + 1, H/16, W/16]`; every forward's input is the pipeline's text-to-video one: the
  latents, then zero condition latents and a zero mask on the channel axis, and `image_tokens` (729) zero image
  embeddings (the transformer masks them out); decoded as `latents / scaling_factor`, frames in [0, 1];
- the schedule is the scheduler's for `linspace(1, 0, N + 1)[:-1]` (its `shift`), the transformer's timestep σ·1000;
- CFG: `uncond + s·(cond − uncond)` (the guider's), on above 1; the negative prompt "" as the pipeline's default.

The token counts are the pipeline's (`text_tokens`, `glyph_tokens`, `image_tokens` in the `diffrl` block of
model_index.json may shorten them, as the tiny test checkpoints do; the reference pipeline is given the same).
The VAE decodes one video per call: diffusers' mid-block attention mask does not broadcast over a batch.

Image to video (a model index naming `HunyuanVideo15ImageToVideoPipeline`, which adds `image_encoder/`, a
`SiglipVisionModel`, and `feature_extractor/`, its `SiglipImageProcessor`; `tests/test_hunyuan_video15_i2v.py`) takes
one first frame per request (`image_path`) and refuses a request without one. As the pipeline: the image resized and
center-cropped to the video's size (its image processor's "crop" mode), then (a) SigLIP's last hidden state over it
(the image processor resizes it to the encoder's input), the image tokens every forward attends to, for the prompt
and the negative prompt alike, and (b) the VAE's mode of it as a one-frame video times `scaling_factor`, the
condition latents: every forward's input is the latents, the condition latents on the first latent frame (zero after
it) and a mask of ones on the first frame, on the channel axis. The video's size is the request's (default: the
16:9 bucket), where the pipeline takes the bucket nearest the image's aspect ratio; a request at that bucket is the
pipeline's. Both parts depend on the output's size, so the engine encodes them once per request at that size
(`condition_images_need_size`) and they travel inside the conditioning, as rows after the text tokens
(`diffrl.models.condition_rows`; on sglang's wire as `condition_rows`), for the trainer and replay to read unchanged.
Image tokens count the encoder's patches ((image_size / patch_size)², 729 for SigLIP at 384).

Not reproduced: a guider with rescale, another formulation or a step window (refused at load), and the MeanFlow
super-resolution transformers (`use_meanflow`, refused). Text-to-video checkpoints refuse `image_path`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.base import (
    Component,
    FamilyAdapter,
    Latents,
    PromptEmbeds,
    read_json,
    register_family,
    require_frame_multiple,
    require_pixel_multiple,
    wire_text_tokens,
)
from diffrl.models.batch_invariance import embed_rows_one_at_a_time
from diffrl.models.components import read_settings, refuse_scheduler_options, scheduler_sigmas
from diffrl.models.condition_rows import pack_image_rows, unpack_image_rows
from diffrl.models.vae_latents import decode_images, latent_noise

PIPELINE = "HunyuanVideo15Pipeline"
I2V_PIPELINE = "HunyuanVideo15ImageToVideoPipeline"
UNSUPPORTED_SCHEDULER_OPTIONS = ("stochastic_sampling", "invert_sigmas", "use_flow_sigmas", "use_dynamic_shifting")


@dataclass
class HunyuanVideo15Settings:
    """The `diffrl` block of model_index.json (the token counts, default: the pipeline's) and the guider's scale."""

    text_tokens: int = 1000  # the pipeline's tokenizer_max_length (Qwen2.5-VL tokens after the template)
    glyph_tokens: int = 256  # tokenizer_2_max_length (ByT5)
    image_tokens: int = 729  # vision_num_semantic_tokens (zero image embeddings); image to video: SigLIP's patches
    guidance_scale: float = 6.0  # the guider's (read from guider/guider_config.json)
    image_to_video: bool = False  # HunyuanVideo15ImageToVideoPipeline (read from the model index's class)


def _run_per_sample_layers_row_by_row(transformer) -> None:
    """Sample k bit-identical in any batch, on CPU (docs/architecture.md, "Rollout contract"): the layers whose matmul
    row count is the batch size run one distinct row at a time: the timestep MLP, every block's AdaLN modulations and
    the output's (their input is the timestep embedding alone), and the text refiner's timestep and pooled-text MLPs
    and its blocks' gates (their input differs per prompt), the latents' patch embedding and the ByT5 projection."""
    embed_rows_one_at_a_time(transformer.time_embed.timestep_embedder)
    refiner = transformer.context_embedder
    embed_rows_one_at_a_time(refiner.time_text_embed.timestep_embedder)
    embed_rows_one_at_a_time(refiner.time_text_embed.text_embedder, timestep=False)
    for block in refiner.token_refiner.refiner_blocks:
        embed_rows_one_at_a_time(block.norm_out.linear, timestep=False)
    for block in transformer.transformer_blocks:
        embed_rows_one_at_a_time(block.norm1.linear)
        embed_rows_one_at_a_time(block.norm1_context.linear)
    embed_rows_one_at_a_time(transformer.norm_out.linear)
    # Measured to round differently by batch size too, where a forward has few tokens per sample (a test's video): the
    # latents' patch embedding (a Conv3d) and the ByT5 projection (its 2,048-wide MLP over the glyph tokens).
    embed_rows_one_at_a_time(transformer.x_embedder, timestep=False)
    embed_rows_one_at_a_time(transformer.context_embedder_2, timestep=False)


def _run_per_sample_layers_row_by_row_i2v(transformer) -> None:
    """Image to video: the text-to-video layers, and the image tokens' projection too (its input, the first frame's
    SigLIP tokens, differs per request, and few tokens per sample round differently by batch size)."""
    _run_per_sample_layers_row_by_row(transformer)
    embed_rows_one_at_a_time(transformer.image_embedder, timestep=False)


def pack_text(text: torch.Tensor, mask: torch.Tensor, glyphs: torch.Tensor, glyph_mask: torch.Tensor) -> torch.Tensor:
    """One conditioning `[B, L + G, W + 1]`: the Qwen tokens `[B, L, D]` then the ByT5 tokens `[B, G, D2]`, each
    zero-padded to W = max(D, D2) and followed by its mask value (1 or 0)."""
    width = max(text.shape[-1], glyphs.shape[-1])

    def rows(tokens, keep):
        tokens = torch.nn.functional.pad(tokens.float(), (0, width - tokens.shape[-1]))
        return torch.cat([tokens, keep.to(tokens)[..., None]], dim=-1)

    return torch.cat([rows(text, mask), rows(glyphs, glyph_mask)], dim=1)


@register_family
class HunyuanVideo15Family(FamilyAdapter):
    name = "hunyuan_video15"
    name_patterns = ("hunyuanvideo-1.5", "hunyuanvideo1.5", "hunyuanvideo15", "hunyuan_video15", "hunyuan-video-1.5",
                     "hunyuan_video_1.5", "hunyuan_video1_5")
    display_name = "HunyuanVideo 1.5"
    generates_video = True
    default_num_frames = 121  # the pipeline's default
    default_num_inference_steps = 50  # the pipeline's default
    timestep_scale = 1000.0
    # The dual-stream blocks' joint attention, both streams (the text refiner's own attention shares the first four
    # names and is adapted too: peft matches by suffix).
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
    block_lists = ("transformer_blocks",)
    components = (
        Component("transformer", "diffusers:HunyuanVideo15Transformer3DModel"),
        Component("vae", "diffusers:AutoencoderKLHunyuanVideo15"),
        Component("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler", kind="scheduler"),
        Component("tokenizer", "transformers:AutoTokenizer", kind="tokenizer"),
        Component("text_encoder", "transformers:Qwen2_5_VLTextModel", text_encoder=True),
        Component("tokenizer_2", "transformers:ByT5Tokenizer", kind="tokenizer"),
        Component("text_encoder_2", "transformers:T5EncoderModel", text_encoder=True),
    )
    # Image to video adds these (`checkpoint_components`): the first frame's encoder, left out with the text encoders.
    image_components = (
        Component("image_encoder", "transformers:SiglipVisionModel", text_encoder=True),
        Component("feature_extractor", "transformers:SiglipImageProcessor", kind="tokenizer",
                  config_file="preprocessor_config.json", text_encoder=True),
    )
    settings_class = HunyuanVideo15Settings
    model_index_required = True

    def __init__(self, transformer, vae, scheduler, tokenizer, text_encoder, tokenizer_2, text_encoder_2,
                 image_encoder=None, feature_extractor=None, *, settings: HunyuanVideo15Settings | None = None):
        settings = settings or HunyuanVideo15Settings()
        config = transformer.config
        latent = vae.config.latent_channels
        if config.use_meanflow:
            raise ModelLoadError("hunyuan_video15: this transformer uses MeanFlow (a super-resolution model); the family "
                                 "samples the text-to-video transformer")
        if config.in_channels != 2 * latent + 1 or config.out_channels != latent:
            raise ModelLoadError(f"hunyuan_video15: the transformer takes {config.in_channels} channels and makes "
                                 f"{config.out_channels}; with the VAE's {latent} latent channels the pipeline gives it "
                                 f"{2 * latent + 1} (latents, condition latents, mask) and reads {latent}")
        for encoder, width, name in ((text_encoder, config.text_embed_dim, "text_encoder"),
                                     (text_encoder_2, config.text_embed_2_dim, "text_encoder_2")):
            hidden = None if encoder is None else getattr(encoder.config, "hidden_size", None) or encoder.config.d_model
            if hidden is not None and hidden != width:
                raise ModelLoadError(f"hunyuan_video15: {name} is {hidden} wide, the transformer reads {width}")
        if image_encoder is not None and image_encoder.config.hidden_size != config.image_embed_dim:
            raise ModelLoadError(f"hunyuan_video15: image_encoder is {image_encoder.config.hidden_size} wide, the "
                                 f"transformer reads {config.image_embed_dim}")
        refuse_scheduler_options(self.name, scheduler, UNSUPPORTED_SCHEDULER_OPTIONS)
        i2v = settings.image_to_video
        self.adopt_components(transformer, _run_per_sample_layers_row_by_row_i2v if i2v else
                              _run_per_sample_layers_row_by_row, vae=vae, scheduler=scheduler, tokenizer=tokenizer,
                              text_encoder=text_encoder, tokenizer_2=tokenizer_2, text_encoder_2=text_encoder_2,
                              image_encoder=image_encoder, feature_extractor=feature_extractor, settings=settings)
        self.text_encoders = [text_encoder, text_encoder_2, image_encoder]
        # Image to video: one first frame per request, required; encoded at the output's size (module docstring).
        self.accepts_image_conditioning = self.requires_image_conditioning = i2v
        self.condition_images_need_size = i2v
        self.max_condition_images = 1 if i2v else 0
        self.default_guidance_scale = settings.guidance_scale
        self.vae_scale_spatial = vae.spatial_compression_ratio
        self.vae_scale_temporal = vae.temporal_compression_ratio
        self.pixels_per_token = self.vae_scale_spatial * config.patch_size

    @classmethod
    def read_settings(cls, root: Path, index: dict) -> HunyuanVideo15Settings:
        pipeline = index.get("_class_name", PIPELINE)
        if pipeline not in (PIPELINE, I2V_PIPELINE):
            raise ModelLoadError(f"hunyuan_video15: {root} is a {pipeline} checkpoint; the family samples text to video "
                                 f"({PIPELINE}) and image to video ({I2V_PIPELINE})")
        image_to_video = pipeline == I2V_PIPELINE
        guider_file = root / "guider" / "guider_config.json"
        guider = read_json(guider_file) if guider_file.is_file() else {}
        if guider.get("_class_name", "ClassifierFreeGuidance") != "ClassifierFreeGuidance" or guider.get(
                "guidance_rescale", 0.0) or guider.get("use_original_formulation") or (
                guider.get("start", 0.0), guider.get("stop", 1.0)) != (0.0, 1.0):
            raise ModelLoadError(f"hunyuan_video15: {guider_file} is not plain CFG over every step (rescale, another "
                                 "formulation or a step window), which the family does not reproduce")
        scale = float(guider.get("guidance_scale", 6.0)) if guider.get("enabled", True) else 1.0
        values = dict(guidance_scale=scale, image_to_video=image_to_video)
        if image_to_video:  # the image tokens are the encoder's patches (a config it lacks is named at load)
            encoder_file = root / "image_encoder" / "config.json"
            if encoder_file.is_file():
                encoder = read_json(encoder_file)
                values["image_tokens"] = (encoder.get("image_size", 224) // encoder.get("patch_size", 16)) ** 2
        settings = read_settings(HunyuanVideo15Settings, index, root / "model_index.json", **values)
        if settings.image_to_video != image_to_video:
            raise ModelLoadError(f"{root / 'model_index.json'}: the 'diffrl' block's image_to_video contradicts the "
                                 f"pipeline class {pipeline}")
        if image_to_video and "image_tokens" in values and settings.image_tokens != values["image_tokens"]:
            raise ModelLoadError(f"{root / 'model_index.json'}: image_tokens={settings.image_tokens}, but the image "
                                 f"encoder makes {values['image_tokens']} (its (image_size / patch_size)²)")
        if min(settings.text_tokens, settings.glyph_tokens, settings.image_tokens) < 1:
            raise ModelLoadError(f"{root / 'model_index.json'}: text_tokens, glyph_tokens and image_tokens must be "
                                 "positive")
        return settings

    @classmethod
    def checkpoint_components(cls, settings: HunyuanVideo15Settings) -> list[Component]:
        return [*cls.components, *(cls.image_components if settings.image_to_video else ())]

    def reference_pipeline(self):
        """diffusers' `HunyuanVideo15Pipeline` (image to video: `HunyuanVideo15ImageToVideoPipeline`, called with
        `image=`) over this family's components (a copy of the scheduler, whose state sampling changes), with the
        checkpoint's token counts. Its CFG scale lives in its guider: the call takes `guidance_scale` and sets the
        guider. `num_videos_per_prompt` repeats the prompts instead (the pipeline's zero image embeddings have one row
        per prompt, not per video), and the VAE decodes one video at a time."""
        from diffusers import ClassifierFreeGuidance, HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

        base = HunyuanVideo15ImageToVideoPipeline if self.settings.image_to_video else HunyuanVideo15Pipeline

        class Reference(base):
            def __call__(self, prompt=None, negative_prompt=None, *, guidance_scale: float | None = None,
                         num_videos_per_prompt: int = 1, **kwargs):
                if guidance_scale is not None:
                    self.guider = ClassifierFreeGuidance(guidance_scale=guidance_scale)
                prompts = [prompt] if isinstance(prompt, str) else prompt
                if num_videos_per_prompt > 1 and prompts is not None:
                    prompts = [p for p in prompts for _ in range(num_videos_per_prompt)]
                    if negative_prompt is not None:
                        negatives = [negative_prompt] if isinstance(negative_prompt, str) else negative_prompt
                        negative_prompt = [p for p in negatives for _ in range(num_videos_per_prompt)]
                return super().__call__(prompt=prompts, negative_prompt=negative_prompt, **kwargs)

        images = ({"image_encoder": self.image_encoder, "feature_extractor": self.feature_extractor}
                  if self.settings.image_to_video else {})
        pipe = Reference(text_encoder=self.text_encoder, tokenizer=self.tokenizer, transformer=self.transformer,
                         vae=self.vae, scheduler=copy.deepcopy(self.scheduler), text_encoder_2=self.text_encoder_2,
                         tokenizer_2=self.tokenizer_2,
                         guider=ClassifierFreeGuidance(guidance_scale=self.default_guidance_scale), **images)
        pipe.tokenizer_max_length = self.settings.text_tokens
        pipe.tokenizer_2_max_length = self.settings.glyph_tokens
        pipe.vision_num_semantic_tokens = self.settings.image_tokens
        pipe.vae.enable_slicing()
        pipe.set_progress_bar_config(disable=True)
        return pipe

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        """The pipeline's: the 16:9 bucket nearest the transformer's `target_size` (480 × 848 at 640)."""
        from diffusers.pipelines.hunyuan_video1_5.image_processor import generate_crop_size_list, get_closest_ratio

        sizes = generate_crop_size_list(base_size=self.transformer.config.target_size,
                                        patch_size=self.vae_scale_spatial)
        ratios = np.array([round(float(h) / float(w), 5) for h, w in sizes])
        height, width = get_closest_ratio(9, 16, ratios, sizes)[0]
        return int(height), int(width)

    def _latent_frames(self, num_frames: int | None) -> int:
        return ((self.default_num_frames if num_frames is None else num_frames) - 1) // self.vae_scale_temporal + 1

    def check_size(self, height: int, width: int, num_frames: int | None = None) -> None:
        require_pixel_multiple("HunyuanVideo 1.5", self.pixels_per_token, height=height, width=width)
        if num_frames is not None:
            require_frame_multiple("HunyuanVideo 1.5", self.vae_scale_temporal, num_frames)

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> torch.Tensor:
        scheduler = copy.deepcopy(self.scheduler)  # set_timesteps changes the scheduler's state
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1], device="cpu")  # the pipeline's
        return scheduler_sigmas(self.name, scheduler, num_steps, self.device)

    # ---------------------------------------------------------------- conditioning
    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """Each prompt on its own (its conditioning never depends on the prompts beside it), by the pipeline's
        encoders, packed by `pack_text`."""
        from diffusers import HunyuanVideo15Pipeline

        if self.text_encoder is None or self.text_encoder_2 is None:
            raise RuntimeError("this HunyuanVideo 1.5 model was loaded without its text encoders")
        rows = []
        for prompt in prompts:
            text, mask = HunyuanVideo15Pipeline._get_mllm_prompt_embeds(
                self.text_encoder, self.tokenizer, [prompt], self.text_encoder.device,
                tokenizer_max_length=self.settings.text_tokens)
            glyphs, glyph_mask = HunyuanVideo15Pipeline._get_byt5_prompt_embeds(
                self.tokenizer_2, self.text_encoder_2, [prompt], self.text_encoder_2.device,
                tokenizer_max_length=self.settings.glyph_tokens)
            rows.append(pack_text(text, mask, glyphs.to(text.device), glyph_mask.to(text.device)))
        embeds = torch.cat(rows).to(self.device)
        return PromptEmbeds(embeds, torch.zeros(embeds.shape[1], 1, device=embeds.device))

    @property
    def _text_rows(self) -> int:
        """The rows of a conditioning the two text encoders fill; image to video's condition rows follow."""
        return self.settings.text_tokens + self.settings.glyph_tokens

    def unpack_text(self, embeds: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(Qwen tokens, their mask, ByT5 tokens, their mask) of a packed conditioning, as the transformer reads them."""
        config, length = self.transformer.config, self.settings.text_tokens
        text, glyphs = embeds[:, :length], embeds[:, length:self._text_rows]
        return (text[..., :config.text_embed_dim], text[..., -1], glyphs[..., :config.text_embed_2_dim],
                glyphs[..., -1])

    def cond_kwargs_to_wire(self, cond: PromptEmbeds, image_ids: torch.Tensor) -> dict:
        """The transformer's own keywords for one prompt: both encoders' tokens and masks. Image to video: the first
        frame's packed condition rows as diffrl's `condition_rows` [R, D] (the forward unpacks them)."""
        text, mask, glyphs, glyph_mask = (part[0] for part in self.unpack_text(cond.embeds[:1]))
        wire = {"encoder_hidden_states": [text], "encoder_attention_mask": mask,
                "encoder_hidden_states_2": glyphs, "encoder_attention_mask_2": glyph_mask}
        if cond.embeds.shape[1] > self._text_rows:
            wire["condition_rows"] = cond.embeds[0, self._text_rows:]
        return wire

    @classmethod
    def cond_kwargs_from_wire(cls, kwargs: dict) -> tuple[PromptEmbeds, torch.Tensor | None]:
        text, glyphs = wire_text_tokens(kwargs), kwargs.get("encoder_hidden_states_2")
        mask, glyph_mask = kwargs.get("encoder_attention_mask"), kwargs.get("encoder_attention_mask_2")
        if not all(isinstance(t, torch.Tensor) for t in (glyphs, mask, glyph_mask)):
            raise ValueError("HunyuanVideo 1.5 cond kwargs need encoder_hidden_states_2 and both attention masks")
        if mask.shape != text.shape[:1] or glyphs.dim() != 2 or glyph_mask.shape != glyphs.shape[:1]:
            raise ValueError("HunyuanVideo 1.5 cond kwargs: each attention mask needs one value per token")
        embeds = pack_text(text[None], mask[None], glyphs[None].float(), glyph_mask[None])
        rows = kwargs.get("condition_rows")
        if rows is not None:
            if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[1] != embeds.shape[-1]:
                raise ValueError(f"condition_rows: expected [R, {embeds.shape[-1]}] rows as wide as the packed text")
            embeds = torch.cat([embeds, rows.float()[None]], dim=1)
        return PromptEmbeds(embeds, torch.zeros(embeds.shape[1], 1)), torch.zeros(0, 1)

    # ---------------------------------------------------------------- image to video
    @torch.no_grad()
    def encode_condition_images(self, images, height: int | None = None, width: int | None = None,
                                num_frames: int | None = None) -> torch.Tensor:
        """The first frame (`uint8 [3, H, W]`) as `HunyuanVideo15ImageToVideoPipeline` encodes its `image`, by its own
        static encoders: resized and center-cropped to `height × width`, SigLIP's tokens `[N, D]` and the VAE's
        condition latents `[C, 1, H', W']`, flattened into one `[1, N·D + C·H'·W']` (`num_frames` is not needed: the
        condition is the first latent frame's)."""
        from diffusers import HunyuanVideo15ImageToVideoPipeline as I2V
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor
        from PIL import Image

        if not self.settings.image_to_video or len(images) != 1:
            raise RequestError("image_path", f"this HunyuanVideo 1.5 checkpoint takes {self.max_condition_images} "
                                             f"condition images, got {len(images)}")
        if self.image_encoder is None or self.feature_extractor is None:
            raise RuntimeError("this HunyuanVideo 1.5 image-to-video model was loaded without its image encoder")
        if height is None or width is None:
            height, width = self.default_size()
        self.check_size(height, width)
        processor = HunyuanVideo15ImageProcessor(vae_scale_factor=self.vae_scale_spatial, do_resize=False,
                                                 do_convert_rgb=True)  # the pipeline's video processor
        image = Image.fromarray(images[0].permute(1, 2, 0).cpu().numpy())
        image = processor.resize(image, height=height, width=width, resize_mode="crop")
        tokens = I2V._get_image_embeds(self.image_encoder, self.feature_extractor, image, self.image_encoder.device)
        latents = I2V._get_image_latents(self.vae, processor, image, height, width, self.device)
        if tokens.shape[1:] != (self.settings.image_tokens, self.transformer.config.image_embed_dim):
            raise RuntimeError(f"the image encoder made {tuple(tokens.shape[1:])} tokens, the checkpoint's settings "
                               f"say {self.settings.image_tokens} of {self.transformer.config.image_embed_dim}")
        return torch.cat([tokens.float().flatten(), latents.float().to(tokens.device).flatten()])[None]

    def condition_on_images(self, cond: PromptEmbeds, encoded: torch.Tensor) -> PromptEmbeds:
        """The first frame's values laid into rows after the text tokens (`pack_image_rows`), with an id per row, so
        that the engine batches only conditionings of one layout."""
        rows = pack_image_rows(encoded.reshape(1, 1, -1).to(cond.embeds), cond.embeds.shape[-1])
        return PromptEmbeds(torch.cat([cond.embeds, rows.expand(len(cond), -1, -1)], dim=1),
                            torch.cat([cond.ids, cond.ids.new_zeros(rows.shape[1], cond.ids.shape[1])]))

    def unpack_first_frame(self, embeds: torch.Tensor, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Image to video: (SigLIP's tokens `[B, N, D]`, the first frame's latents `[B, C, 1, H', W']`) carried in a
        conditioning, for latents `[B, C, F', H', W']`; a RequestError when it carries none."""
        rows = embeds[:, self._text_rows:]
        if not rows.shape[1]:
            raise RequestError("image_path", "this HunyuanVideo 1.5 checkpoint is image to video: a request needs one "
                                             "condition image (image_path), the first frame")
        count, width = self.settings.image_tokens, self.transformer.config.image_embed_dim
        batch, channels, _, height, width_latent = latents.shape
        values = unpack_image_rows(rows, 1, count * width + channels * height * width_latent)[:, 0]
        return (values[:, : count * width].view(batch, count, width),
                values[:, count * width :].view(batch, channels, 1, height, width_latent))

    # ---------------------------------------------------------------- sampling
    def prepare_latents(self, generators, height, width, num_frames: int | None = None) -> Latents:
        self.check_size(height, width, self.default_num_frames if num_frames is None else num_frames)
        shape = (self.vae.config.latent_channels, self._latent_frames(num_frames),
                 height // self.vae_scale_spatial, width // self.vae_scale_spatial)
        return latent_noise(generators, shape, self.device)

    def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
        dtype = next(transformer.parameters()).dtype
        x = latents.tokens.to(dtype)
        batch, channels, frames, height, width = x.shape
        if self.settings.image_to_video:
            # The pipeline's input: the latents, the first frame's latents (zero after it), a mask of ones on the
            # first latent frame; SigLIP's tokens for the image embeddings.
            images, first = (part.to(dtype) for part in self.unpack_first_frame(cond.embeds, x))
            mask = x.new_zeros(batch, 1, frames, height, width)
            mask[:, :, 0] = 1
            given = torch.cat([first, x.new_zeros(batch, channels, frames - 1, height, width)], dim=2)
            hidden = torch.cat([x, given, mask], dim=1)
        else:
            # Text to video: zero condition latents and a zero mask after the latents, zero image embeddings.
            hidden = torch.cat([x, x.new_zeros(batch, channels + 1, frames, height, width)], dim=1)
            images = x.new_zeros(batch, self.settings.image_tokens, self.transformer.config.image_embed_dim)
        text, mask, glyphs, glyph_mask = (part.to(dtype) for part in self.unpack_text(cond.embeds))
        timestep = self.model_timesteps(sigma).to(dtype)  # the pipeline's t (σ·1000) in the latents' dtype
        with self.forward_precision():
            out = transformer(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text,
                              encoder_attention_mask=mask, encoder_hidden_states_2=glyphs,
                              encoder_attention_mask_2=glyph_mask, image_embeds=images, return_dict=False)[0]
        return out.float()

    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int | None = None) -> torch.Tensor:
        """Latents → videos `[B, 3, F, H, W]` in [0, 1], one video per VAE call (see the module docstring)."""
        vae_dtype = next(self.vae.parameters()).dtype
        latents = latents.to(vae_dtype) / self.vae.config.scaling_factor  # the pipeline's arithmetic, in the VAE's dtype
        return decode_images(self.vae, latents, per_call=1)
