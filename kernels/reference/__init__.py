"""Torch reference implementations of every kvlab kernel (the CPU path of the engine)."""
