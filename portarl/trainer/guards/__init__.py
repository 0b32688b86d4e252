"""What keeps a step's numbers sound: the detectors (non-finite, spikes, degenerate output),
the step guard that applies them through the phases, the precision plan (master weights,
loss scaling) and the test hooks that inject faults."""
