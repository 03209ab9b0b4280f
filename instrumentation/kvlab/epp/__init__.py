"""`kvlab epp`: kvlab's scheduler as a Gateway API Inference Extension endpoint picker (docs/gateway-api.md)."""
