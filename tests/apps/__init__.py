"""Small apps that tests run in other processes (e.g. under gunicorn)."""
