"""The `hidream` family: HiDream-I1 (diffusers' `HiDreamImageTransformer2DModel`, driven by `HiDreamImagePipeline`),
text to image.

HiDream-I1 is a 17 B sparse DiT: 16 double-stream and 32 single-stream blocks whose feed-forwards are mixtures of
experts (a shared SwiGLU plus the top 2 of 4 routed ones per token), conditioned by four text encoders. A checkpoint
is a local diffusers-format directory:

    transformer/      HiDreamImageTransformer2DModel      vae/          AutoencoderKL (16 latent channels, f8)
    text_encoder/     CLIPTextModelWithProjection (L)     tokenizer/    its CLIP tokenizer
    text_encoder_2/   CLIPTextModelWithProjection (G)     tokenizer_2/  its CLIP tokenizer
    text_encoder_3/   T5EncoderModel (T5-XXL)             tokenizer_3/  its T5 tokenizer
    text_encoder_4/   LlamaForCausalLM (Llama 3.1 8B)     tokenizer_4/  its tokenizer
    scheduler/        FlowMatchEulerDiscreteScheduler

Its model_index.json may carry a `diffrl` block with `max_sequence_length` (128, the pipeline's) and `default_size`
(1024, the pipeline's).

What this adapter reproduces of diffusers' `HiDreamImagePipeline` (checked by `tests/test_hidream.py`):
- conditioning, the pipeline's default prompt handling (one prompt for all four encoders, the empty negative prompt):
  both CLIPs' projected pooled vectors side by side (their tokenizers padded to `max_sequence_length`, the pipeline's
  window, not CLIP's 77: HiDream's CLIPs have 248 positions); T5's last hidden state over `max_sequence_length`
  tokens with the tokenizer's mask; the Llama's hidden states after every layer (`hidden_states[1:]`, computed with
  the mask, its pad token set to the EOS token as the pipeline does), of which the transformer reads the layers its
  `llama_layers` config names, one per block. Nothing is masked in the transformer: padding tokens are attended.
  Packed as one tensor `[B, L_t5 + K·L_llama + 1, D]` (D the widest of the three): T5's tokens, then each of the K
  distinct layers the transformer reads, then the pooled vector as one row, each zero-padded to D;
- the forward: the VAE's latents `[B, 16, H/8, W/8]` as they are (the transformer patchifies them), the scheduler's
  timestep (σ·1000), and the transformer's output negated (`noise_pred = -noise_pred`) as the velocity;
- the schedule: the scheduler's `set_timesteps(N, mu=calculate_shift(transformer.max_seq))` (HiDream's schedulers
  shift statically, so μ is ignored: shift 3 or 6 as the checkpoint's scheduler says); decode
  `latents / scaling_factor + shift_factor`;
- CFG: `uncond + s·(cond − uncond)` above s = 1 with the negative prompt (default 5, the pipeline's); the pipeline
  runs both halves in one forward, as the engine does.

The pipeline rescales every requested size to the area of its default size (1024² at real size) before sampling;
diffrl samples the size a request names, so the two agree at the default area (any aspect ratio whose rescale is the
identity). A non-square image is zero-padded by the forward to `max_seq` patches (its config's `max_resolution`,
128² latents at real size) and the padding's keys masked: a non-square request of more patches is refused. The transformer's mixture-of-experts feed-forwards run, in eval mode, diffusers' `moe_infer`, which has no
gradient: this adapter replaces it with the same computation kept differentiable (`_DifferentiableMoE`), so
trained adapters and weights inside the experts and the router get gradients. Image-conditioned requests are refused
(text to image only); a scheduler other than FlowMatchEulerDiscreteScheduler (HiDream-I1-Full ships UniPC) is
refused at load: replace its scheduler/ folder with a flow-matching Euler one of the same shift.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.base import (
    Component,
    FamilyAdapter,
    Latents,
    PromptEmbeds,
    register_family,
    require_pixel_multiple,
    wire_text_tokens,
)
from diffrl.models.batch_invariance import embed_rows_one_at_a_time
from diffrl.models.components import refuse_scheduler_options, scheduler_sigmas
from diffrl.models.flux1 import UNSUPPORTED_SCHEDULER_OPTIONS
from diffrl.models.vae_latents import decode_images, latent_noise

TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")  # CLIP-L, CLIP-G, T5, Llama
TOKENIZERS = ("tokenizer", "tokenizer_2", "tokenizer_3", "tokenizer_4")


@dataclass
class HiDreamSettings:
    """Per-checkpoint values outside the components' configs (the `diffrl` block of model_index.json)."""

    max_sequence_length: int = 128  # HiDreamImagePipeline's default window for every text encoder
    default_size: int = 1024  # the pipeline's default_sample_size (128) × the VAE's 8


