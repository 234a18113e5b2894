"""diffrl: reinforcement-learning post-training for flow-matching diffusion models."""

__version__ = "0.1.0"
