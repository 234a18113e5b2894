"""The rollout engine: owns a model for sampling and denoises one request's outputs as one batch."""

from diffrl.engine.denoise import DenoiseResult, denoise

__all__ = ["DenoiseResult", "denoise"]
