"""The scheduler: filters -> weighted scorers -> picker. `base` holds the pipeline; one module per
scorer; `pickers` holds the choice rules (max score, round robin, random)."""
