"""Early exit: configuration, confidence measures, thresholds, and the early-exit decode step."""
