"""A run's plan before anything loads: `memory` (one process's peak memory term by term, and the
cheapest change that fits) and `inputs` (what it is computed from: the architecture on the meta device,
the workload from the settings)."""
