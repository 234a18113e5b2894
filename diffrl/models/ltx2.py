"""The `ltx2` family: LTX-2 and LTX-2.3 text to video (diffusers' `LTX2Pipeline`) and image to video
(`LTX2ImageToVideoPipeline`), video out, no audio out.

A checkpoint is a local diffusers-format directory as `LTX2Pipeline.save_pretrained` writes it: `transformer/`
(`LTX2VideoTransformer3DModel`), `connectors/` (`LTX2TextConnectors`), `vae/` (`AutoencoderKLLTX2Video`),
`audio_vae/` (only its config is read), `text_encoder/` (Gemma 3), `tokenizer/`, `scheduler/`
(`FlowMatchEulerDiscreteScheduler`), and `model_index.json`, whose `diffrl` block may set `Ltx2Settings`.

Audio. LTX-2 is a joint audio-video model: its transformer denoises audio latents beside the video ones, and
each stream attends to the other in every block, so the video the pipeline makes depends on the audio being
denoised with it. This adapter keeps that: the latent state is the pipeline's packed video tokens followed by
its packed audio tokens (`[B, S_video + S_audio, C]`, which needs an audio token as wide as a video token, 128
in LTX-2 and LTX-2.3), both start from the same output's generator (video noise first, as the pipeline draws
it), and every step (ODE, SDE, CPS) moves both, as the pipeline's scheduler does. Only the video is decoded;
the audio track is never produced (there is no request field for it) and a log-prob covers both streams. The
published LTX-2.3 GRPO runs (miles-diffusion) train video-only instead, with the audio-video cross-attention
switched off in rollout and training; that variant is not the pipeline's model and is not offered here.

What this adapter reproduces of `LTX2Pipeline` (`tests/test_ltx2.py`, ODE sampling from the same noise):
- conditioning: the prompt stripped, left-padded to `max_sequence_length` tokens (1,024), every Gemma layer's
  hidden states stacked, then the connectors: the video and audio text tokens side by side in one tensor; the
  text mask is the connectors' (they zero the video text tokens they mask; diffusers' mask no token, and a
  mask that masks nothing is not passed to the transformer);
- the schedule: `linspace(1, 1/N, N)` through the scheduler with μ from the number of video tokens (the
  pipeline's base/max shift defaults 0.95/2.05 at 1,024/4,096 tokens unless the scheduler sets them), the
  transformer's timestep and σ both σ·1000; positions from the transformer's own rotary helpers at the
  checkpoint's frame rate (24 fps), carried as the video tokens' position ids (`Latents.ids`, `[S_video, 6]`:
  start and end in time, height, width); the audio tokens' positions follow from their count;
- CFG as the pipeline combines it: in x0 space, `x0 = x − σ·v`, `x0_cond + (s − 1)·(x0_cond − x0_uncond)`, back
  to a velocity, with one scale for video and audio (the pipeline's `audio_guidance_scale=None`); without CFG a
  single conditional forward. Not reproduced: the pipeline's spatio-temporal guidance, modality-isolation
  guidance and guidance rescale (its defaults turn them on; `stg_scale=0`, `modality_scale=1`,
  `guidance_rescale=0` is what this adapter is);
- decoding: the video tokens unpacked, `latents · std / scaling_factor + mean` per channel, the VAE at decode
  timestep 0, frames in [0, 1], `[B, 3, F, H, W]`.

Image to video (`tests/test_ltx2_i2v.py`). A request with one condition image (the first frame) is image to video
on any LTX-2 checkpoint (the same weights do both); a checkpoint whose model index names
`LTX2ImageToVideoPipeline` (or whose `diffrl` block sets `image_to_video: true`) needs the image. As the
pipeline: the image resized to the video's height and width (PIL, bilinear;
the engine encodes it per request at the output's size, `condition_images_need_size`), in [-1, 1], through the
VAE as a one-frame video (its mode), normalized by the VAE's latent mean and std, is the first latent frame,
clean; the transformer sees it at timestep 0 (per-token timesteps `t·(1 − mask)`), the audio and σ at the step's t;
the first frame's velocity is dropped and only the later frames (and the audio) are stepped. Here the first
frame's tokens ride in the conditioning (rows after the text, each token zero-padded to whole rows; the sglang wire
carries them as `condition_latents`), and the latent state holds only the generated tokens: the video after the
first frame, then the audio (the noise is still drawn for the whole video, as the pipeline draws it, and the first
frame's dropped). So every step kind (ODE, SDE, CPS) moves only generated tokens and a log-prob, the mean over the
state's elements, counts only them, with no change to the sampling math; the trainer and replay get the first frame
from the denoising env's conditioning. `decode` puts the first frame back before the generated tokens (given, or
the conditioning last denoised). Not reproduced: the pipeline's H.264 re-compression of the image (`image_crf`;
this is `image_crf=0`).

Refused: distilled checkpoints (a `distill` in the directory name or the model index: their fixed 8-step
schedule is not the pipeline's default one), schedulers other than FlowMatchEulerDiscrete, and more than one
condition image.
The frame rate is the checkpoint's setting (`frame_rate`): a request's `fps` must equal it (the engine refuses
another, which would move the rotary positions).
"""

