"""Comparing draft models: `specsplit canary compare` runs the same prompts through each and reports."""
