"""Parity: float64 references, tolerances, seeded cases, device sweeps and their reports.

- :mod:`~portarl.parity.tolerances`: every tolerance, in one place.
- :mod:`~portarl.parity.float64`: the float64 reference implementations.
- :mod:`~portarl.parity.cases`: seeded inputs, identical on every device.
- :mod:`~portarl.parity.sweep`: run cases x backends x dtypes on a device.
- :mod:`~portarl.parity.report`: JSON reports, tables, cross-device comparison.
"""
