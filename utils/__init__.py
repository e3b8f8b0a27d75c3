"""kernel-ladder's course tools: tracing traffic, the roofline model, plots, benchmarking, exercises.

Import the submodule you need (``from utils.trace import trace``); this package imports nothing
heavy itself, so ``import utils`` stays cheap.
"""
