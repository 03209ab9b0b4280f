"""`kvlab calibrate`: measure this machine's vLLM, fit a simulator profile to it, compare the two.

measure.py starts engines and times requests on a grid, fit.py turns medians into a profile,
cli.py runs the passes and reports (docs/calibration.md).
"""
