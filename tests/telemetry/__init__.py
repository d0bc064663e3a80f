"""Tests of flask_distlimit.telemetry: Prometheus and OpenTelemetry metrics, bounded labels."""
