"""What every model family provides: the adapter interface shared by the engine and the trainer, and the
template that makes a new family small.

A family adapter owns the loaded components of one checkpoint and knows the family's conventions (prompt
encoding, latent packing, position ids, timestep scaling, CFG, decoding). `velocity` takes the transformer
as an argument so the trainer can pass its own (LoRA-wrapped, sharded) copy and still run exactly the code
the engine runs.

Writing a family (`diffrl/models/<name>.py`; then one import line in `registry._import_builtin_families`):

    @register_family
    class MyFamily(FamilyAdapter):
        name, name_patterns, display_name = "my_family", ("my-family",), "My Family"
        default_guidance_scale, timestep_scale = 4.0, 1000.0
        lora_target_modules, block_lists = ("attn.to_q", "attn.to_k", "attn.to_v"), ("transformer_blocks",)
        # What `load` reads (folder, class): checked, loaded in the dtype, moved to the device, NaN-checked.
        components = (Component("transformer", "diffusers:MyTransformer"), Component("vae", "diffusers:MyVAE"),
                      Component("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler", kind="scheduler"),
                      Component("tokenizer", "transformers:AutoTokenizer", kind="tokenizer"),
                      Component("text_encoder", "transformers:T5EncoderModel", text_encoder=True))
        settings_class = MySettings  # optional: per-checkpoint values, from model_index.json's `diffrl` block

        def __init__(self, transformer, vae, scheduler, tokenizer, text_encoder, *, settings): ...
        def encode_prompts(self, prompts) -> PromptEmbeds: ...
        def prepare_latents(self, generators, height, width) -> Latents: ...
        def sigmas(self, num_steps, height, width) -> torch.Tensor: ...
        def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
            with self.forward_precision():  # one forward; sigma is fp32 [B]; return the velocity in fp32
                return transformer(latents.tokens, timestep=sigma * 1000, ...)[0].float()
        def decode(self, latents, height, width) -> torch.Tensor: ...
        def default_size(self): ...
        def check_size(self, height, width): ...
        def reference_pipeline(self): ...  # diffusers' pipeline over these components (the equality test)

The base class supplies the rest: `load` (the directory check, one config read per component, the
settings, one-line errors; the `__init__` receives the components by folder name, or override
`from_components`), `velocity` (the shared-timestep context, σ as fp32 [B], CFG: both halves in one
forward when `pair_conditionings` can batch them, else two, combined by `combine_guidance`, by default
`uncond + s·(cond − uncond)`), the wire conditioning, text-encoder offload and saving. A family may still
override `load` or `velocity` whole. What several families share has one place to reuse it from:
`pipeline_over_components` (the reference pipeline), `require_pixel_multiple` and `require_rope_positions` (size
checks), `components.check_max_sequence_length` and `refuse_scheduler_options` (load checks), `vae_latents`
(unpositioned latent noise, the decode's end), `masked_text` (a per-prompt-length text conditioning with its mask
channel, and its wire form) and flux1's `flux_sigmas`, `packed_noise` and `decode_packed`. Random checkpoints for
its tests and benchmarks go in `diffrl/models/random_checkpoints/<name>.py` (size presets `tiny()` and `real()`,
`save_random_checkpoint(path, sizes)`), and `tests/test_<name>.py` checks that ODE sampling through the
engine gives `reference_pipeline()`'s images from the same noise.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.attention import attention_context
from diffrl.models.batch_invariance import (
    one_value_for_all_rows,
    rows_share_one_timestep,
)
from diffrl.models.blocks import repeated_blocks
from diffrl.models.compile import compile_blocks
from diffrl.models.components import (
    Component,
    checkpoint_root,
    flow_shifted_scheduler,
    load_components,
    read_json,
    read_model_index,
    read_settings,
    refuse_another_familys,
)
from diffrl.models.families import register_family, registered_families
from diffrl.models.weights import load_weights
from diffrl.utils.compile_settings import compile_settings
from diffrl.utils.offload import FrozenOffload

# What family modules import from here (`ModelLoadError`, `Component` and `read_json` are re-exported).
__all__ = ["Component", "FamilyAdapter", "Latents", "ModelLoadError", "PromptEmbeds", "read_json", "register_family",
           "registered_families", "repeated_blocks", "require_pixel_multiple", "require_rope_positions",
           "wire_text_tokens"]


@dataclass
class PromptEmbeds:
    """Text conditioning for a batch of prompts, as the family's transformer consumes it."""

    embeds: torch.Tensor  # [B, L, D]
    ids: torch.Tensor  # [L, n_axes] position ids, shared by the batch

    def __len__(self) -> int:
        return self.embeds.shape[0]

    def rows(self, index) -> PromptEmbeds:
        """The conditioning of some of the batch's rows (an index, slice or mask), ids unchanged."""
        return replace(self, embeds=self.embeds[index])

    def repeat(self, n: int) -> PromptEmbeds:
        """Each prompt's conditioning repeated n times in place (prompt-major), without re-encoding."""
        return replace(self, embeds=self.embeds.repeat_interleave(n, dim=0))

    def cat(self, other: PromptEmbeds) -> PromptEmbeds:
        """Stack two conditionings along the batch (CFG: uncond then cond in one forward)."""
        if not torch.equal(self.ids, other.ids):
            raise ValueError("cannot batch conditionings with different position ids")
        return replace(self, embeds=torch.cat([self.embeds, other.embeds]))

    def to(self, device: torch.device | str) -> PromptEmbeds:
        return PromptEmbeds(self.embeds.to(device), self.ids.to(device))


