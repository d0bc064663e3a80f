"""gunicorn settings for the example API (``python -m example_app`` passes bind/workers/threads).

- ``gthread`` workers: each worker process serves several requests at once on threads; the
  limiter's storage is thread-safe and every decision is one atomic script call in Redis.
- ``preload_app = False``: each worker builds the app, and so its Redis connection pool, after
  the fork; no socket is ever shared between processes. Preloading the app to save memory is
  fine as well: ``post_fork`` below tells the storage to drop connections inherited from the master.
"""

from __future__ import annotations

import os
from typing import Any

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


def post_fork(server: Any, worker: Any) -> None:
    """After the fork: drop any storage connection inherited from the master (preload_app)."""
    app = getattr(getattr(worker, "wsgi", None), "__self__", None)
    state = getattr(app, "extensions", {}).get("distlimit") if app is not None else None
    storage = getattr(state, "storage", None)
    if storage is not None:
        storage.reset_after_fork()
