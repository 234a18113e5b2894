"""Placing a run's parts on machines: Ray actors in a placement group (`ray_placement`)."""