@dataclass
class Latents:
    """Packed noisy latents `[B, S, C]` and their position ids `[S, n_axes]`."""

    tokens: torch.Tensor
    ids: torch.Tensor


class FamilyAdapter(ABC):
    """One model family. Subclasses register themselves with `register_family`."""

    name: ClassVar[str]
    # Substrings matched (case-insensitively) against a checkpoint directory's name.
    name_patterns: ClassVar[tuple[str, ...]]
    # How messages name the model ("cannot load the FLUX 3 checkpoint …"); None: `name`.
    display_name: ClassVar[str | None] = None
    # Text-to-image families refuse image-conditioned requests instead of ignoring them. A family (or checkpoint)
    # that takes condition images sets both, and implements `encode_condition_images` and `condition_on_images`.
    accepts_image_conditioning: bool = False
    max_condition_images: int = 0
    # A checkpoint that cannot run without one (image-to-video, Qwen-Image-Edit) refuses text-only requests.
    requires_image_conditioning: bool = False
    # A family whose encoded condition images depend on the request's output size (Wan2.2 image-to-video: the first
    # frame resized to the video's size and VAE-encoded with the video's frame count) gets `height`, `width` and
    # `num_frames` in `encode_condition_images`, and the engine keys its cache of them by that size too.
    condition_images_need_size: bool = False
    # A family whose latent state depends on the request's conditioning (LTX-2 image to video: the first frame's
    # tokens are left out of the state) gets the prompt's conditioning as `prepare_latents(..., cond=...)`, and the
    # conditioning of the rows decoded as `decode(..., cond=...)`.
    latents_need_conditioning: bool = False
    # A family whose prompt encoding reads the condition images (Qwen-Image-Edit: Qwen2.5-VL sees them) implements
    # `encode_prompts_with_images` instead of `condition_on_images`.
    prompt_sees_images: bool = False
    # A run's cap on a condition image's area in pixels (`set_condition_image_area`); None: the pipeline's sizing.
    condition_image_area: int | None = None
    # Guidance scale used when a request leaves it unset.
    default_guidance_scale: ClassVar[float] = 1.0
    # Denoising steps when a request over HTTP leaves `num_inference_steps` null or out, as sglang-diffusion takes
    # its model's default then: sglang's default for the model where it serves it, else diffusers' pipeline's.
    # A family may set it per checkpoint.
    default_num_inference_steps: int = 10
    # Model timestep = timestep_scale · σ (1 for families whose transformer takes σ itself).
    timestep_scale: ClassVar[float] = 1.0
    # Whether the checkpoint's scheduler gives the transformer integer timesteps (UniPC's): `model_timesteps` then
    # truncates timestep_scale · σ as the scheduler does. Set per checkpoint by the families it concerns.
    integer_timesteps: bool = False
    # Whether conditionings of different lengths may share a batch zero-padded at the end of the token
    # axis (the family derives its text mask from the conditioning itself and its text ids are all
    # zeros): the trainer then pads a rollout's prompts to the longest instead of refusing the mix.
    pads_text: ClassVar[bool] = False
    # Module names peft wraps when training a LoRA.
    lora_target_modules: ClassVar[tuple[str, ...]]
    # Attributes of the transformer holding its repeated blocks (each one an FSDP unit).
    block_lists: ClassVar[tuple[str, ...]]
    # A transformer that wraps several of the pipeline's modules (Wan2.2's experts): its attributes holding them,
    # named as the pipeline's components. A LoRA checkpoint then holds one PEFT adapter per component, in
    # `lora/<component>/`; empty: one adapter for the transformer, in `lora/`.
    lora_components: ClassVar[tuple[str, ...]] = ()
    # Video families: `prepare_latents`, `check_size` and `decode` also take a keyword `num_frames` (None: the
    # family's `default_num_frames`) and `decode` returns `[B, C, F, H, W]`. Image families keep the signatures
    # below; the engine refuses `num_frames` other than 1 for them.
    generates_video: ClassVar[bool] = False
    default_num_frames: ClassVar[int] = 1
    # Video families whose samples depend on the frame rate (rotary positions, a prompt's duration sentence):
    # the rate they sample at. The engine refuses a request's `fps` that differs; None: `fps` changes nothing.
    frame_rate: float | None = None
    # Whether requests may set `guidance_scale_2` (the CFG scale of a second, low-noise expert); `velocity`
    # then takes it as a keyword (None: the same as guidance_scale). A family may set it per checkpoint.
    uses_guidance_scale_2: bool = False
    # Whether the family's CFG is what sglang and diffusers call "true CFG" (`true_cfg_scale`): a request's
    # `true_cfg_scale` is then its scale (it wins over `guidance_scale`); for other families it only switches CFG
    # on or off, as in sglang-diffusion (`engine.protocol.cfg_scale`).
    has_true_cfg: ClassVar[bool] = False
    # Whether the transformer's forward takes one sample (Cosmos3's packed sequence): `run_transformer` then runs
    # a batch's rows one after another, or at best one prompt's rows as one batch, so a batch of n prompts costs n
    # forwards (`diffrl bench` says so) and the trainer keeps one prompt's pairs together in its micro-batches.
    one_sample_per_forward: ClassVar[bool] = False

    # ---------------------------------------------------------------- what `load` reads
    # The checkpoint's folders, in loading order (see `diffrl.models.components`).
    components: ClassVar[tuple[Component, ...]] = ()
    # Per-checkpoint settings (a dataclass) read from the `diffrl` block of model_index.json; None: no settings.
    settings_class: ClassVar[type | None] = None
    # Whether a checkpoint without model_index.json is refused (naming the file).
    model_index_required: ClassVar[bool] = False

    transformer: torch.nn.Module
    # Mixed precision of the transformer forward (weights stay as loaded, e.g. fp32 masters):
    # None = the weights' dtype, torch.bfloat16 = bf16 autocast. Set once on the shared object, so
    # the engine's rollouts and the trainer's forwards always run at the same precision.
    autocast_dtype: torch.dtype | None = None
    # The SDPA kernel of every transformer call (`diffrl.models.attention.ATTENTION_BACKENDS`; auto: torch's
    # choice), set once on the shared object like `autocast_dtype`.
    attention_backend: str = "auto"
    # CFG's unconditional half as a forward of its own whose output carries no gradient (flow_grpo's SD3 train step
    # detaches it): the backward then covers the conditional rows only. Set once on the shared object (and through
    # `EngineSpec.detach_uncond` on an engine elsewhere), so rollouts run the two halves apart as the replay does.
    detach_uncond: bool = False
    # Images (or videos) the VAE decodes per call: None = the default (one per call on CPU, where it keeps
    # sample k's image independent of its batch; a pixel budget per call on a GPU), 0 = all at once, N = N.
    vae_decode_batch: int | None = None

    @contextlib.contextmanager
    def forward_precision(self):
        """The context every transformer call of `velocity` runs in: `autocast_dtype`, `attention_backend` and the
        compiler settings of compiled blocks (`compile_settings`: torch keeps those per thread)."""
        device_type = self.device.type
        with torch.autocast(device_type, dtype=self.autocast_dtype or torch.float32,
                            enabled=self.autocast_dtype is not None), attention_context(self.attention_backend), \
                compile_settings():
            yield

    # ---------------------------------------------------------------- loading
    @classmethod
    def load(
        cls,
        model_path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        load_text_encoder: bool = True,
        **options,
    ) -> FamilyAdapter:
        """Load a local diffusers-format directory (never a hub id): the settings, then every component of
        the family's table. `options` (a family's own load keywords) go to `from_components`."""
        root = checkpoint_root(model_path)
        refuse_another_familys(root, cls.name, cls.display_name or cls.name, cls.components)
        settings = cls.read_settings(root, read_model_index(root, required=cls.model_index_required))
        parts = load_components(root, cls.checkpoint_components(settings), label=cls.display_name or cls.name,
                                device=device, dtype=dtype, load_text_encoder=load_text_encoder)
        return cls.from_components(root, parts, settings, **options)

    @classmethod
    def read_settings(cls, root: Path, index: dict) -> Any:
        """The checkpoint's settings (`settings_class` from the `diffrl` block), or None. Families that refuse
        a kind of checkpoint by its model index do so here, before anything loads."""
        if cls.settings_class is None:
            return None
        return read_settings(cls.settings_class, index, root / "model_index.json")

    @classmethod
    def checkpoint_components(cls, settings: Any) -> Sequence[Component]:
        """The components to load for this checkpoint (default: the whole table)."""
        return cls.components

    @classmethod
    def from_components(cls, root: Path, parts: dict[str, Any], settings: Any, **options) -> FamilyAdapter:
        """The adapter over the loaded components (by folder name): `cls(**parts)`, plus `settings=`."""
        return cls(**parts, **({} if settings is None else {"settings": settings}), **options)

    def adopt_components(self, transformer: torch.nn.Module,
                         per_sample_layers: Callable[[torch.nn.Module], None] | None = None, **parts: Any) -> None:
        """The end of a family's `__init__`, once its checks have passed: `transformer` and each of `parts` become
        attributes of the same name, and on the CPU `per_sample_layers(transformer)` makes the layers whose matmul
        row count is the batch size run one distinct row at a time, so sample k is bit-identical in any batch
        (docs/architecture.md, "Rollout contract"). Not on a GPU, where batched kernels differ anyway. The
        transformer is prepared once here: it is shared with whoever holds it."""
        self.transformer = transformer
        for name, part in parts.items():
            setattr(self, name, part)
        if per_sample_layers is not None and self.device.type == "cpu":
            per_sample_layers(transformer)

    # The diffusers pipeline class, by name, that the default `reference_pipeline` builds over the family's own
    # components; a family whose pipeline needs more (several text encoders, a variant's class) overrides the method.
    reference_pipeline_class: ClassVar[str | None] = None

    def reference_pipeline(self) -> Any:
        """diffusers' own pipeline over this family's components (no copies of the weights, a copy of the
        scheduler): what the tests check the engine against and `diffrl bench` times it against; call it with
        `reference_pipeline_kwargs()`. None when diffusers has none to call the same way (the demo model)."""
        if self.reference_pipeline_class is None:
            return None
        import diffusers  # deferred: diffusers' pipelines take seconds to import

        return self.pipeline_over_components(getattr(diffusers, self.reference_pipeline_class))

    def pipeline_over_components(self, pipeline_class: type, **parts: Any) -> Any:
        """`pipeline_class` (a diffusers pipeline) over this family's own transformer, VAE, text encoder and
        tokenizer and a copy of its scheduler, its progress bar off: what most families' `reference_pipeline` is.
        The copy because the pipeline's `set_timesteps` and steps rewrite the scheduler's state, and the family's
        scheduler is the engine's. `parts`: the pipeline's other arguments by its names; ones that name a text
        encoder replace the family's one `text_encoder` and `tokenizer` (FLUX.1's two)."""
        if "text_encoder" not in parts:
            parts = {"text_encoder": self.text_encoder, "tokenizer": self.tokenizer, **parts}
        pipe = pipeline_class(transformer=self.transformer, vae=self.vae, scheduler=copy.deepcopy(self.scheduler),
                              **parts)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def reference_guidance_scale(self, guidance_scale: float) -> float:
        """A request's CFG scale in the reference pipeline's own terms (the same number unless the pipeline counts
        from 0, as Krea-2's and Z-Image's g = s − 1 do)."""
        return guidance_scale

    def reference_pipeline_kwargs(self) -> dict[str, Any]:
        """Keywords that a call of `reference_pipeline()` needs for this checkpoint besides the request's (prompt,
        steps, size, count, CFG scale): none by default (FLUX 3 names its text encoder layers)."""
        return {}

    @abstractmethod
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """Encode each prompt once."""

    def encode_condition_images(self, images: Sequence[torch.Tensor]) -> Any:
        """A request's condition images (`uint8 [3, H, W]` each) encoded once, for `condition_on_images` to attach to
        its prompt and negative prompt. Image-conditioned families implement it."""
        raise NotImplementedError(f"the {self.name} family takes no condition images")

    def encode_prompts_with_images(self, prompts: Sequence[str], encoded: Any) -> PromptEmbeds:
        """`prompt_sees_images` families: the prompts encoded with the request's encoded condition images (one
        conditioning tensor holding both, as `condition_on_images` gives)."""
        raise NotImplementedError(f"the {self.name} family takes no condition images")

    def condition_on_images(self, cond: PromptEmbeds, encoded: Any) -> PromptEmbeds:
        """One prompt's conditioning (a batch of one) with encoded condition images folded into it: what the family's
        forward then reads from the conditioning alone, so the engine's batches, the rollout's denoising env and the
        trainer carry one tensor as for text."""
        raise NotImplementedError(f"the {self.name} family takes no condition images")

    @abstractmethod
    def prepare_latents(self, generators: Sequence[torch.Generator], height: int, width: int) -> Latents:
        """Initial noise, one row per generator (per-sample streams, see `diffrl.sampling.noise`)."""

    def set_condition_image_area(self, area: int) -> None:
        """Size each condition image to at most `area` pixels (downscaled, aspect kept) before it is encoded, in place
        of the pipeline's own cap: `--condition-image-size`, as Flow-Factory's `condition_image_size` trains editing
        models on smaller sources than they sample with. Families that size a source themselves read
        `condition_image_area`; the others refuse here."""
        self.check_condition_image_area()
        self.condition_image_area = int(area)

    def condition_area_cap(self) -> dict:
        """`max_area=` for the reference-sizing helpers (`flux2_vae.crop_reference`, `fill_reference`) when a run caps
        the condition images' area; nothing (the pipeline's cap) otherwise."""
        return {} if self.condition_image_area is None else {"max_area": self.condition_image_area}

    @contextlib.contextmanager
    def condition_images_sized(self, area: int | None):
        """Within it, condition images are sized to at most `area` pixels (`set_condition_image_area`); None changes
        nothing. A run's held-out evaluation at another size than its rollouts (`--eval-condition-image-size`)."""
        if area is None:
            yield
            return
        self.check_condition_image_area()
        saved, self.condition_image_area = self.condition_image_area, int(area)
        try:
            yield
        finally:
            self.condition_image_area = saved

    def check_condition_image_area(self) -> None:
        """Refuse a cap on the condition images' area where the family sizes them otherwise (one line, naming the
        flag)."""
        if not self.accepts_image_conditioning:
            raise ModelLoadError(f"--condition-image-size: {self.display_name or self.name} takes no condition images")
        if self.condition_images_need_size:
            raise ModelLoadError(f"--condition-image-size: {self.display_name or self.name} sizes its first frame to the "
                                 "output (--height/--width), not by area")

    def set_flow_shift(self, shift: float) -> None:
        """Sample and train with the static flow shift `shift` in place of the checkpoint's schedule shift (static or
        resolution-dependent): `--flow-shift`. Families whose schedule is their scheduler's take a reshifted copy of
        it; the others override this."""
        scheduler = getattr(self, "scheduler", None)
        if scheduler is None:
            raise ModelLoadError(f"{self.name}: its schedule takes no flow shift")
        self.scheduler = flow_shifted_scheduler(self.name, scheduler, shift)

    @abstractmethod
    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """The family's schedule `[N + 1]` for this resolution (terminal 0 included). Video families also
        take `num_frames` (the engine passes it to them), for schedules shifted by the token count."""

    def velocity(
        self,
        transformer: torch.nn.Module,
        latents: Latents,
        sigma: torch.Tensor,
        cond: PromptEmbeds,
        uncond: PromptEmbeds | None,
        guidance_scale: float,
        **guidance_options,
    ) -> torch.Tensor:
        """Predicted velocity for `latents` at `sigma` ([B]); CFG when guidance_scale > 1, a single
        conditional forward otherwise. `guidance_options` (e.g. `guidance_scale_2`) go to `combine_guidance`.
        A family changes `velocity_and_uncond`, never this: the engine calls that one."""
        return self.velocity_and_uncond(transformer, latents, sigma, cond, uncond, guidance_scale,
                                        **guidance_options)[0]

    @property
    def reuses_uncond_velocity(self) -> bool:
        """Whether CFG's unconditional half can be handed to `velocity_and_uncond` by the rollout that computed it:
        the half runs apart with no graph (`detach_uncond`), so under the same weights the rollout's value is what
        a replay would compute."""
        return self.detach_uncond

    def velocity_and_uncond(
        self,
        transformer: torch.nn.Module,
        latents: Latents,
        sigma: torch.Tensor,
        cond: PromptEmbeds,
        uncond: PromptEmbeds | None,
        guidance_scale: float,
        *,
        uncond_velocity: torch.Tensor | None = None,
        **guidance_options,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`velocity`, and CFG's unconditional velocity (None without CFG). `uncond_velocity`: that half as a rollout
        computed it under these weights (`reuses_uncond_velocity`), taken in place of its forward."""
        if uncond_velocity is not None and not self.reuses_uncond_velocity:
            raise ValueError(f"{self.name}: an unconditional velocity is taken only with detach_uncond (its half "
                             "then runs apart, with no graph)")
        # A rollout step's σ is one value for every row (known without a sync): the per-row timestep
        # layers then run once for the batch (`diffrl.models.batch_invariance`).
        with rows_share_one_timestep(one_value_for_all_rows(sigma)):
            sigma = torch.as_tensor(sigma, device=latents.tokens.device, dtype=torch.float32)
            sigma = sigma.expand(latents.tokens.shape[0])
            if guidance_scale <= 1.0:
                return self.run_transformer(transformer, latents, sigma, cond), None
            if uncond is None:
                raise ValueError("guidance_scale > 1 needs the unconditional (negative) conditioning")
            both = self.pair_conditionings(uncond, cond)
            if both is not None and self.detach_uncond:  # the halves as the family pairs them, run apart
                uncond, cond = self.split_pair(both, latents.tokens.shape[0])
                both = None
            if both is None:
                # Detached, the unconditional half runs with no graph at all (its activations are never kept, and a
                # compiled block takes its inference graph): the engine's rollouts run it the same way, so a replay
                # still matches them.
                v_uncond = uncond_velocity
                if v_uncond is None:
                    with torch.no_grad() if self.detach_uncond else contextlib.nullcontext():
                        v_uncond = self.run_transformer(transformer, latents, sigma, uncond)
                v_cond = self.run_transformer(transformer, latents, sigma, cond)
            else:
                doubled = Latents(torch.cat([latents.tokens, latents.tokens]), latents.ids)
                v_uncond, v_cond = self.run_transformer(transformer, doubled, torch.cat([sigma, sigma]), both).chunk(2)
            guided = self.combine_guidance(v_uncond, v_cond, guidance_scale, transformer=transformer, sigma=sigma,
                                           **guidance_options)
            return guided, v_uncond

    def model_timesteps(self, sigma: torch.Tensor) -> torch.Tensor:
        """The scheduler's timestep for σ: σ·timestep_scale, truncated where the scheduler's are integers."""
        sigma = torch.as_tensor(sigma, dtype=torch.float32)
        if self.integer_timesteps:
            return torch.floor(sigma.double() * self.timestep_scale).float()
        return sigma * self.timestep_scale

    def run_transformer(self, transformer: torch.nn.Module, latents: Latents, sigma: torch.Tensor,
                        cond: PromptEmbeds) -> torch.Tensor:
        """One transformer forward over the rows of `latents` with conditioning `cond` and σ (fp32 [B]), inside
        `forward_precision()`: the velocity in fp32. A family that overrides `velocity` whole needs none."""
        raise NotImplementedError(f"{type(self).__name__} implements neither run_transformer nor velocity")

    def pair_conditionings(self, uncond: PromptEmbeds, cond: PromptEmbeds) -> PromptEmbeds | None:
        """Both CFG halves as one batch (unconditional rows first), or None when they cannot share a forward
        (text of different lengths or positions): CFG then runs two forwards."""
        if uncond.embeds.shape[1:] != cond.embeds.shape[1:] or not self._same_ids(uncond.ids, cond.ids):
            return None
        return replace(uncond, embeds=torch.cat([uncond.embeds, cond.embeds]))

    def split_pair(self, both: PromptEmbeds, rows: int) -> tuple[PromptEmbeds, PromptEmbeds]:
        """`pair_conditionings`' result back into its two halves (unconditional first), each as the family reads it
        (a family whose pair rewrites the negative's encoding keeps the rewrite)."""
        return replace(both, embeds=both.embeds[:rows]), replace(both, embeds=both.embeds[rows:])

    def _same_ids(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """torch.equal of two position-id tensors, remembered for the last pair compared: a denoising loop
        passes the same two tensors at every step, and comparing GPU tensors waits for the device."""
        last = getattr(self, "_last_ids_pair", None)
        if last is not None and last[0] is a and last[1] is b:
            return last[2]
        same = a.shape == b.shape and bool(torch.equal(a, b))
        self._last_ids_pair = (a, b, same)  # holding the tensors keeps their identity from being reused
        return same

    def combine_guidance(self, v_uncond: torch.Tensor, v_cond: torch.Tensor, guidance_scale: float, *,
                         transformer: torch.nn.Module, sigma: torch.Tensor) -> torch.Tensor:
        """The guided velocity from the two halves (σ fp32 [B], the transformer that ran them)."""
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    @abstractmethod
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed latents → images `[B, 3, H, W]` in [0, 1]."""

    @abstractmethod
    def default_size(self) -> tuple[int, int]:
        """(height, width) used when a request leaves them unset."""

    @abstractmethod
    def check_size(self, height: int, width: int) -> None:
        """Raise `RequestError` naming `height`/`width` when the model cannot take this size."""

    # ---------------------------------------------------------------- conditioning on sglang's wire
    # sglang-diffusion sends a request's conditioning as `pos_cond_kwargs` / `neg_cond_kwargs`: the keyword
    # arguments of its transformer's forward, per output. These two map one prompt's `PromptEmbeds` (a batch
    # of one) and the image position ids to and from that dict; families that exist in sglang override them
    # to use its names and layout. Decoding needs no weights (a class method), so a client can decode with it.
    def cond_kwargs_to_wire(self, cond: PromptEmbeds, image_ids: torch.Tensor) -> dict:
        """Default (the FLUX-style families): the text tokens as sglang's one-element `encoder_hidden_states`
        list, `txt_seq_lens`, and the position ids under the diffusers transformer's names `txt_ids`/`img_ids`."""
        embeds = cond.embeds[0]
        return {"encoder_hidden_states": [embeds], "txt_seq_lens": [int(embeds.shape[0])], "txt_ids": cond.ids,
                "img_ids": image_ids}

    @classmethod
    def cond_kwargs_from_wire(cls, kwargs: dict) -> tuple[PromptEmbeds, torch.Tensor | None]:
        """(one prompt's conditioning, image position ids or None when the wire does not carry them)."""
        text = wire_text_tokens(kwargs)
        ids = kwargs.get("txt_ids")
        if ids is None:  # all-zero ids (one axis), what families without text positions use
            ids = torch.zeros(text.shape[0], 1)
        if ids.shape[0] != text.shape[0]:
            raise ValueError(f"txt_ids has {ids.shape[0]} rows for {text.shape[0]} text tokens")
        return PromptEmbeds(text[None], ids), kwargs.get("img_ids")

    @property
    def task_type(self) -> str:
        """What the checkpoint does, in sglang-diffusion's words (its `ModelTaskType` names, which `/model_info`
        reports): text to image or video, with a condition image it requires (I2I, I2V) or accepts (TI2I, TI2V)."""
        kind = "V" if self.generates_video else "I"
        if self.requires_image_conditioning:
            return f"I2{kind}"
        return f"TI2{kind}" if self.accepts_image_conditioning else f"T2{kind}"

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def offload_idle_expert(self, device: torch.device) -> int:
        """Keep each expert's frozen weights in host memory while another expert denoises (`--offload-idle-expert`);
        returns the bytes that now wait on the host. Only a family of several experts (Wan2.2 A14B) has one idle."""
        raise ModelLoadError(f"--offload-idle-expert: the {self.name} family runs one transformer; only a checkpoint "
                             "with two experts (Wan2.2 A14B) has an idle one")

    # ---------------------------------------------------------------- text encoders off the GPU
    # With `offload_text_encoders` (`--offload-text-encoder`) the text encoders live in (pinned) host memory and visit
    # the transformer's device only while prompts are encoded: their memory (Qwen-Image's is 8 B parameters) is free
    # for rollouts and training, at the cost of one copy in per encode block (frozen: nothing is copied back).
    offload_text_encoders: bool = False
    _text_encoder_offload = None

    def text_encoder_modules(self) -> list[torch.nn.Module]:
        encoders = getattr(self, "text_encoders", None) or [getattr(self, "text_encoder", None)]
        return [m for m in encoders if m is not None]

    def offload_text_encoders_to_cpu(self) -> None:
        if self._text_encoder_offload is None:
            self._text_encoder_offload = FrozenOffload(self.text_encoder_modules())
            self._text_encoder_users, self._text_encoder_lock = 0, threading.Lock()
        self.offload_text_encoders = True

    @contextlib.contextmanager
    def text_encoders_on_device(self):
        """Inside the block the text encoders are on the compute device (a no-op without offload). Blocks may nest
        or overlap (two engines sharing the family): the encoders leave when the last one ends."""
        offload = self._text_encoder_offload
        if not self.offload_text_encoders or offload is None:
            yield
            return
        with self._text_encoder_lock:
            if offload.visiting is None:
                offload.visit(self.device)
            self._text_encoder_users += 1
        try:
            yield
        finally:
            with self._text_encoder_lock:
                self._text_encoder_users -= 1
                if self._text_encoder_users == 0:
                    offload.leave()

    @contextlib.contextmanager
    def text_encoders_when_needed(self):
        """Yields `ensure`: its first call brings the text encoders to the device (`text_encoders_on_device`) for
        the rest of the block. An engine batch whose prompts are all cached never moves an offloaded encoder."""
        with contextlib.ExitStack() as stack:
            visiting = []

            def ensure() -> None:
                if not visiting:
                    stack.enter_context(self.text_encoders_on_device())
                    visiting.append(True)

            yield ensure

    def compile(self, *, mode: str | None = None, eager_numerics: bool = True, dynamic: bool = False) -> int:
        """`--compile`: compile what the family's forward runs, regionally (`models/compile.py`; `dynamic`: symbolic
        sizes from the first call): by default its repeated blocks; returns how many. A family whose forward
        bypasses its blocks' calls compiles that too."""
        return compile_blocks(self.transformer, self.block_lists, mode=mode, eager_numerics=eager_numerics,
                              dynamic=dynamic)

    def compiled_units(self) -> dict[str, list]:
        """Per kind of compiled block, the code objects that dynamo's graphs for it are cached on (any one with
        a graph means the kind ran compiled): by default the block class's `forward`."""
        units: dict[str, list] = {}
        for block in repeated_blocks(self.transformer, self.block_lists):
            if getattr(block, "_compiled_call_impl", None) is not None:
                units.setdefault(type(block).__name__, [type(block).forward.__code__])
        return units

    def save(self, path: str | Path) -> None:
        """The transformer in diffusers layout (one file): what a full finetune changes. The text encoder
        and VAE stay in the base checkpoint; `diffrl.models.checkpoint.load_model` puts the two together."""
        self.transformer.save_pretrained(Path(path) / "transformer", safe_serialization=True, max_shard_size="1000GB")

    def load_saved_transformer(self, model_dir: Path) -> None:
        """Load into `transformer` the weights a full finetune saved with `save(model_dir)` (diffusers layout)."""
        load_weights(self.transformer, model_dir / "transformer" / "diffusion_pytorch_model.safetensors")


def wire_text_tokens(kwargs: dict) -> torch.Tensor:
    """`encoder_hidden_states` of sglang cond kwargs as one `[L, D]` tensor: sglang sends a list (one entry
    per text encoder, concatenated along the tokens as its trainers do) or, for some families, a bare tensor."""
    value = kwargs.get("encoder_hidden_states")
    parts = value if isinstance(value, list | tuple) else [value]
    if not parts or any(not isinstance(p, torch.Tensor) for p in parts):
        raise ValueError("encoder_hidden_states: expected a tensor or a list of tensors")
    parts = [p[0] if p.dim() == 3 and p.shape[0] == 1 else p for p in parts]
    if any(p.dim() != 2 for p in parts):
        raise ValueError(f"encoder_hidden_states: expected [L, D] tensors, got {[tuple(p.shape) for p in parts]}")
    return torch.cat(parts).float() if len(parts) > 1 else parts[0].float()


def require_frame_multiple(label: str, step: int, num_frames: int, note: str = "") -> None:
    """A `RequestError` on `num_frames` unless it is `step`·k + 1 (a video VAE's temporal compression keeps the first
    frame and packs `step` frames per latent frame); `label` names the model, `note` ends the list of examples."""
    if num_frames < 1 or (num_frames - 1) % step:
        raise RequestError("num_frames", f"num_frames={num_frames}: {label} needs {step}k + 1 frames (1, {step + 1}, "
                                         f"{2 * step + 1}, …{note})")


def require_pixel_multiple(label: str, step: int, **sizes: int) -> None:
    """A `RequestError` naming the first of `sizes` (height=…, width=…) that is not a positive multiple of
    `step` pixels; `label` names the model in the message."""
    for name, value in sizes.items():
        if value < step or value % step:
            raise RequestError(name, f"{name}={value}: {label} needs a positive multiple of {step} pixels")


def require_rope_positions(label: str, step: int, axes_lens: Sequence[int], *, height: int, width: int) -> None:
    """`require_pixel_multiple`, then a `RequestError` naming `height` or `width` when it needs more positions than
    the transformer's RoPE table holds on that axis (`axes_lens[1]`, `axes_lens[2]`; one position per `step`
    pixels): the limit of the NextDiT transformers of Lumina 2 and Z-Image, which position image tokens from it."""
    require_pixel_multiple(label, step, height=height, width=width)
    for name, value, axis in (("height", height, 1), ("width", width, 2)):
        largest = axes_lens[axis] * step
        if value > largest:
            raise RequestError(name, f"{name}={value}: this {label} checkpoint makes at most {largest} pixels a side "
                                     f"({axes_lens[axis]} positions × {step} pixels)")
