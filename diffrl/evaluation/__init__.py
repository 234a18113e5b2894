"""Held-out evaluation: ODE sampling at fixed seeds, scored by the shapes verifier."""
