"""The one implementation of flow-matching sampling math, shared by the engine and the trainer.

- `schedule`: sigma schedules (static shift, resolution-dependent dynamic shift).
- `noise`: per-sample generators, so sample k's noise never depends on its batch.
- `steps`: the SDE (Flow-GRPO), CPS, DanceGRPO and ODE transitions with their log-probs.
"""

from diffrl.sampling.noise import make_generators, randn_per_sample
from diffrl.sampling.schedule import (
    base_sigmas,
    dynamic_shift_sigmas,
    flux2_empirical_mu,
    make_sigmas,
    resolution_mu,
    shift_sigmas,
)
from diffrl.sampling.steps import (
    SDE_TYPES,
    StepOutput,
    cps_step,
    dance_step,
    noised,
    ode_step,
    sde_step,
    transition,
)

__all__ = [
    "SDE_TYPES",
    "StepOutput",
    "base_sigmas",
    "cps_step",
    "dance_step",
    "dynamic_shift_sigmas",
    "flux2_empirical_mu",
    "make_generators",
    "make_sigmas",
    "noised",
    "ode_step",
    "randn_per_sample",
    "resolution_mu",
    "sde_step",
    "shift_sigmas",
    "transition",
]
