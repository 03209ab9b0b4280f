"""The kind cluster path (`kvlab cluster`): cluster lifecycle through `kind`, manifests rendered
from the topology, everything in the cluster through the `kubernetes` client. See docs/kind.md.

`cluster_target(target, context)` gives `kvlab bench`/`kvlab lab` the base URL of the gateway or
the cache-blind baseline in a kind cluster.
"""

from kvlab.stack.kind.cli import main
from kvlab.stack.kind.forward import cluster_target

__all__ = ["cluster_target", "main"]
