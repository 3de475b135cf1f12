"""Rollouts: engines that sample completions, batch assembly, and the per-epoch DataModule."""
