"""Ray Tune sweeps (``taps sweep tune/*.yaml``) over data-mixture ratios and checkpoint-interpolation weights.

- :mod:`taps_ray.sweeps.config`: typed sweep specs (search space, objective, held-out prompts, resources).
- :mod:`taps_ray.sweeps.mixture`: a trial trains one drafter on a mixture with Ray Train (Train V2 interop).
- :mod:`taps_ray.sweeps.interpolation`: a trial averages drafters in weight space.
- :mod:`taps_ray.sweeps.trial`: tau on held-out prompts with the core decoder, shared by both.
- :mod:`taps_ray.sweeps.run`: the driver (the Tuner, resume) and ``taps sweep``'s command line.
- :mod:`taps_ray.sweeps.resources`: what one trial holds, planned against the cluster before anything starts.
- :mod:`taps_ray.sweeps.state`: a sweep folder's settings and the resume check.
- :mod:`taps_ray.sweeps.context`: what trials need (prompts, feature sets, drafters), resolved on the driver.
- :mod:`taps_ray.sweeps.results`: one row per trial, results table, CSV, plot and best config.
"""
