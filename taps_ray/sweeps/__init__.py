"""Ray Tune sweeps (``taps sweep tune/*.yaml``) over data-mixture ratios and checkpoint-interpolation weights.

- :mod:`taps_ray.sweeps.config`: typed sweep specs (search space, objective, held-out prompts, resources).
- :mod:`taps_ray.sweeps.mixture`: a trial trains one drafter on a mixture with Ray Train (Train V2 interop).
- :mod:`taps_ray.sweeps.interpolation`: a trial averages drafters in weight space.
- :mod:`taps_ray.sweeps.trial`: tau on held-out prompts with the core decoder, shared by both.
- :mod:`taps_ray.sweeps.run`: the Tuner, resume, results table, CSV, plot and best config.
"""
