"""Defences beside rate limits: shadow limits, concurrent-requests limits, worker and fleet load
shedding, the local deny cache, and the per-request ledger that gives back what they take.
"""
