"""gunicorn settings for the example API (``python -m example_app`` passes bind/workers/threads).

- ``gthread`` workers: each worker process serves several requests at once on threads; the
  limiter's storage is thread-safe and every decision is one atomic script call in Redis.
- ``preload_app = False``: each worker builds the app, and so its Redis connection pool, after
  the fork; no socket is ever shared between processes. Preloading the app to save memory is
  fine as well: the extension registers ``os.register_at_fork`` and every forked worker drops the
  connections (and locks) it inherited from the master.
"""

from __future__ import annotations

import os

worker_class = "gthread"
workers = int(os.environ.get("EXAMPLE_WORKERS", "3"))
threads = int(os.environ.get("EXAMPLE_THREADS", "4"))
bind = os.environ.get("EXAMPLE_BIND", "127.0.0.1:8000")
preload_app = False
timeout = 30
graceful_timeout = 5
keepalive = 5
accesslog = None  # "-" prints every request
errorlog = "-"
loglevel = "info"
# gunicorn 25+ opens a control socket at one fixed path per user; several instances on one host
# (the load test runs two) would fight over it. Older versions ignore this setting.
control_socket_disable = True
