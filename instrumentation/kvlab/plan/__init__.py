"""`kvlab plan`: the fewest replicas each routing policy needs to meet an SLO (search.py), from twin runs."""
