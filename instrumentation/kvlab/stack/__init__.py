"""Runners: the local process stack (`kvlab up/status/down`, used by `kvlab lab`) and kind."""
