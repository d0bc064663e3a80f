"""Tests of the project itself: docs, packaging, dependencies, layering, lint and types."""
