"""Operator tools: resetting and listing limits, porting from Flask-Limiter, and who serves the app.
"""
