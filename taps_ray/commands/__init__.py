"""The ``taps`` subcommands, grouped by what they do; :mod:`taps_ray.cli` registers them."""
