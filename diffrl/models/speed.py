"""The forward's speed options in one object, applied the same way wherever a family is loaded to sample or
train (the trainer's policy, a colocated engine process, `diffrl serve`, `diffrl bench`), so the engine and
the trainer always run one forward:

- `attention_backend` (`--attention-backend`): the SDPA kernel of every transformer call (`models/attention.py`);
- `fuse_qkv` (`--fuse-qkv`): SD3's q/k/v projections as one matmul per stream (`models/attention.py`);
- `vae_decode_batch` (`--vae-decode-batch`): images per VAE decode call (`batch_invariance.decode_rows`);
- `float8` (`--float8`): the repeated blocks' linear layers as FP8 matmuls (`models/float8.py`);
- `compile`, `compile_mode`, `compile_eager_numerics` (`--compile`, `--compile-mode`,
  `--compile-eager-numerics`): regional compilation of the repeated blocks (`models/compile.py`, through the
  family's `compile`).

`apply` sets the first four on a family (after a LoRA adapter is added, before compilation); `compile_family`
compiles what the family's forward runs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from diffrl.models.attention import check_attention_backend, fuse_qkv_projections, fused_qkv_streams
from diffrl.models.compile import check_compile_mode
from diffrl.models.float8 import check_float8_device, convert_blocks_to_float8


@dataclass(frozen=True)
class SpeedOptions:
    attention_backend: str = "auto"
    fuse_qkv: bool = False
    vae_decode_batch: int | None = None
    float8: bool = False
    compile: bool = False
    compile_mode: str = "default"
    compile_eager_numerics: bool = True

    @classmethod
    def of(cls, config) -> SpeedOptions:
        """The options of a config that declares them under these names (`diffrl train`'s model section,
        `diffrl serve`, the colocated engine's spec); one it does not declare keeps its default."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls) if hasattr(config, f.name)})

    def check(self, deterministic: bool = False) -> None:
        """Refuse contradictory values, naming the flags (the device is checked by `apply`)."""
        check_attention_backend(self.attention_backend, None, deterministic)
        check_compile_mode(self.compile_mode)
        if self.compile_mode != "default" and not self.compile:
            raise ValueError(f"--compile-mode {self.compile_mode} needs --compile")
        if deterministic and self.compile_mode.startswith("max-autotune"):
            raise ValueError(f"--compile-mode {self.compile_mode} with --deterministic-mode: it times kernel candidates "
                             "and keeps the fastest, which may differ between runs; use --compile-mode default")
        if self.float8 and self.fuse_qkv:
            raise ValueError("--float8 with --fuse-qkv: the fused q/k/v matmul would bypass the FP8 layers; pass one")
        if self.vae_decode_batch is not None and self.vae_decode_batch < 0:
            raise ValueError(f"--vae-decode-batch must be >= 0 (0: all at once), got {self.vae_decode_batch}")

    def apply(self, family, *, deterministic: bool = False, lora_allowed_on_qkv: bool = False) -> dict[str, bool]:
        """Set the attention backend, the decode batch and the fused projections on `family`; returns the fused
        attention streams (`fused_qkv_streams`: name → fused). With --fuse-qkv, streams whose projections carry a
        LoRA adapter stay unfused (an adapter's delta needs its layer's own input, which a per-layer peft wrapper
        computes), the others fuse; when a LoRA adapter leaves no stream to fuse the option would do nothing and
        is refused, unless `lora_allowed_on_qkv` (an engine, which hosts whatever adapter a trainer sends)."""
        self.check(deterministic)
        check_attention_backend(self.attention_backend, family.device, deterministic)
        family.attention_backend = self.attention_backend
        family.vae_decode_batch = self.vae_decode_batch
        if self.float8:
            check_float8_device(family.device)
            if not convert_blocks_to_float8(family.transformer, family.block_lists):
                raise ValueError(f"--float8: no linear layer of the {family.name} transformer's blocks qualifies "
                                 "(sizes divisible by 16, outside LoRA and norms)")
        if not self.fuse_qkv:
            return {}
        fuse_qkv_projections(family.transformer)
        streams = fused_qkv_streams(family.transformer)
        if not any(streams.values()) and not lora_allowed_on_qkv:
            raise ValueError(f"--fuse-qkv: a LoRA adapter wraps the q/k/v projections of every attention stream "
                             f"({len(streams)}), so nothing would fuse; pass --lora-target-modules without them, or "
                             "drop --fuse-qkv")
        return streams

    def compile_family(self, family, dynamic: bool = False) -> int:
        """Compile what the family's forward runs (`FamilyAdapter.compile`: its repeated blocks, and a pathway that
        bypasses them; `dynamic`: symbolic sizes from the first call) when `compile` is set; returns how many blocks
        (0 when not)."""
        if not self.compile:
            return 0
        return family.compile(mode=self.compile_mode, eager_numerics=self.compile_eager_numerics, dynamic=dynamic)
