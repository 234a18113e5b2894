"""Checkpoints with random weights, built in code (no download): one module per family.

Each module has two size presets, `tiny()` (small enough for a CPU test) and `real()` (the family's real
transformer and VAE, with shallow text encoders of the real widths: a prompt is encoded once per request, so
their depth does not change what a benchmark of sampling and training measures), and
`save_random_checkpoint(path, sizes=None, ...)`, which writes a diffusers-format directory (default: `tiny()`)
and returns its path. The demo model is built in memory instead (`demo.random_family(sizes)`;
`family.save(path)` writes it).
"""
