"""Engine adapters: the engine-agnostic adapter core and the simulated engine."""
