"""Drafters that learn the served workload: ``taps adapt`` fine-tunes a drafter's next version on captured
traffic (:mod:`~taps_ray.adapt.finetune`), a gate decides and a hot swap promotes it into a running
application (:mod:`~taps_ray.adapt.promote`), and ``taps adapt --watch`` runs that loop beside serving
(:mod:`~taps_ray.adapt.watch`). It sits above training and serving: it imports both, neither imports it;
what serving captures is a feature set (:mod:`taps_ray.data.capture`)."""
