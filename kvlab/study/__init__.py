"""The study room: Hydra configs and their schema, experiments, sweeps and searches with their checks,
progress and reports, tasks (quality measures), workloads (traces), loggers and analysis of logged runs.
It drives the engine through `kvlab.LLM`; nothing in the engine imports it."""
