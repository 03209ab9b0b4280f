"""The cluster twin: kvlab's own routing code on 1-128 simulated replicas, in virtual time.

The gateway's index lookup and scheduler (`gateway.router.Router`, every preset policy), the
precise and approximate indexes with the speculative layer, and the simulator's scheduler, block
pool and latency profiles run unchanged; only time is replaced (a discrete-event loop) and what
the router sees is modelled explicitly (`settings.Information`). docs/twin.md.
"""
