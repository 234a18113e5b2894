"""Algorithms as pure functions over tensors: advantages, train pairs, losses (docs/architecture.md). No I/O."""
