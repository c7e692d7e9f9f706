"""mixrl: asynchronous RL with mixed-precision, mixed-accelerator samplers."""

__version__ = "0.1.0"