from __future__ import annotations

import copy
import math
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
from diffrl.models.batch_invariance import decode_rows
from diffrl.models.condition_rows import pack_image_rows
from diffrl.models.components import read_settings, scheduler_sigmas
from diffrl.sampling import randn_per_sample, resolution_mu


@dataclass
class Ltx2Settings:
    """Per-checkpoint values (the `diffrl` block of model_index.json); the defaults are the pipeline's."""

    max_sequence_length: int = 1024
    frame_rate: float = 24.0
    default_num_frames: int = 121
    default_height: int = 512
    default_width: int = 768
    # Image to video only (`LTX2ImageToVideoPipeline`: every request needs its first frame): set from the model
    # index's pipeline class, or here. Any checkpoint does image to video for a request with an image.
    image_to_video: bool = False


@dataclass(frozen=True)
class Geometry:
    """One video size in latents: frames, height and width of the video latents, the audio latent frames, and
    the number of video tokens."""

    frames: int
    height: int
    width: int
    audio_frames: int
    video_tokens: int


def _load_text_encoder(folder: Path, dtype: torch.dtype):
    """The transformers class the config names (Gemma 3 for LTX-2 and LTX-2.3)."""
    import transformers

    names = read_json(folder / "config.json").get("architectures") or ["Gemma3ForConditionalGeneration"]
    cls = getattr(transformers, names[0], None)
    if cls is None:
        raise ModelLoadError(f"{folder / 'config.json'}: unknown text encoder class {names[0]!r}")
    return cls.from_pretrained(str(folder), dtype=dtype, local_files_only=True)


def _load_connectors(folder: Path, dtype: torch.dtype):
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    return LTX2TextConnectors.from_pretrained(folder, torch_dtype=dtype, local_files_only=True)


def _audio_vae_config(folder: Path, dtype: torch.dtype) -> dict:
    """Only the audio VAE's config: it sizes the audio latents, which are never decoded."""
    return read_json(folder / "config.json")


