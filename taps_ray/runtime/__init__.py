"""Ray plumbing every job shares: joining or starting a cluster (:mod:`~taps_ray.runtime.cluster`), the one
module that touches private Ray APIs (:mod:`~taps_ray.runtime.ray_compat`), the shared-storage check
(:mod:`~taps_ray.runtime.storage`), fault injection for drills (:mod:`~taps_ray.runtime.faults`) and the
placement-group reaper (:mod:`~taps_ray.runtime.placement`)."""
