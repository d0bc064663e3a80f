"""What the limiter tells the operator: Prometheus metrics and their OpenTelemetry twins."""
