"""Tests of flask_distlimit.storage: memory, Redis single node, Sentinel, Cluster, pools,
pipelines."""