class _DifferentiableMoE:
    """diffusers' `MOEFeedForwardSwiGLU` in eval mode, with gradients: `moe_infer` runs under `torch.no_grad`, so a
    trained expert or router would get none. Same sums in the same order: each token's routed experts' outputs,
    weighted, added to zeros in expert order, then the shared expert's. `per_sample` (CPU): each sample's tokens are
    routed on their own, so an expert's matmul row count never depends on the batch mates (rollout contract)."""

    per_sample = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.per_sample and x.shape[0] > 1:
            return torch.cat([self._forward(x[i : i + 1]) for i in range(x.shape[0])])
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_idx, topk_weight, _ = self.gate(x)
        flat = x.reshape(-1, x.shape[-1])
        token = torch.arange(flat.shape[0], device=x.device)[:, None].expand_as(topk_idx).reshape(-1)
        expert_of, weight_of = topk_idx.reshape(-1), topk_weight.reshape(-1, 1)
        out = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            chosen = (expert_of == i).nonzero()[:, 0]
            if chosen.numel() == 0:
                continue
            rows = token[chosen]
            routed = expert(flat[rows]) * weight_of[chosen]
            out = out.to(routed.dtype).index_add(0, rows, routed)
        return out.view(x.shape) + self.shared_experts(x)


def _make_moe_differentiable(transformer, per_sample: bool = False) -> None:
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    for module in transformer.modules():
        if isinstance(module, MOEFeedForwardSwiGLU):
            base = type(module).__mro__[2] if isinstance(module, _DifferentiableMoE) else type(module)
            # A subclass, not a patched method: a deep copy of the model (an old policy) calls its own weights.
            module.__class__ = type(f"Differentiable{base.__name__}", (_DifferentiableMoE, base),
                                    {"per_sample": per_sample})


def _run_per_sample_layers_row_by_row(transformer) -> None:
    """Sample k bit-identical in any batch, on CPU (docs/architecture.md, "Rollout contract"): the timestep and
    pooled-text MLPs and every AdaLN modulation (the matmuls whose row count is the batch size) run one distinct row
    at a time, and the experts route each sample's tokens on their own. Not on GPU, where batched kernels differ
    anyway."""
    embed_rows_one_at_a_time(transformer.t_embedder.timestep_embedder)
    embed_rows_one_at_a_time(transformer.p_embedder.pooled_embedder, timestep=False)
    for name, module in transformer.named_modules():
        if name.endswith("adaLN_modulation.1"):
            embed_rows_one_at_a_time(module, timestep=False)
    _make_moe_differentiable(transformer, per_sample=True)


