"""The serving layer above the engine: HTTP endpoints, wire formats, sglang compatibility and weight transport.

It also runs one engine in its own process (`colocated`); the engine core (diffrl.engine) never imports it.
"""
