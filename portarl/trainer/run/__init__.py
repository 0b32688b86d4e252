"""A run around its steps: its output directory and lock, logs, sample log, progress bars,
stop signals, checkpoints saved and resumed, and failed writes."""