@register_family
class Ltx2Family(FamilyAdapter):
    name = "ltx2"
    name_patterns = ("ltx-2", "ltx2", "ltx_2")
    display_name = "LTX-2"
    generates_video = True
    default_guidance_scale = 3.0  # the pipeline's video guidance_scale
    default_num_inference_steps = 30  # diffusers' LTX2Pipeline and sglang-diffusion's LTX-2.3 default
    timestep_scale = 1000.0
    # Every attention's projections and every feed-forward (video and audio streams; peft matches by suffix).
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2")
    block_lists = ("transformer_blocks",)
    components = (
        Component("transformer", "diffusers:LTX2VideoTransformer3DModel"),
        Component("vae", "diffusers:AutoencoderKLLTX2Video"),
        Component("audio_vae", _audio_vae_config),
        Component("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler", kind="scheduler"),
        Component("tokenizer", "transformers:AutoTokenizer", kind="tokenizer"),
        Component("text_encoder", _load_text_encoder, text_encoder=True),
        Component("connectors", _load_connectors, text_encoder=True),
    )
    settings_class = Ltx2Settings
    model_index_required = True

    def __init__(self, transformer, vae, audio_vae: dict, scheduler, tokenizer, text_encoder, connectors, *,
                 settings: Ltx2Settings | None = None):
        from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import (
            LATENT_DOWNSAMPLE_FACTOR,
        )

        self.settings = settings = settings or Ltx2Settings()
        self.transformer = transformer
        self.vae, self.scheduler, self.tokenizer = vae, scheduler, tokenizer
        self.text_encoder, self.connectors = text_encoder, connectors
        self.text_encoders = [m for m in (text_encoder, connectors) if m is not None]  # offloaded together
        # The pipeline pads Gemma's prompts on the left, with EOS when the tokenizer has no pad token.
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.default_num_frames = settings.default_num_frames
        # Image to video: a request's one condition image is the first frame (module docstring, "Image to video"),
        # resized to the video's size; the latent state then leaves the first frame out.
        self.accepts_image_conditioning = True
        self.requires_image_conditioning = settings.image_to_video
        self.max_condition_images = 1
        self.condition_images_need_size = True
        self.latents_need_conditioning = True
        self.frame_rate = settings.frame_rate
        config = transformer.config
        self.patch, self.patch_t = config.patch_size, config.patch_size_t
        self.spatial_ratio = vae.spatial_compression_ratio
        self.temporal_ratio = vae.temporal_compression_ratio
        # The audio latents, as the pipeline sizes them from the audio VAE's config (its ratios are constants).
        self.audio_channels = audio_vae.get("latent_channels", 8)
        self.audio_mel_bins = audio_vae.get("mel_bins", 64) // LATENT_DOWNSAMPLE_FACTOR
        self.audio_per_second = (audio_vae.get("sample_rate", 16000) / audio_vae.get("mel_hop_length", 160)
                                 / float(LATENT_DOWNSAMPLE_FACTOR))

    @classmethod
    def read_settings(cls, root: Path, index: dict) -> Ltx2Settings:
        index_file = root / "model_index.json"
        named = f"{root.resolve().name} {index.get('_name_or_path', '')}".lower()
        if "distill" in named:
            raise ModelLoadError(f"ltx2: {root} is a distilled LTX-2 checkpoint (a fixed few-step schedule without "
                                 "CFG), which this adapter does not reproduce; use the full (dev) checkpoint")
        scheduler = (index.get("scheduler") or [None, None])[-1]
        if scheduler != "FlowMatchEulerDiscreteScheduler":
            raise ModelLoadError(f"ltx2: scheduler {scheduler!r} in {index_file}; LTX2Pipeline's is "
                                 "FlowMatchEulerDiscreteScheduler")
        settings = read_settings(Ltx2Settings, index, index_file,
                                 image_to_video=index.get("_class_name") == "LTX2ImageToVideoPipeline")
        if settings.max_sequence_length < 1 or settings.frame_rate <= 0 or settings.default_num_frames < 1:
            raise ModelLoadError(f"{index_file}: max_sequence_length, frame_rate and default_num_frames must be "
                                 "positive")
        return settings

    @classmethod
    def from_components(cls, root, parts, settings: Ltx2Settings) -> Ltx2Family:
        family = cls(**parts, settings=settings)
        family.root = Path(root)  # the reference pipeline loads the audio parts from here
        config = family.transformer.config
        video_width = config.in_channels
        audio_width = family.audio_channels * family.audio_mel_bins
        if audio_width != config.audio_in_channels or audio_width != video_width:
            raise ModelLoadError(f"ltx2: {root}: an audio token is {audio_width} wide (audio_vae: "
                                 f"{family.audio_channels} channels × {family.audio_mel_bins} mel bins), the "
                                 f"transformer takes {config.audio_in_channels} and a video token is {video_width}; "
                                 "this adapter carries both streams in one tensor and needs them equal")
        if settings.image_to_video and config.patch_size_t != 1:
            raise ModelLoadError(f"ltx2: {root}: image to video needs a temporal patch of 1 (the first latent frame "
                                 f"is its own tokens); the transformer's is {config.patch_size_t}")
        return family

    def reference_pipeline(self, image_to_video: bool | None = None):
        """diffusers' `LTX2Pipeline` (`LTX2ImageToVideoPipeline` for image to video; default: the checkpoint's
        mode) over this family's components; the audio VAE and the vocoder (which only its audio output needs)
        are loaded from the checkpoint for it."""
        from diffusers import AutoencoderKLLTX2Audio, LTX2ImageToVideoPipeline, LTX2Pipeline
        from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

        root, dtype = self.root, next(self.transformer.parameters()).dtype
        audio_vae = AutoencoderKLLTX2Audio.from_pretrained(root / "audio_vae", torch_dtype=dtype,
                                                           local_files_only=True).to(self.device)
        vocoder = LTX2Vocoder.from_pretrained(root / "vocoder", torch_dtype=dtype, local_files_only=True)
        vocoder.to(self.device)
        image_to_video = self.settings.image_to_video if image_to_video is None else image_to_video
        pipeline_class = LTX2ImageToVideoPipeline if image_to_video else LTX2Pipeline
        pipe = pipeline_class(scheduler=self.scheduler, vae=self.vae, audio_vae=audio_vae,
                              text_encoder=self.text_encoder, tokenizer=self.tokenizer, connectors=self.connectors,
                              transformer=self.transformer, vocoder=vocoder)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    # ---------------------------------------------------------------- sizes
    def default_size(self) -> tuple[int, int]:
        return self.settings.default_height, self.settings.default_width

    def _frames(self, num_frames: int | None) -> int:
        return self.default_num_frames if num_frames is None else num_frames

    def geometry(self, height: int, width: int, num_frames: int | None = None) -> Geometry:
        frames = self._frames(num_frames)
        latent_frames = (frames - 1) // self.temporal_ratio + 1
        h, w = height // self.spatial_ratio, width // self.spatial_ratio
        audio_frames = round(frames / self.settings.frame_rate * self.audio_per_second)
        tokens = (latent_frames // self.patch_t) * (h // self.patch) * (w // self.patch)
        return Geometry(latent_frames, h, w, audio_frames, tokens)

    def check_size(self, height: int, width: int, num_frames: int | None = None) -> None:
        # The pipeline asks for multiples of 32; a latent must also fill whole patches.
        require_pixel_multiple("LTX-2", math.lcm(32, self.spatial_ratio * self.patch), height=height, width=width)
        # A decoder that pads by reflection (diffusers' default for this VAE) cannot pad a latent side of 1: the
        # request would fail in the decode, after all its steps, as a 500 instead of a refusal.
        if self.vae.config.get("decoder_spatial_padding_mode", "zeros") == "reflect":
            for name, value in (("height", height), ("width", width)):
                if value // self.spatial_ratio < 2:
                    raise RequestError(name, f"{name}={value}: this checkpoint's VAE decoder pads by reflection and "
                                             f"needs at least {2 * self.spatial_ratio} pixels")
        if num_frames is not None:
            t = self.temporal_ratio
            require_frame_multiple("LTX-2", t, num_frames)
            if ((num_frames - 1) // t + 1) % self.patch_t:
                raise RequestError("num_frames", f"num_frames={num_frames}: the latent frames do not fill the "
                                                 f"temporal patch {self.patch_t}")

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> torch.Tensor:
        """The pipeline's schedule: its σ grid through the scheduler, shifted by μ of the video token count."""
        config = self.scheduler.config
        mu = resolution_mu(self.geometry(height, width, num_frames).video_tokens,
                           config.get("base_image_seq_len", 1024), config.get("max_image_seq_len", 4096),
                           config.get("base_shift", 0.95), config.get("max_shift", 2.05))
        scheduler = copy.deepcopy(self.scheduler)  # set_timesteps changes the scheduler's state
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu, device="cpu")
        return scheduler_sigmas("ltx2", scheduler, num_steps, self.device)

    # ---------------------------------------------------------------- conditioning
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        if self.text_encoder is None or self.connectors is None:
            raise RuntimeError("this LTX-2 model was loaded without its text encoder")
        length = self.settings.max_sequence_length
        tokens = self.tokenizer([p.strip() for p in prompts], padding="max_length", max_length=length,
                                truncation=True, add_special_tokens=True, return_tensors="pt")
        device = self.text_encoder.device
        mask = tokens.attention_mask.to(device)
        out = self.text_encoder(input_ids=tokens.input_ids.to(device), attention_mask=mask, output_hidden_states=True)
        layers = torch.stack(out.hidden_states, dim=-1).flatten(2, 3).to(self.text_encoder.dtype)
        video, audio, _ = self.connectors(layers, mask, padding_side="left")
        return PromptEmbeds(torch.cat([video, audio], dim=-1).float(), torch.zeros(length, 1, device=video.device))

    def unpack_conditioning(self, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(video text tokens, audio text tokens, text mask) of `PromptEmbeds.embeds`. The mask is the connectors':
        the video text tokens they did not zero (they zero those they mask; diffusers' connectors mask none).
        Rows past the text's (image to video: the first frame's tokens) are not text."""
        width = self.transformer.config.cross_attention_dim
        embeds = embeds[..., : self.settings.max_sequence_length, :]
        video, audio = embeds[..., :width], embeds[..., width:]
        return video, audio, (video != 0).any(dim=-1).long()

    def cond_kwargs_to_wire(self, cond: PromptEmbeds, image_ids: torch.Tensor) -> dict:
        """The transformer's own names: both streams' text tokens (one-element lists, as sglang sends them), the
        text mask, and the video tokens' positions."""
        video, audio, mask = self.unpack_conditioning(cond.embeds[0])
        wire = {"encoder_hidden_states": [video], "audio_encoder_hidden_states": [audio],
                "encoder_attention_mask": mask, "video_coords": image_ids}
        first_frame = self.first_frame_tokens(cond.embeds[:1])
        if first_frame is not None:  # image to video: the first frame's latent tokens, [S, C]
            wire["condition_latents"] = first_frame[0]
        return wire

    @classmethod
    def cond_kwargs_from_wire(cls, kwargs: dict) -> tuple[PromptEmbeds, torch.Tensor | None]:
        video = wire_text_tokens(kwargs)
        audio = wire_text_tokens({"encoder_hidden_states": kwargs.get("audio_encoder_hidden_states")})
        if audio.shape[0] != video.shape[0]:
            raise ValueError(f"{video.shape[0]} video text tokens but {audio.shape[0]} audio text tokens")
        cond = PromptEmbeds(torch.cat([video, audio], dim=-1)[None], torch.zeros(video.shape[0], 1))
        if kwargs.get("condition_latents") is not None:
            cond = _with_first_frame(cond, torch.as_tensor(kwargs["condition_latents"]).float()[None])
        return cond, kwargs.get("video_coords")

    # ---------------------------------------------------------------- image to video
    @torch.no_grad()
    def encode_condition_images(self, images, height: int | None = None, width: int | None = None,
                                num_frames: int | None = None) -> torch.Tensor:
        """The first frame (`uint8 [3, H, W]`) as `LTX2ImageToVideoPipeline` prepares its `image`: resized to the
        video's `height × width` (the pipeline's video processor: PIL, bilinear), [-1, 1], the VAE's mode as a
        one-frame video, normalized per channel by the VAE's latent mean and std, packed: `[1, S_frame, C]`. Not
        reproduced: the pipeline's H.264 re-compression of the image (`image_crf`, CRF 33 by default for Gemma 3
        checkpoints); this is the pipeline with `image_crf=0`."""
        if len(images) != 1:
            raise RequestError("image_path", f"LTX-2 takes 1 condition image (the first frame), got {len(images)}")
        if self.patch_t != 1:
            raise RequestError("image_path", f"image to video needs a temporal patch of 1 (the first latent frame is "
                                             f"its own tokens); this transformer's is {self.patch_t}")
        image = images[0]
        if height is None or width is None:
            height, width = self.default_size()
        if (height, width) != tuple(image.shape[1:]):
            from PIL import Image

            pil = Image.fromarray(image.permute(1, 2, 0).numpy()).resize((width, height), Image.Resampling.BILINEAR)
            image = torch.from_numpy(np.asarray(pil).copy()).permute(2, 0, 1)
        pixels = (image.float() / 255 * 2 - 1)[None, :, None]  # the video processor's arithmetic, one frame
        vae_dtype = next(self.vae.parameters()).dtype
        latents = self.vae.encode(pixels.to(self.device, vae_dtype)).latent_dist.mode().float()
        shape = (1, -1, 1, 1, 1)
        mean = self.vae.latents_mean.view(shape).to(latents.device, latents.dtype)
        std = self.vae.latents_std.view(shape).to(latents.device, latents.dtype)
        return self._pack_video((latents - mean) / std)

    def condition_on_images(self, cond: PromptEmbeds, encoded: torch.Tensor) -> PromptEmbeds:
        """The first frame's tokens appended to the conditioning as rows (each token zero-padded to whole rows), so
        the engine's denoising env, the trainer and replay carry them; the forward unfolds them."""
        return _with_first_frame(cond, encoded)

    def first_frame_tokens(self, embeds: torch.Tensor) -> torch.Tensor | None:
        """The first frame's tokens `[B, S_frame, C]` carried in a conditioning, or None (text to video)."""
        rows = embeds[:, self.settings.max_sequence_length:]
        if not rows.shape[1]:
            return None
        channels = self.transformer.config.in_channels
        per_token = -(-channels // rows.shape[-1])
        return rows.reshape(rows.shape[0], rows.shape[1] // per_token, -1)[..., :channels]

    # ---------------------------------------------------------------- latents
    def prepare_latents(self, generators, height, width, num_frames: int | None = None,
                        cond: PromptEmbeds | None = None) -> Latents:
        """`cond` (the engine passes it, `latents_need_conditioning`): with a first frame in it, image to video, and
        the state leaves the first frame out; without `cond`, the checkpoint's mode."""
        frames = self._frames(num_frames)
        self.check_size(height, width, frames)
        g = self.geometry(height, width, frames)
        batch, device = len(generators), self.device
        # Per generator: the video noise, then the audio noise, as the pipeline draws them.
        video = randn_per_sample((batch, self.vae.config.latent_channels, g.frames, g.height, g.width), generators,
                                 device=device)
        audio = randn_per_sample((batch, self.audio_channels, g.audio_frames, self.audio_mel_bins), generators,
                                 device=device)
        video = self._pack_video(video)
        image_to_video = (self.settings.image_to_video if cond is None
                          else self.first_frame_tokens(cond.embeds) is not None)
        if image_to_video:
            # The first latent frame is the condition image's, never noised nor moved: the state holds only the
            # generated tokens (the pipeline draws the first frame's noise too, and overwrites it).
            video = video[:, (g.height // self.patch) * (g.width // self.patch):]
        tokens = torch.cat([video, audio.transpose(1, 2).flatten(2)], dim=1)
        coords = self.transformer.rope.prepare_video_coords(1, g.frames, g.height, g.width, device,
                                                            fps=self.settings.frame_rate)
        return Latents(tokens, coords[0].permute(1, 0, 2).flatten(1))  # [S_video, (time, height, width) × 2]

    def _pack_video(self, latents: torch.Tensor) -> torch.Tensor:
        """`[B, C, F, H, W]` → tokens `[B, S, C·p_t·p·p]` in (frame, row, column) order, as the pipeline packs."""
        b, c, f, h, w = latents.shape
        p, pt = self.patch, self.patch_t
        x = latents.reshape(b, c, f // pt, pt, h // p, p, w // p, p)
        return x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, (f // pt) * (h // p) * (w // p), c * pt * p * p)

    def _unpack_video(self, tokens: torch.Tensor, g: Geometry) -> torch.Tensor:
        p, pt = self.patch, self.patch_t
        b = tokens.shape[0]
        x = tokens.reshape(b, g.frames // pt, g.height // p, g.width // p, -1, pt, p, p)
        return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, -1, g.frames, g.height, g.width)

    # ---------------------------------------------------------------- the transformer
    def velocity_and_uncond(self, transformer, latents, sigma, cond, uncond, guidance_scale, **options):
        # The CFG combination works on x0 = x − σ·v, so it needs the latents too.
        return super().velocity_and_uncond(transformer, latents, sigma, cond, uncond, guidance_scale,
                                           x=latents.tokens, **options)

    def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
        x = latents.tokens
        if x.device.type == "cpu" and x.shape[0] > 1:
            # One row per forward on CPU, so that a sample's velocity is bit-identical in any batch
            # (docs/architecture.md, "Rollout contract"):
            # besides BLAS, the vectorized exp (sigmoid gates, GELU, RoPE's sin and cos) rounds unlike the
            # scalar one that a tensor's last few elements get, so a row's numbers depend on its neighbours.
            return torch.cat([self._forward(transformer, x[i : i + 1], latents.ids, sigma[i : i + 1],
                                            cond.embeds[i : i + 1]) for i in range(x.shape[0])])
        return self._forward(transformer, x, latents.ids, sigma, cond.embeds)

    def _forward(self, transformer, x, coords, sigma, embeds) -> torch.Tensor:
        batch, video_tokens = x.shape[0], coords.shape[0]
        dtype = next(transformer.parameters()).dtype
        text, audio_text, mask = self.unpack_conditioning(embeds)
        if self._mask_is_full(embeds, mask):
            mask = None  # no token masked: the cross-attentions take no bias (see `_mask_is_full`)
        timestep = sigma * self.timestep_scale  # the scheduler's timestep, fp32; LTX-2.3 also takes it as σ
        video_timestep, first, video_in = timestep, 0, x[:, :video_tokens]
        if self.settings.image_to_video or embeds.shape[1] > self.settings.max_sequence_length:
            # The first frame's clean tokens before the generated ones, at timestep 0 (the pipeline's
            # `t · (1 − conditioning_mask)` per token); the audio and σ keep the step's timestep.
            image = self._first_frame(embeds, coords)
            first = image.shape[1]
            video_in = torch.cat([image.to(x), x[:, : video_tokens - first]], dim=1)
            video_timestep = torch.cat([timestep.new_zeros(batch, first),
                                        timestep[:, None].expand(batch, video_tokens - first)], dim=1)
        video_coords = coords.to(torch.float32).reshape(video_tokens, 3, 2).permute(1, 0, 2)
        video_coords = video_coords[None].expand(batch, -1, -1, -1)
        audio_tokens = x.shape[1] - (video_tokens - first)
        audio_coords = transformer.audio_rope.prepare_audio_coords(batch, audio_tokens, x.device)
        with self.forward_precision():
            video, audio = transformer(
                hidden_states=video_in.to(dtype).contiguous(),
                audio_hidden_states=x[:, video_tokens - first:].to(dtype).contiguous(),
                encoder_hidden_states=text.to(dtype), audio_encoder_hidden_states=audio_text.to(dtype),
                timestep=video_timestep, audio_timestep=timestep, sigma=timestep, encoder_attention_mask=mask,
                audio_encoder_attention_mask=mask, fps=self.settings.frame_rate, video_coords=video_coords,
                audio_coords=audio_coords, use_cross_timestep=True, return_dict=False)
        # Image to video: the first frame's velocity is dropped (the pipeline steps only the later frames).
        return torch.cat([video[:, first:].float(), audio.float()], dim=1)

    def _first_frame(self, embeds: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        """Image to video: the conditioning's first-frame tokens, checked against the video's first latent frame
        (its token count read once per position tensor, as `_mask_is_full` reads the mask)."""
        image = self.first_frame_tokens(embeds)
        if image is None:
            raise RequestError("image_path", "this LTX-2 checkpoint is image to video: a request needs one condition "
                                             "image (image_path), the first frame")
        last = getattr(self, "_last_coords", None)
        if last is None or last[0] is not coords:
            last = self._last_coords = (coords, int((coords[:, 0] == coords[0, 0]).sum()))
        if image.shape[1] != last[1]:
            raise RequestError("image_path", f"the condition image is {image.shape[1]} latent tokens, the video's "
                                             f"first frame {last[1]}: send the first frame at the video's height and "
                                             "width")
        return image

    def _mask_is_full(self, embeds: torch.Tensor, mask: torch.Tensor) -> bool:
        """Whether the text mask masks nothing (LTX-2.3's connectors fill the padding with their registers, so a
        prompt's 1,024 tokens are all kept). The transformer then gets no mask: an all-zero additive bias changes
        no score, but a bias in every text cross-attention rules out the flash and cuDNN attention kernels and
        builds a per-head bias tensor per attention call. Remembered for the last conditioning tensor, as
        `mask.all()` reads back to the host (a sync per forward otherwise)."""
        last = getattr(self, "_last_mask", None)
        if last is not None and last[0] is embeds:
            return last[1]
        full = bool(mask.all())
        self._last_mask = (embeds, full)  # holding the tensor keeps its identity from being reused
        return full

    def combine_guidance(self, v_uncond, v_cond, guidance_scale, *, transformer, sigma, x) -> torch.Tensor:
        x = x.float()
        s = sigma.view(-1, *[1] * (x.dim() - 1))
        x0_cond, x0_uncond = x - v_cond * s, x - v_uncond * s
        guided = x0_cond + (guidance_scale - 1) * (x0_cond - x0_uncond)
        return (x - guided) / s

    # ---------------------------------------------------------------- decoding
    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int | None = None, *,
               cond: PromptEmbeds | None = None, first_frame: torch.Tensor | None = None) -> torch.Tensor:
        """Image to video: the generated tokens after the first frame's: `first_frame` `[B, S_frame, C]`, or those in
        `cond`, the decoded rows' conditioning (the engine passes it: `latents_need_conditioning`)."""
        g = self.geometry(height, width, num_frames)
        frame = (g.height // self.patch) * (g.width // self.patch)
        if latents.shape[1] == g.video_tokens - frame + g.audio_frames:  # image to video: the generated tokens only
            if first_frame is None and cond is not None:
                first_frame = self.first_frame_tokens(cond.embeds)
            if first_frame is None or first_frame.shape[1] != frame or len(first_frame) != len(latents):
                raise ValueError("image to video: decode needs each row's first-frame tokens (cond or first_frame)")
            latents = torch.cat([first_frame.to(latents), latents], dim=1)
        video = self._unpack_video(latents[:, :g.video_tokens].float(), g)
        shape = (1, -1, 1, 1, 1)
        mean = self.vae.latents_mean.view(shape).to(video.device, video.dtype)
        std = self.vae.latents_std.view(shape).to(video.device, video.dtype)
        video = video * std / self.vae.config.scaling_factor + mean
        vae_dtype = next(self.vae.parameters()).dtype
        # A VAE with timestep conditioning decodes at the pipeline's default decode timestep, 0.
        timestep = None
        if self.vae.config.timestep_conditioning:
            timestep = torch.zeros(1, device=video.device, dtype=vae_dtype)
        frames = decode_rows(lambda rows: self.vae.decode(rows.to(vae_dtype), timestep, return_dict=False)[0], video,
                             per_call=self.vae_decode_batch)
        return (frames.float() / 2 + 0.5).clamp(0, 1)  # [B, 3, F, H, W]


def _with_first_frame(cond: PromptEmbeds, tokens: torch.Tensor) -> PromptEmbeds:
    """`tokens` `[1 or B, S, C]` appended to `cond` as rows of its width, each token zero-padded to whole rows
    (`Ltx2Family.first_frame_tokens` reads them back); their position ids are zeros as the text's."""
    width = cond.embeds.shape[-1]
    per_token = -(-tokens.shape[-1] // width)
    rows = pack_image_rows(torch.nn.functional.pad(tokens, (0, per_token * width - tokens.shape[-1])), width)
    rows = rows.to(cond.embeds).expand(len(cond), -1, -1)
    ids = torch.cat([cond.ids, cond.ids.new_zeros(rows.shape[1], cond.ids.shape[1])])
    return PromptEmbeds(torch.cat([cond.embeds, rows], dim=1), ids)
