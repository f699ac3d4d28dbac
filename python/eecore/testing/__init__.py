"""What the tests and benchmarks hold eecore to: `reference`, the pure-PyTorch oracle of every op."""
