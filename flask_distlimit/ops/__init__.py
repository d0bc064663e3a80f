"""Operator tools: resetting and listing limits, porting from Flask-Limiter, who serves the app."""
