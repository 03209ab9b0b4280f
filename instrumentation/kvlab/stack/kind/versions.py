"""Every version the kind path pins, in one place (bump them together, then run the tests).

The kind release and its node image go together: kind supports a node image only with the
release that built it, so the image is pinned by digest as kind's release notes ask.
"""

from __future__ import annotations

KIND_VERSION = "v0.33.0"
# Kubernetes inside the kind nodes; manifests are validated against this version's schemas.
KUBERNETES_VERSION = "1.37.0"
KIND_NODE_IMAGE = (
    "kindest/node:v1.37.0@sha256:a1ed56cfb0e7b93589bdf97c8cd566405a265939e3620fc4f5de89adff580ae5"
)

# vLLM's official CUDA image; the same release line as the CPU build the lab calibrates against.
VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
# A small real model that needs no licence acceptance (the HF token stays optional for it).
VLLM_MODEL = "Qwen/Qwen3-0.6B"

JAEGER_IMAGE = "jaegertracing/jaeger:2.15.0"          # Jaeger v2 (OpenTelemetry Collector based)
PROMETHEUS_IMAGE = "prom/prometheus:v3.5.0"
GRAFANA_IMAGE = "grafana/grafana:12.1.0"
NVIDIA_DEVICE_PLUGIN_IMAGE = "nvcr.io/nvidia/k8s-device-plugin:v0.17.0"

# The Gateway API Inference Extension phases (docs/gateway-api.md)
GATEWAY_API_VERSION = "v1.3.0"                         # Gateway API CRDs (standard channel)
INFERENCE_EXTENSION_VERSION = "v1.0.0"                 # InferencePool inference.networking.k8s.io/v1
ENVOY_IMAGE = "envoyproxy/envoy:distroless-v1.33.2"    # the standalone chart's Envoy line
LLMD_SCHEDULER_IMAGE = "ghcr.io/llm-d/llm-d-inference-scheduler:v0.3.0"
