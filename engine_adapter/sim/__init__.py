"""The simulated engine: ground-truth GPU latency, profiling sweep, discrete-event engine."""
