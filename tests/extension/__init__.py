"""Tests of the app layer: the extension, its configuration, apps served by gunicorn."""
