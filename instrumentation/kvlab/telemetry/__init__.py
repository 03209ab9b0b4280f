"""Telemetry: span/attribute/metric names as constants (`names`), OTel setup from OTEL_* env (`setup`).

Instrumentation imports only the OpenTelemetry *API* and `names`; where data goes is decided by
`setup` at process start, never by instrumented code.
"""
