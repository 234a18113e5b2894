"""The `diffrl` command line (tyro over typed dataclass configs)."""
