"""Where the gateway learns its replicas from: a static list (flags/config) or the Kubernetes API.

`base.Discovery` is the plug-in interface; one module per implementation.
"""
