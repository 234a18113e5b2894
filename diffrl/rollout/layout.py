"""How a rollout is cut into engine requests, and which seed each sample gets
(docs/architecture.md, "Rollout contract").

- group g (monotonic over the run) has `seed_base = (rollout_seed + g·n) mod 2**31`;
- the microgroup starting at sample idx sends `seed = seed_base + idx`;
- the engine gives output i the seed `seed + i`; so sample k of group g always has seed
  `seed_base + k`, whatever the microgroup size — which is what makes samples reproducible.
"""

from __future__ import annotations

SEED_MODULUS = 2**31


def group_seed_base(rollout_seed: int, group_index: int, n_samples_per_prompt: int) -> int:
    if group_index < 0:
        raise ValueError(f"group_index must be >= 0, got {group_index}")
    return (rollout_seed + group_index * n_samples_per_prompt) % SEED_MODULUS


def microgroups(n_samples_per_prompt: int, microgroup_size: int) -> list[tuple[int, int]]:
    """(start, size) of each request of a group: sizes M, M, …, and a smaller last one if M ∤ n."""
    if n_samples_per_prompt < 1:
        raise ValueError(f"--n-samples-per-prompt must be >= 1, got {n_samples_per_prompt}")
    if microgroup_size < 1:
        raise ValueError(f"--rollout-microgroup-size must be >= 1, got {microgroup_size}")
    return [(start, min(microgroup_size, n_samples_per_prompt - start))
            for start in range(0, n_samples_per_prompt, microgroup_size)]


def check_batch_invariant(
    rollout_batch_size: int, n_samples_per_prompt: int, global_batch_size: int, num_steps_per_rollout: int
) -> None:
    """rollout_batch_size × n_samples_per_prompt must equal global_batch_size × num_steps_per_rollout."""
    samples = rollout_batch_size * n_samples_per_prompt
    consumed = global_batch_size * num_steps_per_rollout
    if samples != consumed:
        raise ValueError(
            f"--rollout-batch-size × --n-samples-per-prompt = {rollout_batch_size} × {n_samples_per_prompt} = {samples} "
            f"samples per rollout, but --global-batch-size × --num-steps-per-rollout = {global_batch_size} × "
            f"{num_steps_per_rollout} = {consumed}; make them equal"
        )
