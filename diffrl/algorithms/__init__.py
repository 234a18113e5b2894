"""Algorithms as pure functions over tensors: advantages, train pairs, losses (DESIGN §4). No I/O."""
