"""What a run reports: pair metrics reduced when the Trainer logs, the FLOP count, the run summary."""