@register_family
class HiDreamFamily(FamilyAdapter):
    name = "hidream"
    name_patterns = ("hidream",)
    display_name = "HiDream-I1"
    default_guidance_scale = 5.0  # HiDreamImagePipeline's default guidance_scale (real CFG)
    default_num_inference_steps = 50  # the pipeline's default
    timestep_scale = 1000.0  # the transformer takes the scheduler's timestep, σ·1000
    # The joint attention's projections of both streams (the single-stream blocks have the image stream's alone).
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out", "to_q_t", "to_k_t", "to_v_t", "to_out_t")
    block_lists = ("double_stream_blocks", "single_stream_blocks")
    components = (
        Component("transformer", "diffusers:HiDreamImageTransformer2DModel"),
        Component("vae", "diffusers:AutoencoderKL"),
        Component("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler", kind="scheduler"),
        *(Component(name, "transformers:AutoTokenizer", kind="tokenizer") for name in TOKENIZERS),
        Component("text_encoder", "transformers:CLIPTextModelWithProjection", text_encoder=True),
        Component("text_encoder_2", "transformers:CLIPTextModelWithProjection", text_encoder=True),
        Component("text_encoder_3", "transformers:T5EncoderModel", text_encoder=True),
        Component("text_encoder_4", "transformers:LlamaForCausalLM", text_encoder=True),
    )
    settings_class = HiDreamSettings

    def __init__(self, transformer, vae, scheduler, text_encoders, tokenizers, *,
                 settings: HiDreamSettings | None = None):
        settings = copy.copy(settings or HiDreamSettings())
        config = transformer.config
        if type(scheduler).__name__ != "FlowMatchEulerDiscreteScheduler":
            raise ModelLoadError(f"hidream: the scheduler is {type(scheduler).__name__}; this adapter samples with "
                                 "FlowMatchEulerDiscreteScheduler's steps (HiDream-I1 Dev and Fast ship it; for "
                                 "Full, replace scheduler/ with one of the same shift)")
        refuse_scheduler_options(self.name, scheduler, UNSUPPORTED_SCHEDULER_OPTIONS)
        if config.in_channels != vae.config.latent_channels:
            raise ModelLoadError(f"hidream: the transformer takes {config.in_channels} channels, the VAE makes "
                                 f"{vae.config.latent_channels}")
        if len(config.llama_layers) != config.num_layers + config.num_single_layers:
            raise ModelLoadError(f"hidream: llama_layers names {len(config.llama_layers)} layers for "
                                 f"{config.num_layers + config.num_single_layers} blocks")
        if settings.max_sequence_length < 1:
            raise ModelLoadError(f"hidream: max_sequence_length must be positive, got {settings.max_sequence_length}")
        tokenizers = list(tokenizers)
        if tokenizers[3] is not None:
            tokenizers[3].pad_token = tokenizers[3].eos_token  # as HiDreamImagePipeline.__init__ sets it
        _make_moe_differentiable(transformer)
        self.adopt_components(transformer, _run_per_sample_layers_row_by_row, vae=vae, scheduler=scheduler,
                              text_encoders=list(text_encoders), tokenizers=tokenizers, settings=settings)
        self.vae_scale = 2 ** (len(vae.config.block_out_channels) - 1)
        self.pixels_per_token = self.vae_scale * config.patch_size
        self.llama_layers = sorted(set(config.llama_layers))  # the distinct layers the blocks read, carried once
        self.t5_width, self.llama_width = config.caption_channels
        self.t5_tokens = min(settings.max_sequence_length, tokenizers[2].model_max_length)
        self.llama_tokens = min(settings.max_sequence_length, tokenizers[3].model_max_length)

    @classmethod
    def from_components(cls, root, parts, settings) -> HiDreamFamily:
        return cls(parts["transformer"], parts["vae"], parts["scheduler"], [parts[n] for n in TEXT_ENCODERS],
                   [parts[n] for n in TOKENIZERS], settings=settings)

    def reference_pipeline(self):
        """diffusers' `HiDreamImagePipeline` over this family's own components (a copy of the scheduler), its
        default size this checkpoint's (the pipeline rescales every request to that area)."""
        from diffusers import HiDreamImagePipeline

        pipe = self.pipeline_over_components(HiDreamImagePipeline, **dict(zip(TEXT_ENCODERS, self.text_encoders)),
                                             **dict(zip(TOKENIZERS, self.tokenizers)))
        pipe.default_sample_size = self.settings.default_size // self.vae_scale
        return pipe

    def reference_pipeline_kwargs(self) -> dict:
        return {"max_sequence_length": self.settings.max_sequence_length}

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        return self.settings.default_size, self.settings.default_size

    def check_size(self, height: int, width: int) -> None:
        require_pixel_multiple("HiDream-I1", self.pixels_per_token, height=height, width=width)
        patches = (height // self.pixels_per_token) * (width // self.pixels_per_token)
        if height != width and patches > self.transformer.max_seq:
            # A non-square image is zero-padded to `max_seq` patches (its config's max_resolution) by the forward.
            raise RequestError("height", f"{height}x{width}: this HiDream-I1 checkpoint makes non-square images of at "
                                         f"most {self.transformer.max_seq} patches of {self.pixels_per_token} pixels "
                                         f"(its max_resolution); this size has {patches}")

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        from diffusers.pipelines.hidream_image.pipeline_hidream_image import calculate_shift

        scheduler = copy.deepcopy(self.scheduler)  # set_timesteps changes the scheduler's state
        scheduler.set_timesteps(num_steps, device="cpu", mu=calculate_shift(self.transformer.max_seq))
        return scheduler_sigmas(self.name, scheduler, num_steps, self.device)

    # ---------------------------------------------------------------- conditioning
    def _clip_pooled(self, index: int, prompts: list[str]) -> torch.Tensor:
        encoder, tokenizer = self.text_encoders[index], self.tokenizers[index]
        ids = tokenizer(prompts, padding="max_length", max_length=min(self.settings.max_sequence_length, 218),
                        truncation=True, return_tensors="pt").input_ids
        return encoder(ids.to(encoder.device), output_hidden_states=True)[0]

    def _t5(self, prompts: list[str]) -> torch.Tensor:
        encoder, tokenizer = self.text_encoders[2], self.tokenizers[2]
        batch = tokenizer(prompts, padding="max_length", max_length=self.t5_tokens, truncation=True,
                          add_special_tokens=True, return_tensors="pt")
        return encoder(batch.input_ids.to(encoder.device), attention_mask=batch.attention_mask.to(encoder.device))[0]

    def _llama(self, prompts: list[str]) -> torch.Tensor:
        """The distinct layers the blocks read, `[B, K, L, D]`. The pipeline also asks for `output_attentions`,
        which changes no hidden state (the attention kernel is the config's) and is left out."""
        encoder, tokenizer = self.text_encoders[3], self.tokenizers[3]
        batch = tokenizer(prompts, padding="max_length", max_length=self.llama_tokens, truncation=True,
                          add_special_tokens=True, return_tensors="pt")
        out = encoder(batch.input_ids.to(encoder.device), attention_mask=batch.attention_mask.to(encoder.device),
                      output_hidden_states=True)
        layers = out.hidden_states[1:]
        return torch.stack([layers[k] for k in self.llama_layers], dim=1)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        if any(encoder is None for encoder in self.text_encoders):
            raise RuntimeError("this HiDream-I1 model was loaded without its text encoders")
        prompts = list(prompts)
        pooled = torch.cat([self._clip_pooled(0, prompts), self._clip_pooled(1, prompts)], dim=-1).float()
        t5 = self._t5(prompts).float()
        llama = self._llama(prompts).float()
        return PromptEmbeds(*self.pack_conditioning(t5, llama, pooled))

    @staticmethod
    def pack_conditioning(t5: torch.Tensor, llama: torch.Tensor, pooled: torch.Tensor):
        """(T5 tokens `[B, Lt, Dt]`, Llama layers `[B, K, Ll, Dl]`, pooled `[B, P]`) → the packed conditioning
        `[B, Lt + K·Ll + 1, D]` and its all-zero position ids (the transformer positions text itself)."""
        width = max(t5.shape[-1], llama.shape[-1], pooled.shape[-1])
        rows = [torch.nn.functional.pad(t5, (0, width - t5.shape[-1])),
                torch.nn.functional.pad(llama.flatten(1, 2), (0, width - llama.shape[-1])),
                torch.nn.functional.pad(pooled, (0, width - pooled.shape[-1]))[:, None]]
        packed = torch.cat(rows, dim=1)
        return packed, torch.zeros(packed.shape[1], 1, device=packed.device)

    def unpack_conditioning(self, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T5 tokens `[B, Lt, Dt]`, Llama layers `[B, K, Ll, Dl]`, pooled `[B, P]`) from the packed conditioning."""
        t5_tokens = embeds.shape[1] - 1 - len(self.llama_layers) * self.llama_tokens
        t5 = embeds[:, :t5_tokens, : self.t5_width]
        llama = embeds[:, t5_tokens:-1, : self.llama_width].unflatten(1, (len(self.llama_layers), -1))
        return t5, llama, embeds[:, -1, : self.transformer.config.text_emb_dim]

    def cond_kwargs_to_wire(self, cond: PromptEmbeds, image_ids: torch.Tensor) -> dict:
        """The transformer's own argument names (sglang-diffusion serves no HiDream): T5's tokens as
        `encoder_hidden_states_t5` (also `encoder_hidden_states`, a one-element list), the Llama layers the blocks
        read as `encoder_hidden_states_llama3` [K, Ll, Dl] with their indices in `llama_layers`, and
        `pooled_embeds` [P]."""
        t5, llama, pooled = self.unpack_conditioning(cond.embeds[:1])
        return {"encoder_hidden_states": [t5[0]], "encoder_hidden_states_t5": t5[0],
                "encoder_hidden_states_llama3": llama[0], "llama_layers": list(self.llama_layers),
                "pooled_embeds": pooled[0]}

    @classmethod
    def cond_kwargs_from_wire(cls, kwargs: dict) -> tuple[PromptEmbeds, torch.Tensor | None]:
        t5 = wire_text_tokens(kwargs)
        llama, pooled = kwargs.get("encoder_hidden_states_llama3"), kwargs.get("pooled_embeds")
        if not isinstance(llama, torch.Tensor) or llama.dim() != 3:
            raise ValueError("encoder_hidden_states_llama3: expected a [K, L, D] tensor, the Llama layers the "
                             "blocks read")
        if not isinstance(pooled, torch.Tensor) or pooled.dim() != 1:
            raise ValueError("pooled_embeds: expected a [P] tensor, both CLIPs' pooled vectors")
        packed, ids = cls.pack_conditioning(t5[None].float(), llama[None].float(), pooled[None].float())
        return PromptEmbeds(packed, ids), None

    # ---------------------------------------------------------------- sampling
    def prepare_latents(self, generators, height, width) -> Latents:
        self.check_size(height, width)
        shape = (self.transformer.config.in_channels, height // self.vae_scale, width // self.vae_scale)
        return latent_noise(generators, shape, self.device)

    def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
        dtype = next(transformer.parameters()).dtype
        t5, llama, pooled = self.unpack_conditioning(cond.embeds)
        # The forward indexes its Llama input by layer number (`[llama[k] for k in llama_layers]`): a mapping from
        # each carried layer's number to its `[B, L, D]` tokens reads the same without the unread layers.
        layers = {k: llama[:, j].to(dtype) for j, k in enumerate(self.llama_layers)}
        with self.forward_precision():
            out = transformer(hidden_states=latents.tokens.to(dtype), timesteps=(sigma * self.timestep_scale).to(dtype),
                              encoder_hidden_states_t5=t5.to(dtype), encoder_hidden_states_llama3=layers,
                              pooled_embeds=pooled.to(dtype), return_dict=False)[0]
        return -out.float()  # the pipeline's `noise_pred = -noise_pred`

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        config = self.vae.config
        latents = latents / config.scaling_factor + (config.shift_factor or 0.0)
        return decode_images(self.vae, latents, per_call=self.vae_decode_batch)
