"""Run kvlab's workloads with Locust's web UI:

    kvlab up                                  # a local stack (or pass --host to any OpenAI API)
    locust -f labs/locustfile.py              # open http://localhost:8089, pick users and go
    locust -f labs/locustfile.py --workload multi-turn --seed 3 --requests-out runs/requests.jsonl

The users, options and hooks live in `kvlab.load.locustfile` (what `kvlab bench` runs headless).
"""

from kvlab.load.locustfile import *  # noqa: F403  (ChatUser and the event hooks)
