"""Serving the promoted engine: the loader that pulls a registered version, verifies it and
loads it through the same runtime the gates drove (the HTTP server lands here too).

Imports `registry` and `components.runtime` (with the engine-directory contract and
errors), never a stage: what is served needs nothing but the engine directory.
"""
