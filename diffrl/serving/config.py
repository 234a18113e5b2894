"""The flags of `diffrl serve` (run by `server.py`, which imports `ServeConfig` from here): apart from the server and
importing nothing that imports torch or fastapi, so that `diffrl serve --help` builds its parser without loading them
(tests/test_cli_help.py checks). The engine's and the HTTP layer's limits are built from it where a server starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from diffrl.engine.engine import EngineConfig
    from diffrl.serving.http_errors import ServerLimits


@dataclass
class ServeConfig:
    model_path: Path | None = None
    """Local diffusers-format model directory (default: the --checkpoint run's base model, else the shipped demo
    model)."""
    checkpoint: Path | None = None
    """Serve a trained model: a run folder (its newest checkpoint) or a checkpoint (…/checkpoints/rollout-N with
    lora/ or model/, or a model directory). A LoRA adapter is applied to --model-path (default: the run's base);
    full weights are served as they are."""
    diffusion_model_family: str | None = None
    """The model family (sd3, flux3_image, wan2_2, …); default: the run's, else detected from the model folder."""
    flow_shift: float | None = None
    """A static schedule shift in place of the model's (as `diffrl train --flow-shift`); default: the --checkpoint
    run's, else the model's own."""
    condition_image_size: int | None = None
    """Image-conditioned models: each condition image sized to at most N × N pixels of area (as `diffrl train
    --condition-image-size`); default: the --checkpoint run's, else the pipeline's own sizing."""
    offload_text_encoder: bool = False
    """Keep the (frozen) text encoders in host memory between encodes, as `diffrl train --offload-text-encoder`: their
    GPU memory goes to denoising batches (LTX-2.3's Gemma 3 12B is 22 GiB), for one copy in per batch's encode."""
    host: str = "127.0.0.1"
    """Loopback by default; binding elsewhere exposes the engine to the network."""
    port: int = 30000
    """TCP port to listen on."""
    device: str = "auto"
    """Where the model runs: auto (CUDA when present), cpu, cuda, cuda:N."""
    max_outputs_per_request: int = 64
    """Largest num_outputs_per_prompt of one request."""
    max_batch_outputs: int = 64
    """Outputs of waiting requests denoised together in one batch (requests with equal settings)."""
    stream_responses: bool = True
    """Write each rollout response while it is sent, output by output (the same bytes as a body built
    first, never held whole in memory); False: build the body, then send it."""
    update_token: str | None = None
    """Bearer token for the state-changing endpoints (/update_weights, /lora_adapter, /update_weights_from_disk,
    /release_memory_occupation, …; default: env DIFFRL_ENGINE_TOKEN). Without one, only a loopback server accepts
    them."""
    compile: bool = False
    """torch.compile the transformer's repeated blocks (as `diffrl train --compile`, with eager's bf16
    roundings kept); a LoRA adapter hosted later recompiles them once."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] = "default"
    """With --compile: torch.compile's mode (as `diffrl train --compile-mode`; reduce-overhead is refused: CUDA
    graphs fail under per-block compilation, each block's replay overwriting the previous block's output)."""
    attention_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    """SDPA kernel of the transformer's forwards (as `diffrl train --attention-backend`: a trainer pushing to
    this engine should use the same, or its first-pass log-probs drift by the kernels' rounding)."""
    fuse_qkv: bool = False
    """SD3: q/k/v projections as one matmul per stream (as `diffrl train --fuse-qkv`); streams whose projections
    a hosted LoRA adapter wraps run them one by one."""
    vae_decode_batch: int | None = None
    """Images per VAE decode call; 0: all at once; None: the default (see `diffrl train --vae-decode-batch`)."""
    float8: bool = False
    """The blocks' linear layers as FP8 matmuls (as `diffrl train --float8`: a trainer pushing to this engine
    should use the same, or its first-pass log-probs drift by FP8's rounding)."""
    # Limits (docs/wire-format.md, "Limits"): a refusal is a 4xx naming the field and changes nothing.
    max_body_bytes: int = 1 << 20
    """Largest JSON request body (bytes)."""
    max_weights_bytes: int | None = None
    """Largest /update_weights body (default: 8 bytes per transformer element, plus header room)."""
    max_prompt_chars: int = 16384
    """Longest `prompt` or `negative_prompt` of a request (characters; tokenizers truncate far below it anyway)."""
    max_output_steps: int = 4096
    """Largest num_outputs_per_prompt × num_inference_steps of one request."""
    max_num_frames: int = 1025
    """Largest `num_frames` of a video request (every published video setting is below it: Cosmos3 189)."""
    max_pixels: int = 4096 * 4096
    """Largest width × height of one output (one frame)."""
    max_request_pixels: int = 1 << 30
    """Largest num_outputs_per_prompt × num_frames × width × height of one request (12 GiB of float32 RGB output:
    64 images of 4096 × 4096, 14 Wan videos of 81 frames at 1280 × 720)."""
    request_timeout_s: float = 600.0
    """A request still unanswered this long after it arrived is abandoned (HTTP 503)."""
    max_guidance_scale: float = 100.0
    """Largest `guidance_scale`, `guidance_scale_2` or `true_cfg_scale` of a request (each must lie in 0 … this)."""
    max_noise_level: float = 10.0
    """Largest `rollout_noise_level` (the SDE steps' noise) of a request (it must lie in 0 … this)."""
    max_lora_rank: int = 256
    """Largest rank of the LoRA adapter a POST /lora_adapter may install (a pushing trainer's --lora-rank); above
    it, HTTP 400."""
    max_pending_requests: int = 1024
    """Requests in flight (waiting or running); more get HTTP 429."""
    worker_threads: int = 4
    """Threads driving denoising batches (waiting requests hold none)."""
    prompt_cache_bytes: int = 256 << 20
    """Encoded prompts kept for later requests under the same weights (bytes of device memory; 0: none)."""
    allowed_hosts: tuple[str, ...] = ()
    """Host names accepted on the state-changing endpoints besides loopback ones."""
    allowed_origins: tuple[str, ...] = ()
    """Origin headers accepted on the state-changing endpoints (default: none; web pages are refused)."""
    weights_roots: tuple[Path, ...] = ()
    """Directories POST /update_weights_from_disk may load checkpoints from, with everything under them (symlinks
    resolved first); default: none, the endpoint refuses every path."""
    image_roots: tuple[Path, ...] = ()
    """Directories a /rollout/generate request's `image_path` may name condition images under (sglang-diffusion's
    meaning of the field), with everything under them (symlinks and `..` resolved first); default: none, every path
    is refused and images come as bytes (a data: URL in JSON, raw bytes in msgpack)."""
    update_weights_from_tensor: bool = False
    """Answer POST /update_weights_from_tensor, miles-diffusion's weight sync (sglang's base64 pickles, read by a
    restricted unpickler that admits CPU tensors pickled by value and CUDA tensors shared by CUDA IPC, nothing
    else; docs/wire-format.md). Answered for a loopback peer, or with --update-token (required on a --host beyond
    loopback); CUDA IPC tensors only for a loopback peer. Off: the endpoint answers 404."""
    docs: bool = False
    """Serve /docs and /openapi.json."""
    malloc_arena_max: int = 2
    """glibc malloc arenas for the server process (0: glibc's default, 8 per core). Threads that allocate
    each get an arena of their own, and freed memory stays in them: with the default, RSS grows by
    gigabytes under bursts of concurrent requests (BENCHMARKS.md, "Server memory"). An explicit
    MALLOC_ARENA_MAX in the environment wins. Above 0, the server also trims the heap (`malloc_trim`)
    whenever it falls idle."""

    def engine_config(self) -> EngineConfig:
        from diffrl.engine.engine import EngineConfig  # deferred: the engine imports torch (slow --help)

        return EngineConfig(max_outputs_per_request=self.max_outputs_per_request,
                            max_batch_outputs=self.max_batch_outputs, max_prompt_chars=self.max_prompt_chars,
                            max_guidance_scale=self.max_guidance_scale, max_noise_level=self.max_noise_level,
                            max_output_steps=self.max_output_steps, max_num_frames=self.max_num_frames,
                            max_pixels=self.max_pixels, max_request_pixels=self.max_request_pixels,
                            request_timeout_s=self.request_timeout_s,
                            max_pending_requests=self.max_pending_requests, worker_threads=self.worker_threads,
                            max_lora_rank=self.max_lora_rank, prompt_cache_bytes=self.prompt_cache_bytes,
                            image_roots=tuple(str(Path(root)) for root in self.image_roots))

    def server_limits(self) -> ServerLimits:
        from diffrl.serving.http_errors import ServerLimits  # deferred: fastapi (slow --help)

        return ServerLimits(max_body_bytes=self.max_body_bytes, max_weights_bytes=self.max_weights_bytes,
                            allowed_hosts=tuple(self.allowed_hosts), allowed_origins=tuple(self.allowed_origins),
                            weights_roots=tuple(Path(root) for root in self.weights_roots),
                            tensor_updates=self.update_weights_from_tensor)
