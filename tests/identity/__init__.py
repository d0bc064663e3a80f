"""Tests of flask_distlimit.identity: identities an attacker cannot forge, client addresses,
tags."""
