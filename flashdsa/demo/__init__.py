"""The main job (``flashdsa demo``): a DSA model served the way an engine serves it, on paged caches, with its
checks.

Builds a model with seeded random weights (a preset's real layer shapes, optionally fewer layers) and a KV
pool, prefills a batch whose prompts straddle the dense/sparse threshold (the longest in chunks), decodes a
few steps, runs one MTP verify step, and checks the promises of the engine. Before anything is allocated
it estimates what it will hold and refuses a preset that does not fit the device.

The parts: :mod:`~flashdsa.demo.scenario` (arguments, the scenario), :mod:`~flashdsa.demo.memory` (the
estimate), :mod:`~flashdsa.demo.checks` (what is checked, and how), :mod:`~flashdsa.demo.run` (the run and its
report), :mod:`~flashdsa.demo.context_parallel` (the same on P ranks: ``--cp`` / ``--dcp``).
"""

from flashdsa.demo.checks import TOL_RMS_PER_LAYER
from flashdsa.demo.context_parallel import PARALLEL_MODES, run_parallel_demo
from flashdsa.demo.memory import available_memory, memory_estimate
from flashdsa.demo.run import run_demo
from flashdsa.demo.scenario import DECODE_STEPS, KV_FORMATS, demo_config, max_next_n, parse_device

__all__ = ["run_demo", "run_parallel_demo", "demo_config", "memory_estimate", "available_memory", "parse_device",
           "max_next_n", "KV_FORMATS", "DECODE_STEPS", "PARALLEL_MODES", "TOL_RMS_PER_LAYER"]
