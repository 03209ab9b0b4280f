"""`kvlab epp`: kvlab's scheduler as a Gateway API Inference Extension endpoint picker (docs/gateway-api.md).

The protocol's names live here, free of the gRPC/protobuf imports, so the kind manifests
(stack/kind/envoy.py) use them without the `gateway-api` extra installed.
"""

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
METADATA_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
