"""Run health (docs/health.md): the signs of collapse and mismatch-aware pool health, as pure functions."""
