"""A run's plan before anything loads: `memory` (one process's peak memory term by term), `fixes` (the
cheapest change that makes it fit, and the verdict) and `inputs` (what it is computed from: the
architecture on the meta device, the workload from the settings)."""
